"""The tile engine: its layouts (threads, micro-tiles, shared-memory regions, aliasing) and its kernels on the
edges of the micro-tiles, against the float64 reference, the tiled spec and the IO model.

The registry's kernels are checked by tests/test_kernels.py; here the engine is driven with layouts that
test_kernels' small tiles rarely reach: several threads per row group, d not a multiple of the column groups,
ragged tails in both directions, and P^T and the row partials aliased into the dead operand (with the
budget lowered, since at simulator sizes everything fits in 48 KB).
"""

import numpy as np
import pytest

from fa_numba import backend, iomodel, tiled, tolerance
from fa_numba.kernels import VARIANTS, default_tiles, poisoned_outputs
from fa_numba.kernels.common import SHARED_BYTES_LIMIT, Config
from fa_numba.kernels.layout import DEFAULTS, Layout, default_config, in_flight, micro_for
from fa_numba.kernels.engine_v1 import FlashV1Engine
from fa_numba.kernels.engine_v1 import kernel_source as v1_source
from fa_numba.kernels.engine_v2 import FlashV2Engine
from fa_numba.kernels.engine_v2 import kernel_source as v2_source
from strategies import Case

KERNEL = {"v1": (FlashV1Engine, v1_source), "v2": (FlashV2Engine, v2_source)}
SIMULATOR = backend.name() == "simulator"


def test_layout_threads_and_micro_tiles():
    layout = Layout("v2", 64, 32, 64, 4, 2)
    assert (layout.ry, layout.cx, layout.threads, layout.d_pad, layout.td) == (16, 16, 256, 64, 4)
    odd = Layout("v1", 10, 6, 5, 2, 2)  # 5 x 3 threads, d = 5 padded to 6 so that each of 3 owns 2 columns
    assert (odd.threads, odd.d_pad, odd.td) == (15, 6, 2)
    assert micro_for(64, 32, 64) == (4, 2) and micro_for(64, 16, 128) == (4, 1)  # the shipped table (v1)
    assert micro_for(64, 32, 64, "v2") == (4, 4) and micro_for(64, 16, 128, "v2") == (4, 2)  # v2: layout.V2_MICRO
    assert micro_for(64, 64, 32, "v2") == (4, 4) and micro_for(16, 16, 256, "v2") == (2, 1)  # as v1 elsewhere
    assert micro_for(32, 32, 64, "v2") == (4, 4)  # not the default tiles: largest of 4, 2, 1, either order
    assert micro_for(10, 6, 5) == (2, 2) and micro_for(3, 8, 4) == (1, 4)  # other tiles: largest of 4, 2, 1
    two_chunks = Layout("v2", 8, 8, 16, 4, 4)  # CX = 2 threads of TD = 8 columns: chunks of VW = 4
    assert (two_chunks.cx, two_chunks.td, two_chunks.vw) == (2, 8, 4)
    assert [two_chunks.column(0, e) for e in range(8)] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert [two_chunks.column(1, e) for e in range(8)] == [4, 5, 6, 7, 12, 13, 14, 15]
    assert [odd.column(tx, 1) for tx in range(3)] == [1, 3, 5] and odd.vw == 2
    with pytest.raises(ValueError, match="threads per block, over 1024"):
        Layout("v2", 128, 128, 16, 1, 1).check()
    with pytest.raises(ValueError, match="must be a multiple of tm"):
        Layout("v2", 6, 8, 16, 4, 4).check()


def test_shipped_layouts_fit_and_alias_only_where_needed():
    for bound, (block_q, block_k, tm, tn) in DEFAULTS:
        assert default_tiles(bound) == (block_q, block_k) and default_config(bound) == (block_q, block_k, tm, tn)
        for order in ("v1", "v2"):
            layout = Layout(order, block_q, block_k, bound, tm, tn).check()
            assert layout.shared_bytes <= SHARED_BYTES_LIMIT
            sizes = layout._sizes()
            assert layout.aliased == (sum(sizes.values()) * 4 > SHARED_BYTES_LIMIT)
            _assert_regions_disjoint(layout)


def _assert_regions_disjoint(layout: Layout):
    """Q^T, K^T and V never overlap; P^T, red (and stat) never overlap each other, and lie inside the dead
    operand (K^T for v2, Q^T for v1) or outside every operand."""
    off, sizes = layout.offsets, layout._sizes()
    spans = {name: (off[name], off[name] + size) for name, size in sizes.items()}

    def overlap(a, b):
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    operands = ("q", "k", "v")
    extras = [n for n in sizes if n not in operands]
    dead = "k" if layout.order == "v2" else "q"
    for i, a in enumerate(operands):
        for b in operands[i + 1:]:
            assert not overlap(a, b), (a, b)
    for i, a in enumerate(extras):
        for b in extras[i + 1:]:
            assert not overlap(a, b), (a, b)
        for b in operands:
            assert not overlap(a, b) or (b == dead and layout.aliased), (a, b)
    assert max(end for _, end in spans.values()) <= layout.offsets["_total"]


