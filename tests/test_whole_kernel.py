"""fa_numba.whole_kernel on hand-written listings whose per-iteration counts are worked out by hand: a tile
loop holding a matrix-product loop and a load loop, each run as many times as its anchor requires; a loop no
rule covers, counted once and listed; and the products check that withholds an estimate."""

import pytest

from fa_numba import machine, whole_kernel
from sass_listing import listing as _listing

CFG = dict(variant="v2", block_q=4, block_k=4, head_dim=8, dtype="float32", causal=False)
THREADS = 4  # so one product is B_r B_c d / threads = 4 * 4 * 8 / 4 = 32 multiply-adds per thread


def _kernel(product_loop: list[str], load_loop: list[str]) -> str:
    """A tile loop: 2 own instructions (a global load and its use), then the load loop, then the product loop
    twice (S and P V), then its back edge: 3 own instructions in all."""
    return _listing(
        ".L_x_0",
        "LDG.E R2, desc[UR4][R4.64]",
        "STS [R6], R2",
        ".L_x_1", *load_loop, "@P1 BRA `(.L_x_1)",
        ".L_x_2", *product_loop, "@P0 BRA `(.L_x_2)",
        ".L_x_3", *product_loop, "@P0 BRA `(.L_x_3)",
        "@P2 BRA `(.L_x_0)",
        "EXIT",
        ".L_x_9", "BRA `(.L_x_9)")


# 8 FFMA per trip: 32 / 8 = 4 trips of (2 LDS + 8 FFMA + the branch) = 11 instructions
PRODUCT = ["LDS.128 R8, [R10]", "LDS.128 R12, [R10+0x10]"] + [f"FFMA R{20 + i}, R8, R12, R{20 + i}" for i in range(8)]
# 2 global loads per trip: B_c d / threads = 4 * 8 / 4 = 8 elements per thread, so 4 trips; each trip waits
# once (LDG, LDG, then the STS of the first: one round trip), 5 instructions with the branch
LOAD = ["LDG.E R30, desc[UR4][R32.64]", "LDG.E R31, desc[UR4][R34.64]", "STS [R36], R30", "STS [R36+0x4], R31"]


def test_each_inner_loop_runs_as_often_as_its_anchor_requires():
    counts = whole_kernel.iteration_counts(_kernel(PRODUCT, LOAD), CFG, THREADS)
    assert counts["unattributed"] == []
    assert counts["instructions"] == 3 + 4 * 5 + 2 * 4 * 11  # own, the load loop, two product loops
    assert counts["ffma"] == 2 * 4 * 8 and counts["products"] == 2
    assert counts["load_round_trips"] == 1 + 4 * 1
    assert counts["by_category"]["LDS/STS"] == 1 + 4 * 2 + 2 * 4 * 2
    assert counts["shared_accesses"] == {"STS.4": 1 + 4 * 2, "LDS.16": 2 * 4 * 2}  # by opcode and lane width


def test_a_loop_no_rule_covers_is_counted_once_and_listed():
    odd = ["IADD3 R40, R40, 0x1, RZ", "ISETP.NE.AND P1, PT, R40, R41, PT"]  # no load, no FFMA: no anchor
    counts = whole_kernel.iteration_counts(_kernel(PRODUCT, odd), CFG, THREADS)
    assert counts["unattributed"] == ["0x0020-0x0040"]
    assert counts["instructions"] == 3 + 1 * 3 + 2 * 4 * 11


def test_a_product_loop_whose_trips_are_not_whole_is_not_trusted():
    ragged = PRODUCT[:2] + PRODUCT[2:2 + 5]  # 5 FFMA per trip: 32 / 5 trips is not a whole number
    counts = whole_kernel.iteration_counts(_kernel(ragged, LOAD), CFG, THREADS)
    assert counts["unattributed"] == ["0x0070-0x00e0", "0x00f0-0x0160"]  # 2 LDS + 5 FFMA + BRA each


def test_no_tile_loop_is_an_error():
    flat = _listing(".L_x_2", *PRODUCT, "@P0 BRA `(.L_x_2)", "EXIT")
    with pytest.raises(ValueError, match="no SASS loop holds all its matrix-product loops"):
        whole_kernel.iteration_counts(flat, CFG, THREADS)


# A tensor-core tile loop (v2-mma, one warp, B_c = 16, d = 16): the engine unrolls every fragment loop, so the
# tile loop has no inner loop; S = Q K^T takes B_c / 8 x d / 16 = 2 HMMA per warp, P V B_c / 16 x d / 8 = 2:
# 4 HMMA of 16 x 8 x 16 multiply-adds = 2 products of 16 rows x B_c x d, exactly.
MMA_CFG = dict(variant="v2-mma", block_q=16, block_k=16, head_dim=16, dtype="float16", causal=False)
COPY = "LDGSTS.E.BYPASS.128 [R17], desc[UR28][R14.64], P2"
HMMA = "HMMA.16816.F32 R4, R8, R12, R4"


