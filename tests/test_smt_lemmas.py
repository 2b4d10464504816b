"""The integer lemmas proved for every size by z3, not only sampled (issue 28).

Each proof runs the project's own code on symbolic integers (tests/smt_symbolic.py: the function itself,
branch by branch, or the very source line the kernels and iomodel compute with), over unbounded integers,
and each one also shows that z3 refutes a plausible wrong variant (an off-by-one of the rule it proves), so
an encoding that proves everything would fail here.

What is proved, for all N_q, N_k >= 1 and every tile (any 0 <= r0 < r1 <= N_q, 0 <= c0 < c1 <= N_k):
- L3.1: `tiling.causal_kind` is sound and complete for bottom-right causal masking;
- L8.2: `SlidingWindow.classify_tile` (any left, right >= 0, or None), `PrefixLM.classify_tile` (any
  prefix >= 0) and `Documents.classify_tile` (1 to 4 documents of any lengths, causal or not) are sound
  and complete for their predicates;
- L3.2 / L5: the kernels' and iomodel's loop bounds: the query tiles that visit key tile j are exactly
  i >= I_j (the v1 and backward-kv start, iomodel's I_j), the key tiles query tile i visits exactly
  j < J_i + 1 (the v2 and backward-q stop), for tile sizes 1 to 256 and any N.
- L9.1: the launch check (`check_sequence` and each kernel's `check_grid` over its `launch_shape`) accepts
  exactly the launches whose grid CUDA allows, in closed form N <= 2^31 - 1 and batch * heads <= 65535
  (2^31 - 1 for v1's one-axis grid), for every shipped kernel and tile and any batch, heads, N >= 1.
Still only sampled (Hypothesis): documents with more than 4 documents, the row intervals (NumPy code over
arrays), from_function / from_dense (evaluated by definition), the traffic sums beyond the visit sets above.
The kernels' 64-bit arithmetic (L9.2) is read from their typed IR in test_index_width.py, not here.
"""

import pathlib
import re

import pytest

z3 = pytest.importorskip("z3", reason="the SMT proofs need z3-solver (the smt extra)")

from fa_numba import masks, tiling  # noqa: E402
from fa_numba.tiling import FULL, PARTIAL, SKIP  # noqa: E402
from smt_symbolic import Sym, counterexample, explore  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
n_q, n_k, r0, r1, c0, c1, i, j = z3.Ints("n_q n_k r0 r1 c0 c1 i j")
TILE = [n_q >= 1, n_k >= 1, 0 <= r0, r0 < r1, r1 <= n_q, 0 <= c0, c0 < c1, c1 <= n_k]
IN_TILE = z3.And(r0 <= i, i < r1, c0 <= j, j < c1)
TILE_VARS = dict(r0=r0, r1=r1, c0=c0, c1=c1, n_q=n_q, n_k=n_k)


def causal_visible(a, b):
    """The element mask of L3 (bottom-right alignment, DESIGN.md), written from the definition."""
    return b <= a + (n_k - n_q)


def _kind_claims(kind, visible):
    """What a kind asserts of its tile's pairs (L3.1 / L8.2): SKIP none visible, FULL all, PARTIAL both."""
    if kind == SKIP:
        return z3.ForAll([i, j], z3.Implies(IN_TILE, z3.Not(visible(i, j))))
    if kind == FULL:
        return z3.ForAll([i, j], z3.Implies(IN_TILE, visible(i, j)))
    assert kind == PARTIAL, kind
    return z3.And(z3.Exists([i, j], z3.And(IN_TILE, visible(i, j))),
                  z3.Exists([i, j], z3.And(IN_TILE, z3.Not(visible(i, j)))))


