"""Contracts of the static profile's pure functions (fa_numba.profile: parse_sass, innermost_loops, hot_loops,
parse_ptxas, occupancy, bound) on hand-written input, beyond tests/test_profile.py's known listing: what is
a back edge, loops that share a header, the uniform datapath, incomplete ptxas logs, partial warps, and
the caps and precision of the bound."""

from fa_numba import profile


def _line(address: int, text: str) -> str:
    return f"        /*{address:04x}*/                   {text} ;"


def _loop(*opcodes: str) -> profile.Loop:
    """A loop of these instructions (16 bytes apart), closed by the last one."""
    instructions = tuple(profile.Instruction(16 * k, op, "", False) for k, op in enumerate(opcodes))
    return profile.Loop(0, 16 * (len(opcodes) - 1), 1, instructions)


def test_only_bra_and_jmp_are_branches_and_a_backward_label_elsewhere_is_not_a_loop():
    """parse_sass lists (address, label) for BRA and JMP only: BSSY names a label too (its reconvergence
    point) but does not jump, so a BSSY that names an earlier label closes no loop."""
    listing = "\n".join([
        ".L_x_0:",
        _line(0x00, "MOV R1, c[0x0][0x28]"),
        _line(0x10, "BSSY B0, `(.L_x_0)"),
        ".L_x_1:",
        _line(0x20, "FFMA R2, R2, R2, R2"),
        _line(0x30, "@!P0 JMP `(.L_x_1)"),
        _line(0x40, "EXIT"),
    ])
    instructions, labels, branches = profile.parse_sass(listing)
    assert [i.address for i in instructions] == [0x00, 0x10, 0x20, 0x30, 0x40]
    assert labels == {".L_x_0": 0x00, ".L_x_1": 0x20}
    assert branches == [(0x30, ".L_x_1")]
    assert instructions[3].predicated and instructions[3].base == "JMP" and not instructions[2].predicated
    assert [(loop.start, loop.end) for loop in profile.innermost_loops(listing)] == [(0x20, 0x30)]


def test_two_back_edges_to_one_header_make_the_shorter_loop_the_innermost():
    """A loop with a `continue` has two back edges to its header: [header, first] lies inside [header,
    second], so only the first is innermost, at depth 2."""
    listing = "\n".join([
        _line(0x00, "MOV R1, c[0x0][0x28]"),
        ".L_x_0:",
        _line(0x10, "LDS R3, [R6]"),
        _line(0x20, "FFMA R8, R3, R2, R8"),
        _line(0x30, "@P0 BRA `(.L_x_0)"),
        _line(0x40, "FFMA R9, R3, R2, R9"),
        _line(0x50, "@P1 BRA `(.L_x_0)"),
        _line(0x60, "EXIT"),
    ])
    loops = profile.innermost_loops(listing)
    assert [(loop.start, loop.end, loop.depth) for loop in loops] == [(0x10, 0x30, 2)]


def test_the_uniform_datapath_counts_as_integer_only_for_integer_operations():
    categories = {"USHF.L.U32": "integer", "UIMAD": "integer", "ULOP3.LUT": "integer", "UMOV": "integer",
                  "UTMALDG.2D": "other", "UBLKCP.S.G": "other", "USETMAXREG": "other", "ULDC.64": "other"}
    for opcode, category in categories.items():
        assert profile.Instruction(0, opcode, "", False).category == category, opcode


def test_a_loop_counts_its_opcodes_and_its_issue_slots_per_ffma():
    loop = _loop("FFMA", "LDS.128", "FFMA", "IADD3", "LDS.128", "FFMA", "BRA")
    assert loop.opcodes == {"FFMA": 3, "LDS.128": 2, "IADD3": 1, "BRA": 1}
    assert list(loop.opcodes) == ["FFMA", "LDS.128", "IADD3", "BRA"]  # most frequent first
    assert loop.issued == 7 and loop.ffma == 3 and loop.issued_per_ffma == 7 / 3  # the same division of 7 by 3
    assert _loop("LDS", "BRA").issued_per_ffma == float("inf")


def test_a_matrix_product_loop_reads_shared_or_local_memory():
    shared, local = _loop("LDS", "FFMA", "BRA"), _loop("LDL", "FFMA", "BRA")
    registers_only, with_exp = _loop("FFMA", "BRA"), _loop("LDS", "FFMA", "MUFU.EX2", "BRA")
    assert profile.hot_loops([registers_only, shared, with_exp, local]) == [shared, local]
    assert profile.hot_loops([registers_only, with_exp]) == [registers_only, with_exp]  # the fallback


def test_an_incomplete_ptxas_log_means_no_spills_no_stack_no_shared_memory():
    assert profile.parse_ptxas("ptxas info    : Used 40 registers, used 1 barriers") == dict(
        registers=40, spill_stores=0, spill_loads=0, stack=0, smem=0)
    assert profile.parse_ptxas("") == dict(registers=None, spill_stores=0, spill_loads=0, stack=0, smem=0)


def test_occupancy_counts_whole_warps_and_whole_blocks():
    """A partial warp occupies a whole warp (100 threads are 4 warps), and every count is an int: 96 threads
    with few registers are limited by warps to floor(64 / 3) = 21 blocks, 63 warps."""
    occ = profile.occupancy(100, 32, 0)
    assert occ["warps_per_block"] == 4 and occ["by_resource"]["warps"] == 16
    occ = profile.occupancy(96, 16, 0)
    assert (occ["blocks_per_sm"], occ["warps_per_sm"], occ["limiter"]) == (21, 63, "warps")
    for occ in (profile.occupancy(96, 16, 0), profile.occupancy(64, 72, 32768), profile.occupancy(1000, 40, 5000)):
        values = [occ["blocks_per_sm"], occ["warps_per_sm"], occ["warps_per_block"], *occ["by_resource"].values()]
        assert all(type(v) is int for v in values), occ


def test_the_bound_caps_each_fraction_at_one_and_reports_rounded_numbers():
    occ = profile.occupancy(64, 72, 32768)  # 12 warps per SM
    # 8 FFMAs per LDS: the shared-memory pipe could feed 4x more than the schedulers issue; its cap is 1.
    many = profile.bound([_loop(*["FFMA"] * 8, "LDS", "BRA")], occ, launch_warps=10**6)
    assert many["lsu_fraction"] == 1.0 and many["ffma_fraction"] == 0.8
    # No shared or local memory at all: no LSU cap.
    assert profile.bound([_loop("FFMA", "IADD3", "BRA")], occ, launch_warps=10**6)["lsu_fraction"] == 1.0
    # Ratios to 4 decimals, TFLOP/s to 2, the peak to 1; the device's size and clock set the peak.
    small = profile.Device(name="3 SMs", sms=3, clock_ghz=1.234)  # peak 3 x 128 x 2 x 1.234 GHz = 0.948 TFLOP/s
    b = profile.bound([_loop("FFMA", "LDS", "LDS", "LDS", "IADD3", "BRA")], occ, launch_warps=1, device=small)
    assert b == {"hot_loops": 1, "ffma_fraction": 0.1667, "lsu_fraction": 0.0833, "fill": 0.0833,
                 "fraction_of_peak": 0.0069, "tflops": 0.01, "peak_tflops": 0.9}