def _aliasing_budget(order, block_q, block_k, d):
    """The bytes of the aliased layout: a budget under which the dedicated layout does not fit, it does."""
    tm, tn = micro_for(block_q, block_k, d)
    aliased = Layout(order, block_q, block_k, d, tm, tn, budget=4).offsets  # forced to alias
    return aliased["_total"] * 4


def _engine(order, block_q, block_k, d, causal, budget=SHARED_BYTES_LIMIT):
    cls, source = KERNEL[order]
    return cls(Config(order, block_q, block_k, d, causal, engine=True, smem_budget=budget).check(), source)


# Cases at the micro-tile edges: several threads per row group and column group (tiles 6, 10, 12 give
# TM, TN = 2), d not a multiple of CX (padding columns), N not a multiple of the tile (ragged tails),
# N_q > N_k causal (rows that see nothing), GQA. (name, order, case)
EDGES = [
    Case(n_q=13, n_k=11, d=5, block_q=6, block_k=6, causal=True, seed=11),
    Case(n_q=11, n_k=7, d=3, block_q=10, block_k=6, causal=True, seed=12),  # N_q > N_k: 4 empty rows
    Case(n_q=9, n_k=14, d=7, block_q=12, block_k=6, causal=False, heads_kv=1, group=2, seed=13),
    Case(n_q=7, n_k=7, d=1, block_q=6, block_k=10, causal=True, logit=30.0, seed=14),
    # TD = 8 = two chunks of VW = 4 columns per thread, interleaved with the other thread's (Layout.column)
    Case(n_q=10, n_k=9, d=16, block_q=8, block_k=8, causal=True, seed=17),
]


# With d >= the tiles, P^T and the row partials fit inside the dead operand: the aliased layout differs.
ALIASED = [
    Case(n_q=13, n_k=11, d=12, block_q=6, block_k=6, causal=True, seed=15),
    Case(n_q=12, n_k=5, d=13, block_q=10, block_k=6, causal=True, heads_kv=1, group=2, seed=16),
]


def _name(c: Case) -> str:
    return f"nq{c.n_q}-nk{c.n_k}-d{c.d}-b{c.block_q}x{c.block_k}-{'causal' if c.causal else 'full'}"


@pytest.mark.lemma("L5")
@pytest.mark.parametrize("order", ["v1", "v2"])
@pytest.mark.parametrize("case, aliased", [(c, False) for c in EDGES] + [(c, True) for c in ALIASED],
                         ids=lambda x: _name(x) if isinstance(x, Case) else ("aliased" if x else "dedicated"))
def test_engine_at_the_micro_tile_edges(order, case: Case, aliased):
    budget = _aliasing_budget(order, case.block_q, case.block_k, case.d) if aliased else SHARED_BYTES_LIMIT
    kernel = _engine(order, case.block_q, case.block_k, case.d, case.causal, budget)
    layout = kernel.config.layout
    assert layout.aliased == aliased and layout.threads > 1
    _assert_regions_disjoint(layout)
    q, k, v = case.inputs(np.float32)
    scale = 1 / np.sqrt(case.d)
    if SIMULATOR:  # count the traffic too: the engine reads and writes exactly what iomodel says
        from fa_numba.kernels.counting import run_counted

        out, lse, ledger = run_counted(kernel, q, k, v, scale)
        model = iomodel.traffic(order, case.n_q, case.n_k, case.d, case.block_q, case.block_k, case.causal,
                                batch=case.batch, heads=case.heads, heads_kv=case.heads_kv)
        assert ledger.reads == model.reads and ledger.writes == model.writes
    else:
        from numba import cuda

        d_out, d_lse, workspace = poisoned_outputs(q.shape)
        kernel(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), d_out, d_lse, scale, workspace)
        out, lse = d_out.copy_to_host(), d_lse.copy_to_host()
    check = tolerance.check_attention(out, lse, q, k, v, causal=case.causal, name=f"engine {order}", order=order,
                                      block_q=case.block_q, block_k=case.block_k)
    spec_out, spec_lse, _ = tiled.attention(q, k, v, order=order, block_q=case.block_q, block_k=case.block_k,
                                            causal=case.causal, dtype=np.float32)
    tolerance.assert_close(out, spec_out, check.atol_out, name=f"engine {order} vs tiled spec out")
    tolerance.assert_close(lse, spec_lse, check.atol_lse, name=f"engine {order} vs tiled spec lse")


# The layouts a launch actually gets (default_tiles and the shipped micro-tiles, 128 or 256 threads), run once
# each: the edge cases above use small tiles to stay fast, so without these the shipped thread layouts would
# be compiled and profiled but never executed before a GPU. N not a multiple of either tile, GQA, causal with
# N_q > N_k; one query-tile row of blocks keeps each run to seconds in the simulator.
SHIPPED = [
    Case(n_q=70, n_k=45, d=32, block_q=64, block_k=64, causal=True, heads_kv=1, group=2, seed=21),
    Case(n_q=70, n_k=45, d=64, block_q=64, block_k=32, causal=True, seed=22),
    Case(n_q=40, n_k=37, d=128, block_q=64, block_k=16, causal=False, heads_kv=1, group=2, seed=23),
    Case(n_q=20, n_k=37, d=256, block_q=16, block_k=16, causal=True, seed=24),
]