def _mma_kernel(*body: str) -> str:
    return _listing(".L_x_0", *body, "@P2 BRA `(.L_x_0)", "EXIT", ".L_x_9", "BRA `(.L_x_9)")


def test_a_tensor_core_iteration_counts_its_hmma_and_one_wait_for_its_copies():
    text = _mma_kernel(COPY, COPY, "LDGDEPBAR", "DEPBAR.LE SB0, 0x0", "BAR.SYNC.DEFER_BLOCKING 0x0",
                       "LDSM.16.M88.2 R8, [R4]", HMMA, HMMA, "MUFU.EX2 R20, R21", HMMA, HMMA)
    counts = whole_kernel.mma_iteration_counts(text, MMA_CFG, d_pad=16)
    assert counts["instructions"] == 12 and counts["hmma"] == 4 and counts["products"] == 2  # 11 + the back edge
    assert counts["load_round_trips"] == 1 and counts["mufu"] == 1 and counts["unattributed"] == []
    assert counts["shared_accesses"] == {"LDGSTS": 2, "LDSM": 1}


def test_a_tensor_core_estimate_is_withheld_when_the_hmma_are_not_two_products_or_a_loop_hides_inside():
    three = whole_kernel.mma_iteration_counts(_mma_kernel(HMMA, HMMA, HMMA), MMA_CFG, d_pad=16)
    assert three["products"] == 1.5
    occupancy = {"blocks_per_sm": 8}
    launch = dict(batch=1, heads=1, n=64)
    found, why = whole_kernel.estimate_configuration(MMA_CFG, three, occupancy, (4, 1), (32, 1, 1), 10.0, launch)
    assert found is None and "1.50 products" in why["withheld"]
    inner = _listing(".L_x_0", HMMA, HMMA, ".L_x_1", COPY, "@P1 BRA `(.L_x_1)", HMMA, HMMA, "@P2 BRA `(.L_x_0)",
                     "EXIT", ".L_x_9", "BRA `(.L_x_9)")
    looped = whole_kernel.mma_iteration_counts(inner, MMA_CFG, d_pad=16)
    assert looped["products"] == 2 and len(looped["unattributed"]) == 1
    found, why = whole_kernel.estimate_configuration(MMA_CFG, looped, occupancy, (4, 1), (32, 1, 1), 10.0, launch)
    assert found is None and "no trip-count rule" in why["withheld"]


# The kv backward on tensor cores (one warp owns 16 keys, B_r = 16, B_c = 16, d = 16): a visit does S^T, dP^T,
# dV, dK in the visit loop (2 HMMA each: 8) and dQ in a loop the compiler keeps rolled, 1 HMMA per trip and
# 2 trips (its two 8-column blocks): 10 HMMA = 5 products of 16 keys x B_r x d, when the trips are known.
KV_CFG = dict(variant="bwd-kv-mma", block_q=16, block_k=16, head_dim=16, dtype="float16", causal=False)


def test_the_kv_backward_visit_counts_its_rolled_dq_loop_by_the_layouts_trips():
    text = _listing(".L_x_0", *[HMMA] * 8, ".L_x_1", "LDSM.16.MT88.4 R8, [R4]", HMMA, "@P1 BRA `(.L_x_1)",
                    "@P2 BRA `(.L_x_0)", "EXIT", ".L_x_9", "BRA `(.L_x_9)")
    known = whole_kernel.mma_iteration_counts(text, KV_CFG, d_pad=16, inner_trips=2)
    assert known["hmma"] == 10 and known["products"] == 5 and known["unattributed"] == []
    assert known["shared_accesses"] == {"LDSM": 2} and known["instructions"] == 8 + 1 + 2 * 3  # back edges
    unknown = whole_kernel.mma_iteration_counts(text, KV_CFG, d_pad=16)
    assert unknown["hmma"] == 9 and len(unknown["unattributed"]) == 1


def test_the_tile_loop_holds_every_hmma_not_the_smallest_loop_with_one():
    """A loop holding some HMMA inside a larger one holding all: the tile loop is the larger (a kernel's
    products are all in one iteration), and HMMA outside every loop leave no tile loop at all."""
    text = _listing(".L_x_0", HMMA, ".L_x_1", HMMA, "@P1 BRA `(.L_x_1)", "@P2 BRA `(.L_x_0)", "EXIT",
                    ".L_x_9", "BRA `(.L_x_9)")
    counts = whole_kernel.mma_iteration_counts(text, MMA_CFG, d_pad=16)
    assert counts["hmma"] == 2 and len(counts["unattributed"]) == 1
    outside = _listing(HMMA, ".L_x_0", HMMA, "@P2 BRA `(.L_x_0)", "EXIT", ".L_x_9", "BRA `(.L_x_9)")
    with pytest.raises(ValueError, match="no SASS loop holds all its HMMA"):
        whole_kernel.mma_iteration_counts(outside, MMA_CFG, d_pad=16)