def refuted_classifier(classify, visible, assumptions=(), variables=None):
    """None if every path of `classify` returns the kind its tile has (sound and complete), else a z3
    model of a tile it gets wrong. The paths cover the domain (explore runs every feasible one), and the
    three claims exclude each other on a non-empty tile, so sound on every path is also complete."""
    assumptions = TILE + list(assumptions)
    cases = explore(classify, variables or TILE_VARS, assumptions)
    assert counterexample(assumptions, z3.Or(*(c.condition for c in cases))) is None  # the paths cover all
    for case in cases:
        model = counterexample(assumptions + [case.condition], _kind_claims(case.value, visible))
        if model is not None:
            return model
    return None


def _with_fields(cls, **fields):
    """A mask of class cls with symbolic fields (its constructor checks ints), its size check replaced by
    the assumptions TILE states (classify_tile's _check_tile: sizes >= 1 and the tile in the grid)."""
    mask = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(mask, name, value)
    object.__setattr__(mask, "_check_tile", lambda *args: None)
    return mask


# -- L3.1: the causal rule --------------------------------------------------------------------------------

@pytest.mark.lemma("L3")
def test_causal_kind_is_sound_and_complete_for_every_size():
    def classify(path, r0, r1, c0, c1, n_q, n_k):
        return tiling.causal_kind(r0, r1, c0, c1, n_k - n_q)

    assert refuted_classifier(classify, causal_visible) is None

    def skip_off_by_one(path, r0, r1, c0, c1, n_q, n_k):  # SKIP from c0 = r1 - 1 + delta: one visible pair lost
        delta = n_k - n_q
        return SKIP if c0 >= r1 - 1 + delta else tiling.causal_kind(r0, r1, c0, c1, delta)

    def full_too_strict(path, r0, r1, c0, c1, n_q, n_k):  # FULL only below the diagonal: FULL tiles go PARTIAL
        delta = n_k - n_q
        if c0 > r1 - 1 + delta:
            return SKIP
        return FULL if c1 <= r0 + delta else PARTIAL

    assert refuted_classifier(skip_off_by_one, causal_visible) is not None
    assert refuted_classifier(full_too_strict, causal_visible) is not None


# -- L8.2: sliding windows and prefix-LM ------------------------------------------------------------------

left, right, prefix = z3.Ints("left right prefix")


def window_visible(has_left, has_right):
    def visible(a, b):  # masks' table: i + delta - left <= j <= i + delta + right, None unbounded
        diagonal = a + (n_k - n_q)
        return z3.And(b >= diagonal - left if has_left else True, b <= diagonal + right if has_right else True)

    return visible


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("has_left, has_right", [(True, True), (True, False), (False, True), (False, False)])
def test_window_classify_tile_is_sound_and_complete_for_every_size(has_left, has_right):
    variables = dict(TILE_VARS, left=left, right=right)

    def classify(path, r0, r1, c0, c1, n_q, n_k, left, right, shift=0):
        mask = _with_fields(masks.SlidingWindow, left=left + shift if has_left else None,
                            right=right if has_right else None)
        return mask.classify_tile(r0, r1, c0, c1, n_q, n_k)

    sides = [left >= 0, right >= 0]
    assert refuted_classifier(classify, window_visible(has_left, has_right), sides, variables) is None
    if has_left:  # a window one key wider on the left than the predicate says
        wrong = lambda **kw: classify(shift=1, **kw)  # noqa: E731
        assert refuted_classifier(wrong, window_visible(has_left, has_right), sides, variables) is not None


@pytest.mark.lemma("L8")
def test_prefix_lm_classify_tile_is_sound_and_complete_for_every_size():
    def visible(a, b):  # masks' table: j < prefix or j <= i + delta
        return z3.Or(b < prefix, b <= a + (n_k - n_q))

    def classify(path, r0, r1, c0, c1, n_q, n_k, prefix, shift=0):
        return _with_fields(masks.PrefixLM, prefix=prefix + shift).classify_tile(r0, r1, c0, c1, n_q, n_k)

    variables = dict(TILE_VARS, prefix=prefix)
    assert refuted_classifier(classify, visible, [prefix >= 0], variables) is None
    wrong = lambda **kw: classify(shift=1, **kw)  # noqa: E731 (a prefix one key longer)
    assert refuted_classifier(wrong, visible, [prefix >= 0], variables) is not None


