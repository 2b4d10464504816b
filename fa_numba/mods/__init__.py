"""Score modifications (score_mod): an elementwise function of a score and its position, with its derivatives
(proofs/L13_score_mods.md; issue 27).

    S'_bhij = mod(S_bhij, b, h, i, j, *captured),   S = scale * Q K^T,

applied after the scale and before the mask and the row max, as FlexAttention's `score_mod`. Positions:
b is the batch index (leading batch axes flattened, as `shapes.batch_shape` counts them), h the *query* head
(with GQA several query heads read one K/V head, each with its own h), i the query position in [0, N_q), j the
key position in [0, N_k), all 0-based within the problem. The softmax then runs on S' exactly as on S.

A `ScoreMod` holds

    fn(score, b, h, i, j, *captured) -> the modified score
    grad(score, b, h, i, j, *captured) -> d fn / d score           (None: forward only)
    captured: a tuple of arrays the functions read (per-head slopes, a bias table, a constant), passed
        explicitly as the last arguments, so a kernel can pass them as device arrays. A torch tensor that
        requires grad is a learnable one (`ScoreMod.learnable`): read at every call, its gradient reaches
        it through `fa_numba.autograd`.
    captured_grad: one entry per captured array, None where that array takes no gradient, else
        f(score, b, h, i, j, *captured) -> (index, d fn / d captured[index]): the one entry of that array
        the pair reads and the derivative with respect to it (a mod that reads several entries of one array
        must pass the array once per entry it reads)

The functions must be plain Python on scalars, the subset Numba compiles as CUDA device functions: float
and int arithmetic, `math` functions (math.tanh, math.exp, ...), comparisons and conditional expressions,
and indexing the captured arrays with integers (no NumPy calls on arrays, no allocation, no Python objects,
no closures over mutable state; a closure over a Python float or int is compiled as a constant). The
built-ins below are written so; the reference (`fa_numba.reference`) calls them from Python, on NumPy scalars
of the computation's dtype (np.float64 in the reference). Python's `math` raises OverflowError or ValueError
(math.exp(1000), math.log(-1)) where a compiled device function returns inf or NaN: the reference reports
such a raise, as any other, as a ModError naming the mod, the function, the pair and the score, the
original exception its __cause__. The CUDA simulator runs the functions as Python too, and a raise in a
kernel there is a ModError the same way (kernels/score_mod.py). A GPU reports none: numba-cuda compiles a
raise in device code to an early return of that thread, checked only in kernels compiled with debug=True,
which fa_numba's are not; the thread's unwritten results stay unwritten. The check before a launch compiles
the functions and never runs them: the host (the reference, `check`) is where a raise is caught.

Masked pairs (proofs/L13, claim 2): the reference evaluates fn, grad and captured_grad at visible pairs
only; a masked pair's S' is -inf by the mask, never by fn. So a mod that is undefined, NaN or raises where
the mask hides the pair (softcap of an inf score at a masked key, log(i - j + 1) above a causal diagonal)
changes nothing. A mod returning -inf is not a mask: a row whose visible S' are all -inf is alive, and gets
O = NaN, LSE = -inf, as the dense formula has it (fa_numba.reference's non-finite rule).

Built-ins (`builtins`), each with the derivative with respect to the score and to its captured array:

    alibi(slopes)             score + slopes[h] (j - i)             slopes: (H,), d/d slopes[h] = j - i
    softcap(cap)              cap tanh(score / cap)                 cap > 0, d/d score = 1 - tanh^2(score / cap)
    relative_bias(table)      score + table[h, i - j + N_k - 1]     table: (H, N_q + N_k - 1), d/d entry = 1
    temperature(t)            score / t                             t > 0, d/d t = -score / t^2

Their arrays are float64 copies, read-only: a built-in is a value, fixed when it is made (make a new one to
change it). A ScoreMod built by hand reads its captured arrays as given at every call (like q, k, v), so an
array changed in place changes the next call. ScoreMods compare and hash by identity.

Captured dtypes: int8 to int64, uint8 to uint64, float32 and float64 are read as they are; float16 and
bfloat16 (ml_dtypes arrays, CPU torch tensors; a torch bfloat16 tensor is read through ml_dtypes) as their
float32 widening, exact, made at each call (`ScoreMod.arrays`), by the reference and the kernels alike; any
other dtype is a TypeError from ScoreMod() naming the array.

ALiBi with N_q != N_k: its bias depends on j - i, not on the bottom-right aligned j - (i + N_k - N_q); the two
differ by slopes[h] (N_k - N_q), a constant per head and row, which the softmax ignores: O is the same either
way, LSE moves by that constant.

`check(mod, n_q=..., n_k=..., heads=...)` (`check`) tests grad and every captured_grad against central
differences over Hypothesis-drawn scores and positions (Hypothesis is a test dependency: the `test` extra) and
raises ModCheckError, an AssertionError, naming the argument that disagrees. `scores`, `derivatives` and
`captured_gradients` (`core`) evaluate a mod over the visible pairs of a (B, H, N_q, N_k) score array: what
`reference` calls. Cost: one Python call per visible pair and function, about a microsecond each; the
reference is meant for test sizes (B H N_q N_k up to ~10^5).

Layering: imports NumPy only; `reference` imports this package (masks are read through `mask.dense`). The
modules: `core` (ScoreMod, its errors, evaluation, `lookup` of a mod by its `key`), `builtins`, `check`, and
`conventions` (the mods behind the drop-ins' arguments: SDPA's float attn_mask, flash-attn's softcap and
alibi_slopes).

>>> import numpy as np
>>> from fa_numba import reference
>>> slopes = alibi([0.5, 0.25])
>>> float(slopes.fn(1.0, 0, 1, 3, 1, *slopes.captured))   # 1 + 0.25 (1 - 3)
0.5
>>> cap = softcap(2.0)
>>> bool(abs(cap.fn(1e4, 0, 0, 0, 0, *cap.captured)) <= 2.0)
True
>>> check(cap, n_q=4, n_k=4, heads=1)   # grad and the cap's gradient agree with central differences
>>> q = k = v = np.eye(2)
>>> out, lse = reference.attention(q, k, v, score_mod=temperature(0.5))
>>> bool(np.allclose(out, reference.attention(q, k, v, scale=2 / np.sqrt(2))[0], rtol=1e-15, atol=0))
True
"""

from fa_numba.mods.builtins import alibi, relative_bias, softcap, temperature
from fa_numba.mods import conventions
from fa_numba.mods.check import check
from fa_numba.mods.core import (ModCheckError, ModError, ScoreMod, captured_gradients, check_score_mod, derivatives,
                                lookup, scores)

__all__ = ["ModCheckError", "ModError", "ScoreMod", "alibi", "captured_gradients", "check", "check_score_mod",
           "conventions", "derivatives", "lookup", "relative_bias", "scores", "softcap", "temperature"]