def test_a_tensor_core_estimate_charges_six_cycles_per_hmma_and_their_chain():
    counts = whole_kernel.mma_iteration_counts(_mma_kernel(*[HMMA] * 4), MMA_CFG, d_pad=16)
    found, _ = whole_kernel.estimate_configuration(MMA_CFG, counts, {"blocks_per_sm": 8}, (4, 1), (32, 1, 1), 0.0,
                                                   dict(batch=1, heads=1, n=64))
    # 4 blocks on 132 SMs: one each, one warp: its 4 HMMA x 6 cycles on one tensor core (mma.sync at 2/3 of the
    # dense peak), over 5 / 4 issue cycles; the four feed one accumulator, a chain of 4 mma.sync latencies
    assert found.cycles["tensor"] == 24 and found.cycles["issue"] == 5 / 4
    assert found.cycles["latency"] == 4 * machine.PIPES["tensor"].latency and found.limiter == "latency"


def test_a_value_head_dim_weighs_the_products_over_d_v_and_counts_their_useful_flops():
    """With d_v != d (cfg["value_dim"]), the products over V's head dim (P V; dP and dV in the backward) are
    B_r B_c d_v: a forward whose HMMA do S at d = 32 and P V at d_v = 16 (16 rows, B_c = 16: 4 HMMA for S, 2
    for P V over d_pad = 32) amounts to 1 + 16 / 32 products, which is what the estimate expects; the useful
    flops, by hand: 2 B H N^2 per column of each product (flash-attn's 4 B H N^2 d forward at d_v = d)."""
    cfg = dict(MMA_CFG, head_dim=32, value_dim=16)
    counts = whole_kernel.mma_iteration_counts(_mma_kernel(*[HMMA] * 6), cfg, d_pad=32)
    assert counts["products"] == 1.5
    assert whole_kernel.expected_products(cfg, value_ratio=16 / 32) == 1.5
    counts["value_ratio"] = 0.5
    found, why = whole_kernel.estimate_configuration(cfg, counts, {"blocks_per_sm": 8}, (4, 1), (32, 1, 1), 0.0,
                                                     dict(batch=1, heads=1, n=64))
    assert found is not None, why
    launch = dict(batch=2, heads=3, n=10)
    assert whole_kernel.useful_flops(cfg, launch) == 2 * 2 * 3 * 100 * (32 + 16)
    backward = dict(variant="bwd-kv", head_dim=192, value_dim=128, causal=True)  # S, dK, dQ at d; dP, dV at d_v
    assert whole_kernel.useful_flops(backward, launch) == 2 * 2 * 3 * 100 * (3 * 192 + 2 * 128) / 2
    assert whole_kernel.useful_flops(dict(backward, value_dim=0), launch) == 2.5 * 4 * 2 * 3 * 100 * 192 / 2


def test_hbm_bytes_count_v_o_do_and_dv_at_d_v():
    """The bytes each tensor moves once (the L2-resident case) with d_v: Q and K at d, V at d_v (2 bytes each,
    float16), O at d_v in float32, LSE 4 bytes a row; by hand for one head of N = 128."""
    cfg = dict(variant="v2-mma", block_q=64, block_k=64, head_dim=64, value_dim=32, dtype="float16", causal=False)
    launch = dict(batch=1, heads=1, n=128)
    got = whole_kernel.hbm_bytes(cfg, launch, concurrent_blocks=2, blocks_per_head=2)
    assert got["fits_l2"] and got["once"] == 128 * (2 * 64 + 2 * 64 + 2 * 32 + 4 * 32 + 4)
    # iomodel's count: v2 reads K and V once per query tile, two tiles of 64 rows here
    assert got["counted"] == got["once"] + 128 * (2 * 64 + 2 * 32)


def test_the_kv_backward_trip_count_names_one_loop_so_two_inner_hmma_loops_are_not_counted_by_it():
    """Two inner loops of HMMA (a rolled k-step loop beside the dQ loop): the kernel's trip count could be
    either's, so neither is counted by it; both are listed and the estimate is withheld (a first d_v build
    counted 4.5 products for 4 this way)."""
    text = _listing(".L_x_0", *[HMMA] * 8, ".L_x_1", HMMA, HMMA, "@P1 BRA `(.L_x_1)",
                    ".L_x_2", "LDSM.16.MT88.4 R8, [R4]", HMMA, "@P3 BRA `(.L_x_2)",
                    "@P2 BRA `(.L_x_0)", "EXIT", ".L_x_9", "BRA `(.L_x_9)")
    counts = whole_kernel.mma_iteration_counts(text, KV_CFG, d_pad=16, inner_trips=2)
    assert counts["hmma"] == 11 and len(counts["unattributed"]) == 2
