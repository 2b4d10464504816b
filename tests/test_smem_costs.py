"""`fa_numba.kernels.smem_costs`: the shared-memory wavefronts one tile-loop iteration costs one block.

Default tier: one small engine configuration whose per-iteration wavefronts are worked out by hand from its
layout (the bank rule: 32 banks of 4 bytes; 64-bit accesses per half warp, 128-bit per quarter warp, paired
128-bit loads per half warp), the
premise that 3 tiles - 2 == 2 tiles - 1, and the per-region pairing of a diverging warp on a probe. Slow tier:
every shipped kernel at its smallest and largest head dim. Simulator only: the tracer hooks the CUDA simulator."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import cuda, float32

from fa_numba import backend
from fa_numba.kernels import smem_costs, smem_trace

pytestmark = pytest.mark.skipif(backend.name() != "simulator", reason="the tracer hooks the CUDA simulator")

WARP = 32
# v2 with 16 x 32 tiles at d = 16: micro-tiles 4 x 4 (layout.micro_for), so RY = 4 row groups of CX = 8
# threads: T = 32 threads, exactly one warp, lane = ty CX + tx. D = 16, TD = D / CX = 2.
SMALL = dict(variant="v2", block_q=16, block_k=32, head_dim=16, dtype="float32", causal=False)


@pytest.fixture(scope="module")
def small():
    """SMALL traced with 1, 2 and 3 key tiles (a few seconds together): its layout, rows[widths][tiles] and
    the per-iteration result per width, as per_iteration makes it."""
    traces = {}
    rows, divergence = smem_costs.reports(SMALL, (1, 2, 3), traces=traces)
    assert divergence is None
    results = {mode: smem_costs.result(SMALL, rows[mode], mode) for mode in smem_trace.WIDTH_MODES}
    return dict(layout=smem_costs._build(SMALL).config.layout, rows=rows, trace=traces[1], **results)


def row(result, region, kind):
    (found,) = [r for r in result["rows"] if r["region"] == region and r["kind"] == kind]
    return found["width"], found["accesses"], found["wavefronts"], found["ideal"]


def test_the_small_layout_is_one_warp(small):
    layout = small["layout"]
    assert (layout.tm, layout.tn, layout.ry, layout.cx, layout.threads, layout.d_pad, layout.td) == (
        4, 4, 4, 8, WARP, 16, 2)
    assert not layout.aliased and layout.offsets["k"] % WARP == 0 and layout.offsets["p"] % WARP == 0


@pytest.mark.parametrize("widths", smem_trace.WIDTH_MODES)
def test_k_transpose_and_v_stores_are_conflict_free_one_element_per_lane(small, widths):
    # tile_loads.tile_loader, transposed: T = 32 is a multiple of the inner extent W = B_c = 32, so lane t keeps
    # inner index t and walks the outer (feature) index: step s stores smem[K + t + 32 s], 32 consecutive
    # words, 32 banks: 1 wavefront. D B_c / T = 16 steps per tile; a lane's own addresses are 32 apart, so
    # nothing merges. V_j (d fastest, B_c D / T = 16 steps of consecutive words) likewise.
    layout, result = small["layout"], small[widths]
    steps = layout.d_pad * layout.block_k // layout.threads
    assert steps == 16
    assert row(result, "K^T", "store") == (4, steps, steps, steps)
    assert row(result, "V", "store") == (4, steps, steps, steps)


def test_the_small_layout_interleaves_its_row_groups_lane_by_lane(small):
    # layout.Layout.owner: CX = 8 is a power of two, 2 CX = 16 <= 32 and RY = 4 is even, so lanes 0-15 hold
    # row groups 0 and 1 alternately (ty = lane % 2, tx = lane // 2) and lanes 16-31 row groups 2 and 3
    layout = small["layout"]
    assert layout.pairs_rows
    assert [layout.owner(t) for t in (0, 1, 2, 3, 15, 16, 17, 31)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (1, 7), (2, 0), (3, 0), (3, 7)]


def test_k_transpose_fragment_loads_merge_to_paired_conflict_free_128_bit(small):
    # scores: lane (ty, tx) reads K^T[x B_c + tx TN + c], c < TN = 4: four adjacent, 16-byte aligned words
    # (K is a multiple of 4 floats): one LDS.128 per feature x, D = 16 of them. Lanes n and n ^ 1 share tx,
    # so the load is paired (banks' rule): two half-warp phases, each 8 distinct vectors (tx = 0..7) at
    # words 32 x + 4 tx + c: 32 distinct banks, 1 wavefront. 2 per access, the paired ideal.
    merged, scalar = small["merged"], small["scalar"]
    assert row(merged, "K^T", "load") == (16, 16, 32, 32)
    # scalar: one LDS per (x, c), the 4 row groups read the same word (a broadcast): 1 wavefront each
    assert row(scalar, "K^T", "load") == (4, 64, 64, 64)


def test_p_transpose_store_with_the_padded_rows_is_a_2_way_conflict(small):
    # store_p: lane (ty, tx) writes P^T[(tx TN + c) PS + ty TM + a]: for each c four adjacent words (a), one
    # STS.128. Quarter warp 0 is lanes (ty, tx) = (0, 0), (1, 0), (0, 1), .., (1, 3) (owner); counting in
    # groups of 4 banks (8 per 32), lane (ty, tx) starts in group (tx TN PS / 4 + ty) mod 8.
    # Unpadded, PS = B_r = 16: group (16 tx + ty) mod 8 = ty, so 4 lanes in each of groups 0 and 1, 4-way.
    # Layout.p_stride pads to PS = 20: group (20 tx + ty) mod 8 = (4 tx + ty) mod 8 = 0, 1, 4, 5, 0, 1, 4, 5:
    # 2-way, 2 wavefronts per phase, 8 per access against 4 ideal; TN = 4 accesses. (No stride that keeps
    # the STS.128 aligned does better: 4 distinct even groups for tx = 0..3 need PS = 2 mod 4.)
    # Scalar: 16 STS, word 80 tx + 4 ty + k, bank (16 tx + 4 ty + k) mod 32: 8 banks, 4 lanes each: 4-way.
    layout, merged, scalar = small["layout"], small["merged"], small["scalar"]
    assert layout.p_stride == 20
    assert layout._store_p_wavefronts(layout.block_q) == 64  # what the unpadded rows would cost
    assert row(merged, "P^T", "store") == (16, 4, 32, 16)
    assert row(scalar, "P^T", "store") == (4, 16, 64, 16)
    assert merged["regions"]["P^T"]["degree"] > 1


def test_totals_add_up_and_the_cost_is_per_iteration(small):
    for widths in smem_trace.WIDTH_MODES:
        result, rows = small[widths], small["rows"][widths]
        third = smem_costs.difference(rows[3], rows[2])
        assert third == smem_costs.difference(rows[2], rows[1])  # not a prologue artefact
        total = result["total"]
        assert total["wavefronts"] == sum(r["wavefronts"] for r in result["rows"]) == sum(
            r["wavefronts"] for r in result["regions"].values()) > 0
        assert total["ideal"] <= total["wavefronts"]
        assert set(result["regions"]) == {"Q^T", "K^T", "V", "P^T", "red"}


def test_per_site_pairing_equals_the_tracer_where_no_warp_diverges(small):
    trace = small["trace"]  # 1 tile
    rows, divergence = smem_costs._priced(trace, "merged")
    assert divergence is None and rows == small["rows"]["merged"][1]
    per_site = smem_costs.report_per_site(trace, "merged")
    assert {k: (c.accesses, c.wavefronts, c.ideal) for k, c in per_site.items()} == rows


@cuda.jit
def branch_into_its_own_array(out):
    """Lanes t % 8 == 0 store into `few` (a branch the others skip), then every lane stores into `all_`."""
    few = cuda.shared.array(WARP, float32)
    all_ = cuda.shared.array(WARP, float32)
    t = cuda.threadIdx.x
    if t % 8 == 0:
        few[t // 8] = float32(1)
    all_[t] = float32(2)


def test_a_branch_into_its_own_region_is_paired_per_site():
    with smem_trace.trace_shared() as trace:
        branch_into_its_own_array[1, WARP](np.zeros(1, np.float32))
    with pytest.raises(smem_trace.DivergenceError):
        trace.report("scalar")
    rows, divergence = smem_costs._priced(trace, "scalar")
    assert divergence and "lanes disagree" in divergence
    assert {site.split("@")[0]: counts for (site, _, _), counts in rows.items()} == {
        "few": (1, 1, 1), "all_": (1, 1, 1)}  # 4 lanes, words 0..3; 32 lanes, words 0..31


@pytest.mark.parametrize("variant", ["bwd-kv", "bwd-q"])
def test_the_cuda_core_backward_meets_every_bank_once(variant):
    # backward.py's ownership at B = 32, d = 32: t = 4, side = 8 (T = 64 threads, 2 warps of 4 rows ty of 8
    # threads tx), TD = 4 features a thread in one run (RUN = 4). S and dP: thread (ty, tx) reads Q / dO rows
    # ty + 8 a and K / V rows tx + 8 c; rows are QS = 36 floats apart, so the 8 tx of a row group hit banks
    # 4 tx + k (all different) and the 4 ty of a warp broadcast within theirs: 1 wavefront a scalar access
    # (with t consecutive rows a thread, tx t + c, the 8 tx met 2 banks: 4-way). P, dS rows are PS = 40
    # floats: the store of element (ty + 8 a, tx + 8 c) by the warp's 32 lanes meets banks 8 ty + tx, once each.
    # Scalar K loads an iteration: S reads t K values per feature (32 features), dQ = dS K reads TD per key
    # (32 keys), per warp: (32 t + 32 TD) x 2 warps = 512, one wavefront each.
    cfg = dict(variant=variant, block_q=32, block_k=32, head_dim=32, dtype="float32", causal=False)
    from fa_numba.kernels import backward

    config = backward.BackwardConfig({"bwd-kv": "kv", "bwd-q": "q"}[variant], 32, 32, False)
    assert (config.t, config.side, config.p_stride, config.run) == (4, 8, 40, 4)
    for widths, result in smem_costs.per_iteration_modes(cfg).items():
        assert result["total"]["wavefronts"] == result["total"]["ideal"], widths
        assert all(r["wavefronts"] == r["ideal"] for r in result["rows"]), (widths, result["rows"])
        stores = {(r["region"], r["width"]): (r["accesses"], r["wavefronts"]) for r in result["rows"]
                  if r["kind"] == "store" and r["region"] in ("P", "dS")}
        assert stores == {("P", 4): (32, 32), ("dS", 4): (32, 32)}, widths
        if widths == "scalar":
            (k_loads,) = [r for r in result["rows"] if r["region"] == "K" and r["kind"] == "load"]
            assert (k_loads["accesses"], k_loads["wavefronts"]) == (512, 512)


def test_the_command_line_prints_one_result_per_configuration(capsys):
    # a backward q kernel of 8 x 8 tiles at d = 8: micro-tile 4 (backward.micro_for), 2 x 2 = 4 threads
    tiny = [dict(variant="bwd-q-dq", block_q=8, block_k=8, head_dim=8, dtype="float32", causal=True),
            dict(variant="v2-rowwise", block_q=8, block_k=8, head_dim=8, dtype="float16", causal=False)]
    assert smem_costs.main([json.dumps(tiny), "--widths", "both"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == [json.dumps(cfg, sort_keys=True) for cfg in tiny]
    bwd, rowwise = out.values()
    assert bwd["merged"]["loop"] == "key tiles" and "non-causal kernel" in bwd["merged"]["note"]
    # dQ_i += dS K_j reads dS and K every iteration; dq-only mode stores no P
    assert {"dS", "K", "V", "Q", "dO"} <= set(bwd["scalar"]["regions"]) and "P" not in bwd["scalar"]["regions"]
    # one thread per query row: every lane reads the same K_j element, a broadcast (no conflict)
    assert rowwise["scalar"]["regions"]["k_tile"]["degree"] == 1.0 and rowwise["merged"]["total"]["wavefronts"] > 0


def test_the_traced_inputs_are_float32_values_for_both_float32_kinds_and_bits_for_16_bit_ones():
    """3xTF32 ("float32") and plain TF32 ("tf32") kernels read float32 arrays; 16-bit ones their bits."""
    for dtype, want in (("float32", np.float32), ("tf32", np.float32), ("float16", np.uint16), ("bfloat16", np.uint16)):
        (q, k, v), _ = smem_costs._inputs(dict(variant="v2-mma", head_dim=16, dtype=dtype), 16, 16)
        assert q.dtype == k.dtype == v.dtype == want, dtype
    (q, _, _), _ = smem_costs._inputs(dict(variant="v2-mma", head_dim=16, dtype="bfloat16"), 16, 16)
    (f, _, _), _ = smem_costs._inputs(dict(variant="v2-mma", head_dim=16, dtype="float32"), 16, 16)
    assert np.array_equal(q, (f.view(np.uint32) >> 16).astype(np.uint16))  # the same draw, its top 16 bits


def test_unknown_widths_and_variants_are_errors():
    with pytest.raises(ValueError, match="widths must be one of"):
        smem_costs.per_iteration(SMALL, "vector")
    with pytest.raises(ValueError, match="unknown variant"):
        smem_costs._sizes({**SMALL, "variant": "v3"}, 1)
    assert smem_costs._sizes(SMALL, 2) == (16, 64)  # v2: the key tiles grow
    assert smem_costs._sizes({**SMALL, "variant": "bwd-kv"}, 2) == (32, 32)  # backward kv: the query tiles


def test_a_negative_difference_is_not_a_per_iteration_cost():
    key = ("K^T@smem", "load", 4)
    assert smem_costs.difference({key: (3, 3, 3)}, {key: (1, 1, 1)}) == {key: (2, 2, 2)}
    with pytest.raises(ValueError, match="not a per-iteration cost"):
        smem_costs.difference({key: (1, 1, 1)}, {key: (2, 2, 2)})


# ---------------------------------------------------------------------------------------------------------
# Slow tier: every shipped kernel at both ends of its head dims (float32, non-causal: a causal or float16 one
# runs the same FULL-tile code), in parallel subprocesses through the command line.

SHIPPED_SECONDS = 300  # per process, generous: each configuration takes 5-20 s here (process start included)
# A process that runs past it writes every thread's stack (faulthandler) and exits 1, so that a stall shows
# where it sits.
_STALL_WRAPPER = ("import faulthandler, sys; faulthandler.dump_traceback_later({seconds}, exit=True); "
                  "from fa_numba.kernels.smem_costs import main; sys.exit(main(sys.argv[1:]))")


def _smem_costs_processes(cfgs, env):
    code = _STALL_WRAPPER.format(seconds=SHIPPED_SECONDS)
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps([cfg]), "--widths", "both"],
                              stdout=subprocess.PIPE, text=True, env=env) for cfg in cfgs]
    return [(proc.communicate(timeout=SHIPPED_SECONDS + 60)[0], proc.returncode) for proc in procs]


def _smallest_and_largest_head_dims(cfgs):
    """Each variant at its smallest and largest shipped head dim: every kernel's code and both ends of its layouts
    (the micro-tiles and staging change with d; the tracer's path does not): 20 of the 28 configurations, to keep
    the slow tier inside CI's time (a CI run on 2026-12-03 did not finish in 90 minutes)."""
    dims = {}
    for cfg in cfgs:
        dims.setdefault(cfg["variant"], set()).add(cfg["head_dim"])
    return [cfg for cfg in cfgs if cfg["head_dim"] in (min(dims[cfg["variant"]]), max(dims[cfg["variant"]]))]


@pytest.mark.slow
def test_every_shipped_kernel_at_both_ends_of_its_head_dims():
    from fa_numba import profile

    shipped = list(profile.configurations(dtypes=("float32",), causals=(False,)))
    cfgs = _smallest_and_largest_head_dims(shipped)
    assert {c["variant"] for c in cfgs} == {c["variant"] for c in shipped} and len(cfgs) < len(shipped)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    jobs = max(1, min(len(cfgs), os.cpu_count() or 1))
    results = {}
    for first in range(0, len(cfgs), jobs):
        batch = cfgs[first:first + jobs]
        for cfg, (out, code) in zip(batch, _smem_costs_processes(batch, env)):
            assert code == 0, f"smem_costs exited {code} on {cfg} (every thread's stack above if it ran too long)"
            results.update(json.loads(out))
    lines = []
    for cfg in cfgs:
        got = results[json.dumps(cfg, sort_keys=True)]
        merged, scalar = got["merged"]["total"], got["scalar"]["total"]
        lines.append(f"{cfg['variant']:11s} d={cfg['head_dim']:3d} merged {merged['wavefronts']:6d} scalar "
                     f"{scalar['wavefronts']:6d} ({got['merged']['seconds']} s)")
        for mode in smem_trace.WIDTH_MODES:
            result = got[mode]
            total = result["total"]
            assert total["wavefronts"] > 0 and total["accesses"] > 0 and 0 < total["ideal"] <= total["wavefronts"]
            assert total["wavefronts"] == sum(r["wavefronts"] for r in result["rows"])
            assert all(min(r["accesses"], r["wavefronts"], r["ideal"]) >= 0 for r in result["rows"])
        assert merged["accesses"] <= scalar["accesses"]  # merging only joins accesses
        if cfg["variant"] in smem_costs.ENGINE_VARIANTS:  # the per-iteration operand stores, by hand
            layout = smem_costs._build(cfg).config.layout
            loaded, rows = ("K^T", layout.block_k) if cfg["variant"] == "v2" else ("Q^T", layout.block_q)
            steps = layout.d_pad * rows // layout.threads  # one store of 32 consecutive words per warp and step
            warps = layout.threads // WARP
            stores = [r for r in got["scalar"]["rows"] if r["region"] == loaded and r["kind"] == "store"]
            assert [(r["accesses"], r["wavefronts"]) for r in stores] == [(steps * warps, steps * warps)]
    print("\n".join(lines))


# The tensor-core v2 at its smallest: one warp, B_c = 16, d = 16 (rows of Q, K, V staged 24 halves = 48 bytes
# apart, d padded by 8). One more key tile costs, worked out by hand from the kernel and the bank rule:
# - K and V each staged by one warp-wide cp.async of 16 bytes per lane (16 rows x 2 chunks = 32 lanes): lane l
#   writes row l // 2, chunk l % 2, at byte 48 (l // 2) + 16 (l % 2). A quarter-warp phase writes 4 rows of
#   32 bytes at 0, 48, 96, 144 mod 128 = [0, 32), [48, 80), [96, 128), [16, 48): [16, 32) twice, 2-way: 2
#   wavefronts per phase, 8 per copy, 16 for both (ideal 8);
# - S: 2 key blocks of 8 x 1 k-step of 16 (one k-step: no pair for an x4): 2 ldmatrix.x2 of K; P V: 1 k-step of 16
#   keys x 2 blocks of 8 columns: one ldmatrix.x4.trans of V; each matrix 8 rows 48 bytes apart, in 8 disjoint
#   4-bank groups (test_banks): 1 wavefront per matrix, 2 per x2, 4 for the x4, 8 in all.
@pytest.fixture(scope="module")
def tiny_mma():
    return smem_costs.per_iteration(dict(variant="v2-mma", block_q=16, block_k=16, head_dim=16, dtype="float16",
                                         causal=False))


def test_tensor_core_staging_and_ldmatrix_cost_what_the_bank_rule_says(tiny_mma):
    by_kind = {}
    for r in tiny_mma["rows"]:
        got = by_kind.setdefault((r["kind"], r["width"]), [0, 0, 0])
        for i, key in enumerate(("accesses", "wavefronts", "ideal")):
            got[i] += r[key]
    assert by_kind == {("store", 16): [2, 16, 8], ("matrix", 16): [3, 8, 8]}
    assert tiny_mma["total"] == {"accesses": 5, "wavefronts": 24, "ideal": 16, "degree": 1.5}
    assert set(tiny_mma["regions"]) == {"sk", "sv"}  # Q_i is staged once, outside the tile loop
