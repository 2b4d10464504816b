"""Shared Hypothesis strategies and the known-hard cases pinned with @example."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import example
from hypothesis import strategies as st


@dataclass(frozen=True)
class Case:
    """One attention problem: sizes, tiles, mask and how the inputs are drawn."""

    n_q: int
    n_k: int
    d: int
    block_q: int
    block_k: int
    causal: bool
    batch: int = 1
    heads_kv: int = 1
    group: int = 1
    logit: float = 1.0  # typical |S_ij|: 1e4 exercises the max shift
    seed: int = 0
    amplitude: float = 1.0  # q, k, v (and dO) all scaled by it: 5 makes |S_ij| ~ 25 logit and |V| ~ 5

    @property
    def heads(self) -> int:
        return self.heads_kv * self.group

    def inputs(self, dtype=np.float64):
        """(q, k, v) of shape (B, H, N, d); q is scaled so that |S_ij| is about `logit`."""
        rng = np.random.default_rng(self.seed)
        q = rng.standard_normal((self.batch, self.heads, self.n_q, self.d))
        k = rng.standard_normal((self.batch, self.heads_kv, self.n_k, self.d))
        v = rng.standard_normal((self.batch, self.heads_kv, self.n_k, self.d))
        q *= self.logit  # scale 1/sqrt(d) and the sqrt(d)-sized dot product cancel
        if self.amplitude != 1.0:
            q, k, v = (x * self.amplitude for x in (q, k, v))
        return q.astype(dtype), k.astype(dtype), v.astype(dtype)

    def grad_output(self, dtype=np.float64):
        """dO of shape (B, H, N_q, d), the upstream gradient, from its own stream of the case's seed."""
        rng = np.random.default_rng((self.seed, 1))
        dout = rng.standard_normal((self.batch, self.heads, self.n_q, self.d)) * self.amplitude
        return dout.astype(dtype)


# The cases DESIGN.md asks every property to pin: N = 1, N < B_c, N = k B_c + 1, odd d,
# N_q > N_k causal (fully masked rows), logits around 1e4.
HARD_CASES = (
    Case(n_q=1, n_k=1, d=1, block_q=1, block_k=1, causal=True),
    Case(n_q=1, n_k=5, d=4, block_q=4, block_k=8, causal=True),
    Case(n_q=3, n_k=5, d=3, block_q=4, block_k=8, causal=False),
    Case(n_q=9, n_k=9, d=4, block_q=4, block_k=4, causal=True),
    Case(n_q=17, n_k=17, d=5, block_q=8, block_k=8, causal=False, heads_kv=2, group=2),
    Case(n_q=12, n_k=5, d=3, block_q=4, block_k=2, causal=True, seed=1),
    Case(n_q=10, n_k=3, d=2, block_q=3, block_k=3, causal=True, batch=2, seed=2),
    Case(n_q=8, n_k=8, d=4, block_q=4, block_k=4, causal=True, logit=1e4, seed=3),
    Case(n_q=6, n_k=11, d=7, block_q=4, block_k=3, causal=False, logit=1e4, seed=4),
)


# The backward adds: inputs scaled x5 (q, k, v and dO), and GQA with N_q > N_k causal (dead rows whose
# K/V head is shared by several query heads).
BACKWARD_HARD_CASES = HARD_CASES + (
    Case(n_q=7, n_k=9, d=5, block_q=4, block_k=4, causal=True, amplitude=5.0, seed=5),
    Case(n_q=10, n_k=10, d=3, block_q=3, block_k=4, causal=False, heads_kv=2, group=2, amplitude=5.0, seed=6),
    Case(n_q=11, n_k=4, d=3, block_q=4, block_k=3, causal=True, heads_kv=2, group=3, seed=7),
)


def _pin_each(hard: tuple[Case, ...], test, fixed):
    for case in hard:
        test = example(case=case, **fixed)(test)
    return test


def with_hard_cases(test=None, **fixed):
    """Decorate a @given(case=...) test with one @example per hard case (other arguments from `fixed`)."""
    if test is None:
        return lambda t: with_hard_cases(t, **fixed)
    return _pin_each(HARD_CASES, test, fixed)


def with_backward_hard_cases(test=None, **fixed):
    """`with_hard_cases` for the backward: one @example per case of BACKWARD_HARD_CASES."""
    if test is None:
        return lambda t: with_backward_hard_cases(t, **fixed)
    return _pin_each(BACKWARD_HARD_CASES, test, fixed)