class _Starts:
    """documents' starts s_0 = 0 < s_1 < ... < s_D as symbolic terms, indexable by a symbolic document."""

    def __init__(self, terms, path):
        self.terms, self.path = terms, path

    def __getitem__(self, t):
        t = t.term if isinstance(t, Sym) else t
        value = self.terms[-1]
        for index in reversed(range(len(self.terms) - 1)):
            value = z3.If(t == index, self.terms[index], value)
        return Sym(value, self.path)

    def doc(self, x):
        """The t with s_t <= x < s_(t+1) (what np.searchsorted(starts, x, side="right") - 1 gives)."""
        x = x.term if isinstance(x, Sym) else x
        value = len(self.terms) - 2
        for index in reversed(range(len(self.terms) - 2)):
            value = z3.If(x < self.terms[index + 1], index, value)
        return Sym(value, self.path)


@pytest.mark.lemma("L8")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_documents_classify_tile_is_sound_and_complete_for_any_lengths(count, causal):
    """`Documents.classify_tile` run symbolically with `count` documents of any lengths >= 1 (their starts
    and doc() modelled as z3 terms: the np.searchsorted it calls is the one primitive replaced)."""
    lengths = z3.Ints(" ".join(f"length{t}" for t in range(count)))
    terms = [z3.IntVal(0)]
    for length in lengths:
        terms.append(terms[-1] + length)
    sizes = [length >= 1 for length in lengths] + [n_q == terms[-1], n_k == terms[-1]]

    def doc_term(x):
        value = count - 1
        for index in reversed(range(count - 1)):
            value = z3.If(x < terms[index + 1], index, value)
        return value

    def visible(a, b):  # masks' table: doc(i) = doc(j), and j <= i with causal
        same = doc_term(a) == doc_term(b)
        return z3.And(same, b <= a) if causal else same

    def classify(path, r0, r1, c0, c1, n_q, n_k, early=False):
        starts = _Starts(terms, path)
        mask = _with_fields(masks.Documents, lengths=tuple(range(count)), causal=causal, starts=starts,
                            doc=starts.doc)
        if early:  # a plausible slip: the tile's last row taken as r1 (one past it)
            r1 = r1 + 1
        return mask.classify_tile(r0, r1, c0, c1, n_q, n_k)

    assert refuted_classifier(classify, visible, sizes) is None
    if count > 1:
        wrong = lambda **kw: classify(early=True, **kw)  # noqa: E731
        assert refuted_classifier(wrong, visible, sizes) is not None


# -- L3.2 and L5: the loop bounds the kernels and iomodel compute -----------------------------------------

def _source_lines(path: str, pattern: str) -> list[str]:
    """The right-hand sides of the lines of `path` assigning by `pattern` (the very code, found by text)."""
    text = (ROOT / path).read_text()
    found = re.findall(rf"^\s*{pattern}\s*=\s*(.+?)(?:\s+#.*)?$", text, flags=re.M)
    assert found, f"{path} has no line assigning {pattern}: the proof must follow the code (update it)"
    return found


class _ClipShim:
    """np.clip on one symbolic scalar, as iomodel applies it elementwise."""

    @staticmethod
    def clip(x, lo, hi):
        return min(max(x, lo), hi)


BLOCKS = (1, 2, 3, 8, 16, 32, 64, 128, 256)  # every shipped tile size and small odd ones; N unbounded
T_I = z3.Int("t")  # a tile index