@pytest.mark.slow  # 256-thread blocks in the simulator: about 5 minutes together, so in the tier CI also runs
@pytest.mark.lemma("L4")
@pytest.mark.parametrize("order", ["v1", "v2"])
@pytest.mark.parametrize("case", SHIPPED, ids=_name)
def test_the_shipped_layouts_run_and_pass_the_rule(order, case: Case):
    assert (case.block_q, case.block_k) == default_tiles(case.d)
    kernel = VARIANTS[order].make(case.block_q, case.block_k, case.d, case.causal)
    assert (kernel.config.layout.tm, kernel.config.layout.tn) == default_config(case.d, order)[2:]
    q, k, v = case.inputs(np.float32)
    from numba import cuda

    d_out, d_lse, workspace = poisoned_outputs(q.shape)
    kernel(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), d_out, d_lse, 1 / np.sqrt(case.d), workspace)
    tolerance.check_attention(d_out.copy_to_host(), d_lse.copy_to_host(), q, k, v, causal=case.causal,
                              name=f"engine {order} shipped d={case.d}", order=order, block_q=case.block_q,
                              block_k=case.block_k)


def test_the_registry_runs_the_engine_under_the_names_users_know():
    assert VARIANTS["v1"].engine and VARIANTS["v2"].engine
    assert not VARIANTS["v1-rowwise"].engine and not VARIANTS["v2-rowwise"].engine
    assert {VARIANTS[n].order for n in ("v1", "v1-rowwise")} == {"v1"}
    assert {VARIANTS[n].order for n in ("v2", "v2-rowwise")} == {"v2"}
    assert VARIANTS["v1"].config(*default_tiles(64), 64, True).threads == 256
    assert VARIANTS["v2"].config(*default_tiles(64), 64, True).threads == 128  # layout.V2_MICRO's 4 x 4
    assert VARIANTS["v2"].config(*default_tiles(128), 128, False).threads == 128  # 4 x 2


def test_any_valid_tile_choice_builds_at_any_head_dim():
    """Tiles the caller picks (not the defaults) give layouts whose single unrolled step can exceed the unroll
    budget (16x16 at d = 128: 4x4 micro-tiles, 32 features per thread); they must still build, with one step
    per iteration, or be refused with a ValueError that says why. (16x16 at d = 128 once raised StopIteration.)"""
    built = 0
    for d in (16, 64, 128, 256):
        for block_q, block_k in ((8, 8), (16, 16), (32, 16), (32, 32), (64, 64)):
            for order in ("v1", "v2"):
                try:
                    kernel = VARIANTS[order].make(block_q, block_k, d, True)
                except ValueError as refused:
                    assert "shared memory" in str(refused) or "threads" in str(refused), str(refused)
                    continue
                assert kernel.config.layout.threads >= 1
                built += 1
    assert built >= 24


def test_rows_from_reads_down_a_column_of_a_contiguous_operand():
    """The V loader's line (kernels.tile_loads.rows_from): element k d of the line from (r, x) is src[b, h, r + k, x]
    (the GPU's version indexes row r's view past its end, which only a C-contiguous slab allows, and
    `warp.strided` is what keeps the loader off it otherwise: checked here on the simulator's functions; the
    kernels read V through it in every test that runs them)."""
    from fa_numba.kernels.tile_loads import _rows_python
    from fa_numba.warp.emulated_tc import strided as strided_view

    src = np.arange(2 * 3 * 5 * 4, dtype=np.float32).reshape(2, 3, 5, 4)
    assert not strided_view(src)
    line = _rows_python(src, 1, 2, 1, 3)
    assert [line[k * 4] for k in range(4)] == [src[1, 2, 1 + k, 3] for k in range(4)]
    strided = src.transpose(0, 2, 1, 3)  # a (B, N, H, d) tensor's view as (B, H, N, d): rows H d apart
    assert strided_view(strided)
    assert _rows_python(strided, 0, 0, 0, 0) is None


def test_loads_in_flight_by_order_block_size_and_head_dim():
    """layout.in_flight: 256-thread blocks by order (v1 32, v2 16); smaller blocks 16, but v2's up to d = 64
    32 (its shipped 128-thread layout there loads K_j and V_j in one round trip); decode layouts are v2's."""

    def shipped(order, d):
        br, bc, tm, tn = default_config(d, order)
        return Layout(order, br, bc, d, tm, tn)

    assert in_flight(Layout("v1", 64, 32, 64, 4, 2)) == 32 and in_flight(Layout("v2", 64, 32, 64, 4, 2)) == 16
    assert shipped("v2", 64).threads == shipped("v2", 128).threads == 128
    assert in_flight(shipped("v2", 64)) == 32 and in_flight(shipped("v2", 128)) == 16
    assert in_flight(shipped("v2", 256)) == 16 and in_flight(shipped("v1", 256)) == 16