@st.composite
def cases(draw, max_n: int = 20, max_d: int = 8, max_block: int = 9, multihead: bool = True,
          amplitudes: tuple[float, ...] = (1.0,), logits: tuple[float, ...] = (1.0, 1.0, 30.0, 1e4)) -> Case:
    return Case(
        n_q=draw(st.integers(1, max_n)),
        n_k=draw(st.integers(1, max_n)),
        d=draw(st.integers(1, max_d)),
        block_q=draw(st.integers(1, max_block)),
        block_k=draw(st.integers(1, max_block)),
        causal=draw(st.booleans()),
        batch=draw(st.integers(1, 2)) if multihead else 1,
        heads_kv=draw(st.integers(1, 2)) if multihead else 1,
        group=draw(st.integers(1, 3)) if multihead else 1,
        logit=draw(st.sampled_from(logits)),
        seed=draw(st.integers(0, 2**32 - 1)),
        amplitude=draw(st.sampled_from(amplitudes)) if len(amplitudes) > 1 else amplitudes[0],
    )


SIM_MAX_BLOCKS = 16  # simulator budget per launch (DESIGN.md): <= 16 blocks of <= 64 threads


def launch_blocks(case: Case) -> int:
    """Blocks of the larger of the two launches: v2 runs T_r x B H blocks, v1 runs B H."""
    t_r = -(-case.n_q // case.block_q)
    return t_r * case.batch * case.heads


@st.composite
def kernel_cases(draw) -> Case:
    """Cases small enough for the simulator: <= 16 blocks of <= 8 threads."""
    case = draw(cases(max_n=12, max_d=6, max_block=8))
    return case if launch_blocks(case) <= SIM_MAX_BLOCKS else Case(
        case.n_q, case.n_k, case.d, max(case.block_q, -(-case.n_q // 4)), case.block_k, case.causal,
        batch=1, heads_kv=case.heads_kv, group=min(case.group, 2), logit=case.logit, seed=case.seed)


# --- masks (fa_numba.masks) -------------------------------------------------------------------------

from fa_numba import masks  # noqa: E402

MASK_KINDS = ("causal", "window", "prefix", "documents", "documents-causal", "function", "dense")


@dataclass(frozen=True)
class Stripes:
    """A from_function predicate with structure: ((a i + b j + c) mod m) < t (t = 0: nothing visible,
    t = m: everything). Hashable and readable in Hypothesis' reports."""

    a: int
    b: int
    c: int
    m: int
    t: int

    def __call__(self, i, j):
        return (self.a * i + self.b * j + self.c) % self.m < self.t


@dataclass(frozen=True)
class GlobalAndLocal:
    """A from_function predicate like Longformer's: |i - j| <= width, or i or j among the first `tokens`."""

    width: int
    tokens: int

    def __call__(self, i, j):
        return (np.abs(i - j) <= self.width) | (i < self.tokens) | (j < self.tokens)


@dataclass(frozen=True)
class MaskCase:
    """An attention problem (`case`: sizes, tiles, inputs; case.causal is False) and the mask it runs with."""

    case: Case
    mask: object

    @property
    def n_q(self) -> int:
        return self.case.n_q

    @property
    def n_k(self) -> int:
        return self.case.n_k

    @property
    def tiles(self) -> tuple[int, int, int, int]:
        """(n_q, n_k, block_q, block_k)."""
        return self.case.n_q, self.case.n_k, self.case.block_q, self.case.block_k


def random_dense(n_q: int, n_k: int, density: float, seed: int, empty_rows=()) -> np.ndarray:
    visible = np.random.default_rng(seed).random((n_q, n_k)) < density
    visible[list(empty_rows)] = False
    return visible


@st.composite
def mask_cases(draw, max_n: int = 20, max_d: int = 8, max_block: int = 9, multihead: bool = True,
               kinds=MASK_KINDS, amplitudes: tuple[float, ...] = (1.0,),
               logits: tuple[float, ...] = (1.0, 1.0, 30.0, 1e4)) -> MaskCase:
    """A random mask of a random kind, with sizes it allows (documents: N_q = N_k = sum of the lengths)."""
    case = draw(cases(max_n=max_n, max_d=max_d, max_block=max_block, multihead=multihead, amplitudes=amplitudes,
                      logits=logits))
    kind = draw(st.sampled_from(kinds))
    n_q, n_k = case.n_q, case.n_k
    if kind.startswith("documents"):
        n_k = n_q
        cuts = sorted(draw(st.sets(st.integers(1, n_q - 1)))) if n_q > 1 else []
        bounds = [0, *cuts, n_q]
        mask = masks.documents(np.diff(bounds).tolist(), causal=kind == "documents-causal")
    elif kind == "window":
        side = st.one_of(st.none(), st.integers(0, 3), st.integers(0, max_n + 2))
        mask = masks.sliding_window(draw(side), draw(side))
    elif kind == "prefix":
        mask = masks.prefix_lm(draw(st.one_of(st.integers(0, 3), st.integers(0, max_n + 2))))
    elif kind == "causal":
        mask = masks.causal()
    elif kind == "function":
        fn = draw(st.one_of(
            st.builds(Stripes, st.integers(0, 3), st.integers(0, 3), st.integers(0, 5), st.integers(1, 5),
                      st.integers(0, 5)).map(lambda p: Stripes(p.a, p.b, p.c, p.m, min(p.t, p.m))),
            st.builds(GlobalAndLocal, st.integers(0, 4), st.integers(0, 3))))
        mask = masks.from_function(fn)
    else:
        density = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
        empty = draw(st.sets(st.integers(0, n_q - 1), max_size=n_q))
        mask = masks.from_dense(random_dense(n_q, n_k, density, draw(st.integers(0, 2**32 - 1)), empty))
    return MaskCase(Case(n_q, n_k, case.d, case.block_q, case.block_k, False, batch=case.batch,
                         heads_kv=case.heads_kv, group=case.group, logit=case.logit, seed=case.seed,
                         amplitude=case.amplitude), mask)


def _mask_case(n_q, n_k, block_q, block_k, mask, d=3, seed=0):
    return MaskCase(Case(n_q, n_k, d, block_q, block_k, False, seed=seed), mask)


# The hard cases of masks: documents of length 1, empty windows (the diagonal alone), windows wider than N,
# rows with no visible key, N_q != N_k, a prefix beyond N_k, masks with nothing or everything visible.
HARD_MASK_CASES = (
    _mask_case(5, 5, 2, 2, masks.documents([1, 1, 1, 1, 1])),
    _mask_case(1, 1, 1, 1, masks.documents([1], causal=True)),
    _mask_case(14, 14, 4, 3, masks.documents([3, 1, 4, 1, 5], causal=True), seed=1),
    _mask_case(14, 14, 3, 5, masks.documents([6, 1, 7])),
    _mask_case(8, 8, 3, 3, masks.sliding_window(0, 0)),
    _mask_case(9, 4, 2, 3, masks.sliding_window(0, 0), seed=2),
    _mask_case(4, 11, 3, 2, masks.sliding_window(2, 1)),
    _mask_case(7, 5, 2, 4, masks.sliding_window(50, 50)),
    _mask_case(6, 6, 4, 4, masks.sliding_window(None, None)),
    _mask_case(5, 9, 2, 2, masks.sliding_window(0, None)),
    _mask_case(12, 5, 4, 2, masks.sliding_window(3, 0), seed=3),
    _mask_case(6, 5, 2, 2, masks.prefix_lm(30)),
    _mask_case(9, 4, 3, 3, masks.prefix_lm(2)),
    _mask_case(12, 5, 4, 2, masks.causal()),
    _mask_case(1, 1, 1, 1, masks.causal()),
    _mask_case(3, 4, 2, 3, masks.from_dense(np.zeros((3, 4), dtype=bool))),
    _mask_case(6, 7, 4, 3, masks.from_dense(random_dense(6, 7, 0.5, 7, empty_rows=(0, 3, 4))), seed=4),
    _mask_case(5, 6, 2, 3, masks.from_function(Stripes(1, 1, 0, 3, 0))),
    _mask_case(10, 10, 4, 4, masks.from_function(GlobalAndLocal(1, 2))),
)


def with_hard_mask_cases(test=None, **fixed):
    """Decorate a @given(mc=...) test with one @example per hard mask case (other arguments from `fixed`)."""
    if test is None:
        return lambda t: with_hard_mask_cases(t, **fixed)
    for mc in HARD_MASK_CASES:
        test = example(mc=mc, **fixed)(test)
    return test


@st.composite
def mask_kernel_cases(draw) -> MaskCase:
    """Mask cases small enough for the simulator: N <= 16, d <= 6, tiles <= 8, <= 16 blocks a forward launch
    (the backward's square tiles are B = block_q)."""
    mc = draw(mask_cases(max_n=16, max_d=6, max_block=8))
    c = mc.case
    if launch_blocks(c) <= SIM_MAX_BLOCKS:
        return mc
    return MaskCase(Case(c.n_q, c.n_k, c.d, max(c.block_q, -(-c.n_q // 4)), c.block_k, False, batch=1,
                         heads_kv=c.heads_kv, group=min(c.group, 2), logit=c.logit, seed=c.seed), mc.mask)