@pytest.mark.lemma("L5")
@pytest.mark.parametrize("block_q", BLOCKS)
def test_the_first_query_tile_of_a_key_tile_is_the_code_s_i_j(block_q):
    """For key columns from c0 (any 0 <= c0 < N_k), query tile t (rows [t B_r, min((t + 1) B_r, N_q)))
    is not SKIP by `tiling.causal_kind` (run as code) iff t >= I_j, where I_j is each of the code's
    lines: the v1 engine's, v1-rowwise's and backward kv's start, and iomodel's first_tile. So key tile j
    is visited by T_r - I_j query tiles, R_j = N_q - I_j B_r rows (L5)."""
    lines = (_source_lines("fa_numba/kernels/engine_v1.py", "start")
             + _source_lines("fa_numba/kernels/rowwise_v1.py", "start")
             + _source_lines("fa_numba/kernels/backward.py", "start")
             + _source_lines("fa_numba/iomodel.py", "first_tile"))
    lines = [line for line in lines if "delta" in line]  # the causal ones (the others are list bounds)
    assert len(lines) == 4, lines
    wrong = "min(max(-((-(c0 - delta)) // B) - 1, 0), t_r - 1)"  # ceil((c0 - delta) / B_r) - 1: off by one key
    base = [n_q >= 1, n_k >= 1, 0 <= c0, c0 < n_k, 0 <= T_I, T_I < (n_q + block_q - 1) / block_q]
    for line in lines + [wrong]:
        def first(path, c0, n_q, n_k, t, line=line):
            delta, t_r = n_k - n_q, (n_q + block_q - 1) // block_q
            grid = type("Grid", (), dict(delta=delta, block_q=block_q, t_r=t_r))
            names = dict(c0=c0, delta=delta, B=block_q, BR=block_q, t_r=t_r, grid=grid, np=_ClipShim)
            start = eval(line, {"min": min, "max": max}, names)
            kind = tiling.causal_kind(t * block_q, min((t + 1) * block_q, n_q), c0, c0 + 1, delta)
            return kind != SKIP, start

        cases = explore(first, dict(c0=c0, n_q=n_q, n_k=n_k, t=T_I), base)
        proved = all(counterexample(base + [case.condition], z3.BoolVal(visits) == (T_I >= start)) is None
                     for case in cases for visits, start in [case.value])
        assert proved == (line != wrong), line


@pytest.mark.lemma("L3")
@pytest.mark.parametrize("block_k", BLOCKS)
def test_the_key_tiles_of_a_query_tile_end_at_the_code_s_stop(block_k):
    """Query rows [r0, r1) visit key tile t (`tiling.causal_kind` not SKIP, run as code) iff t < stop, stop
    each of the code's lines: the v2 engine's, v2-rowwise's and backward q's (L3.2: the non-SKIP tiles are
    0 .. J_i, J_i = min(T_c - 1, floor((r1 - 1 + delta) / B_c)), none if r1 - 1 + delta < 0)."""
    lines = (_source_lines("fa_numba/kernels/engine_v2.py", "stop")
             + _source_lines("fa_numba/kernels/rowwise_v2.py", "stop")
             + _source_lines("fa_numba/kernels/backward.py", "stop"))
    lines = [line for line in lines if "last_key" in line]
    assert len(lines) == 3, lines
    wrong = "min(stop, last_key // B + 1) if last_key > 0 else 0"  # drops key tile 0 when r1 - 1 + delta = 0
    base = [n_q >= 1, n_k >= 1, 0 <= r0, r0 < r1, r1 <= n_q, 0 <= T_I, T_I < (n_k + block_k - 1) / block_k]
    for line in lines + [wrong]:
        def stop(path, r0, r1, n_q, n_k, t, line=line):
            delta = n_k - n_q
            names = dict(stop=(n_k + block_k - 1) // block_k, last_key=r1 - 1 + delta, B=block_k, BC=block_k,
                         r0=r0, rows=r1 - r0, r1=r1, delta=delta)
            end = eval(line, {"min": min, "max": max}, names)
            kind = tiling.causal_kind(r0, r1, t * block_k, min((t + 1) * block_k, n_k), delta)
            return kind != SKIP, end

        cases = explore(stop, dict(r0=r0, r1=r1, n_q=n_q, n_k=n_k, t=T_I), base)
        proved = all(counterexample(base + [case.condition], z3.BoolVal(visits) == (T_I < end)) is None
                     for case in cases for visits, end in [case.value])
        assert proved == (line != wrong), line


# -- L9: the launch check's bound ---------------------------------------------------------------------------

def _shipped_launches():
    """(name, kernel) of every registered kernel at the tiles of every shipped head dim, the backward's
    preprocess and zero kernels included: each has its own launch_shape and check_grid."""
    from fa_numba import profile
    from fa_numba.kernels import backward

    found = {}
    for cfg in profile.configurations(dtypes=("float32",), causals=(False,)):
        found[f"{cfg['variant']} d={cfg['head_dim']}"] = profile._build(cfg)
    for d in profile.SHIPPED_HEAD_DIMS:
        block = backward.default_backward_tiles(d)[0]
        for kind in ("preprocess", "zero"):
            found[f"{kind} d={d}"] = backward.make(kind, block, d, False)
    return found


LAUNCHES = _shipped_launches()
CUDA_GRID = (2**31 - 1, 65535, 65535)  # the CUDA C++ Programming Guide's grid limits, written here apart
MAX_SEQUENCE = 2**31 - 1  # the positions a block mask holds in int32
batch, heads, n = z3.Ints("batch heads n")
SIZES = [batch >= 1, heads >= 1, n >= 1]


def _launch_cases(kernel):
    """The paths of check_sequence + kernel.check_grid run as code on symbolic (batch, heads, n): each
    returns (accepted, the grid launch_shape gives on that path)."""
    from fa_numba.kernels.common import check_sequence

    def launch(path, batch, heads, n):
        grid = kernel.launch_shape(batch, heads, n)[0]
        try:
            check_sequence(n, n)
            kernel.check_grid(batch, heads, n)
        except ValueError:
            return False, grid
        return True, grid

    return explore(launch, dict(batch=batch, heads=heads, n=n), SIZES)


@pytest.mark.lemma("L9")
@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_the_launch_check_accepts_exactly_the_grids_cuda_allows(name):
    """For every batch, heads >= 1 and N >= 1 (unbounded): the code's check accepts a launch iff every
    axis of its grid is within CUDA's limits and N <= 2^31 - 1; and that is, in closed form, N <= 2^31 - 1
    and batch * heads <= 65535 for the kernels with a (tiles, batch * heads) grid, batch * heads <= 2^31 - 1
    for v1's (batch * heads,) grid: the query- or key-tile axis, ceil(N / B) <= 2^31 - 1, never refuses.
    The same claim with the y limit off by one (65536) is refuted."""
    kernel = LAUNCHES[name]
    cases = _launch_cases(kernel)
    assert counterexample(SIZES, z3.Or(*(c.condition for c in cases))) is None  # the paths cover every size
    products = batch * heads
    one_axis = len(cases[0].value[1]) == 1  # v1: the grid is (batch * heads,)
    limit = CUDA_GRID[0] if one_axis else CUDA_GRID[1]
    for case in cases:
        accepted, grid = case.value
        fits = z3.And(n <= MAX_SEQUENCE, *(axis <= bound for axis, bound in zip(grid, CUDA_GRID)))
        assert counterexample(SIZES + [case.condition], z3.BoolVal(accepted) == fits) is None, name
        closed = z3.And(n <= MAX_SEQUENCE, products <= limit)
        assert counterexample(SIZES + [case.condition], z3.BoolVal(accepted) == closed) is None, name
    wrong = z3.And(n <= MAX_SEQUENCE, products <= limit + 1)
    assert any(counterexample(SIZES + [c.condition], z3.BoolVal(c.value[0]) == wrong) is not None for c in cases)
