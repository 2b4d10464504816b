"""fa_numba.sass beyond what tests/test_profile.py and tests/test_contracts_profile.py check through profile's
names: the loop tree, the tile loop around a set of loops, and the global-load round trips of a straight-line
body, on hand-written listings whose answers are worked out by hand in the comments; then on two small real
kernels whose round trips are known from their source (compiled for sm_90a in a subprocess with the real
numba.cuda; skipped without nvdisasm).
"""

import json
import os
import subprocess
import sys

import pytest

from fa_numba import profile, sass
from sass_listing import listing as _listing

NEEDS_NVDISASM = pytest.mark.skipif(profile.nvdisasm_path() is None,
                                    reason="nvdisasm is missing: install the profile extra (pip install '.[profile]')")


def _body(*lines) -> list:
    """The instructions of a straight-line body."""
    return sass.parse_sass(_listing(*lines))[0]


def _spans(loops) -> list:
    return [(loop.start, loop.end) for loop in loops]


def test_profile_names_are_the_sass_ones():
    for name in ("parse_sass", "innermost_loops", "hot_loops", "float64_instructions", "Instruction", "Loop",
                 "CATEGORIES", "LSU_CATEGORIES"):
        assert getattr(profile, name) is getattr(sass, name), name


# A top-level loop T [0x10, 0xd0] around M [0x20, 0xb0], which holds two matrix-product loops A [0x30, 0x50] and
# B [0x70, 0x90]; then a separate exp loop C [0xf0, 0x100] and the self-branch that ends the kernel.
NESTED = _listing(
    "MOV R1, c[0x0][0x28]",  # 0x00
    ".L_x_0",
    "LDG.E R2, desc[UR4][R4.64]",  # 0x10  T
    ".L_x_1",
    "IMAD.MOV.U32 R8, RZ, RZ, RZ",  # 0x20  M
    ".L_x_2",
    "LDS R3, [R6]",  # 0x30  A
    "FFMA R8, R3, R2, R8",  # 0x40
    "@P0 BRA `(.L_x_2)",  # 0x50  A ends
    "IADD3 R6, R6, 0x4, RZ",  # 0x60
    ".L_x_3",
    "LDS R9, [R6+0x80]",  # 0x70  B
    "FFMA R8, R9, R2, R8",  # 0x80
    "@P1 BRA `(.L_x_3)",  # 0x90  B ends
    "ISETP.NE.AND P2, PT, R6, RZ, PT",  # 0xa0
    "@P2 BRA `(.L_x_1)",  # 0xb0  M ends
    "STS [R7], R8",  # 0xc0
    "@!P3 BRA `(.L_x_0)",  # 0xd0  T ends
    "BSSY B0, `(.L_x_5)",  # 0xe0
    ".L_x_4",
    "MUFU.EX2 R10, R10",  # 0xf0  C
    "@P4 BRA `(.L_x_4)",  # 0x100 C ends
    ".L_x_5",
    "EXIT",  # 0x110
    ".L_x_6",
    "BRA `(.L_x_6)",  # 0x120 the self-branch: not a loop
)


def test_loop_tree_of_nested_loops():
    tree = sass.loop_tree(NESTED)
    # Ordered by start, an outer loop before the loops it holds: T, M, A, B, C.
    assert _spans(tree) == [(0x10, 0xD0), (0x20, 0xB0), (0x30, 0x50), (0x70, 0x90), (0xF0, 0x100)]
    assert [node.depth for node in tree] == [1, 2, 3, 3, 1]
    assert [node.parent for node in tree] == [None, 0, 1, 1, None]
    assert [node.children for node in tree] == [(1,), (2, 3), (), (), ()]
    # T spans 13 instructions, 10 of them in M: its own are the LDG, the STS and its back edge.
    # M spans 10, 3 in A and 3 in B: its own are the IMAD, the IADD3, the ISETP and its back edge.
    assert [len(node.instructions) for node in tree] == [13, 10, 3, 3, 2]
    assert [len(node.own) for node in tree] == [3, 4, 3, 3, 2]
    assert [i.address for i in tree[0].own] == [0x10, 0xC0, 0xD0]
    assert [i.opcode for i in tree[1].own] == ["IMAD.MOV.U32", "IADD3", "ISETP.NE.AND", "BRA"]
    assert tree[2].own == tree[2].instructions
    assert tree[1].mix["FFMA"] == 2 and tree[0].ffma == 2  # a node is a Loop over its whole span
    assert sass.global_load_waits(tree[0].own) == 0  # T's LDG R2 is used only inside A and B, not in T's own


def test_the_leaves_of_the_tree_are_the_innermost_loops():
    tree = sass.loop_tree(NESTED)
    leaves = [node for node in tree if not node.children]
    inner = sass.innermost_loops(NESTED)
    assert [(n.start, n.end, n.depth, n.instructions) for n in leaves] == \
        [(n.start, n.end, n.depth, n.instructions) for n in inner]
    assert _spans(inner) == [(0x30, 0x50), (0x70, 0x90), (0xF0, 0x100)]


def test_enclosing_loop_is_the_smallest_loop_around_all_the_given_ones():
    tree = sass.loop_tree(NESTED)
    t, m, a, b, c = tree
    hot = sass.hot_loops(sass.innermost_loops(NESTED))
    assert _spans(hot) == [(0x30, 0x50), (0x70, 0x90)]  # C has a MUFU and no FFMA
    assert sass.enclosing_loop(tree, hot) == m  # the tile loop: M, not T around it
    assert sass.enclosing_loop(tree, [a]) == m and sass.enclosing_loop(tree, [m]) == t
    assert sass.enclosing_loop(tree, [a, m]) == t  # strictly: M does not contain itself
    assert sass.enclosing_loop(tree, [a, c]) is None  # A and C have no loop in common
    assert sass.enclosing_loop(tree, [t]) is None and sass.enclosing_loop(tree, []) is None


def test_two_back_edges_to_one_header_nest_the_shorter_loop_inside_the_longer():
    listing = _listing(
        "MOV R1, c[0x0][0x28]",  # 0x00
        ".L_x_0",
        "LDS R3, [R6]",  # 0x10
        "FFMA R8, R3, R2, R8",  # 0x20
        "@P0 BRA `(.L_x_0)",  # 0x30  closes [0x10, 0x30]
        "FFMA R9, R3, R2, R9",  # 0x40
        "@P1 BRA `(.L_x_0)",  # 0x50  closes [0x10, 0x50]
        "EXIT",  # 0x60
    )
    outer, inner = sass.loop_tree(listing)
    assert (outer.start, outer.end, outer.depth, outer.parent, outer.children) == (0x10, 0x50, 1, None, (1,))
    assert (inner.start, inner.end, inner.depth, inner.parent, inner.children) == (0x10, 0x30, 2, 0, ())
    assert [i.address for i in outer.own] == [0x40, 0x50]  # what lies after the first back edge
    assert _spans(sass.innermost_loops(listing)) == [(0x10, 0x30)]


def test_overlapping_spans_are_siblings_and_share_their_instructions():
    listing = _listing(
        ".L_x_0",
        "IADD3 R0, R0, 0x1, RZ",  # 0x00
        ".L_x_1",
        "IADD3 R1, R1, 0x1, RZ",  # 0x10
        "@P0 BRA `(.L_x_0)",  # 0x20  closes [0x00, 0x20]
        "@P1 BRA `(.L_x_1)",  # 0x30  closes [0x10, 0x30]
        "EXIT",  # 0x40
    )
    tree = sass.loop_tree(listing)
    assert [(n.start, n.end, n.depth, n.parent, n.children) for n in tree] == [
        (0x00, 0x20, 1, None, ()), (0x10, 0x30, 1, None, ())]
    assert [len(n.own) for n in tree] == [3, 3]
    assert sass.enclosing_loop(tree, [tree[0]]) is None


def test_a_kernel_without_loops_has_an_empty_tree():
    listing = _listing("EXIT", ".L_x_9", "BRA `(.L_x_9)")
    assert sass.loop_tree(listing) == [] and sass.enclosing_loop([], []) is None


# ----------------------------------------------------------------------------------------------------
# Global-load round trips.

def test_loads_issued_back_to_back_are_one_round_trip():
    body = _body(
        "LDG.E R4, desc[UR4][R2.64]",
        "LDG.E R5, desc[UR4][R2.64+0x80]",
        "LDG.E R6, desc[UR4][R2.64+0x100]",
        "LDG.E R7, desc[UR4][R2.64+0x180]",
        "STS [R10], R4",  # waits for R4; R5..R7, issued after it, are taken as arrived with it
        "STS [R10+0x4], R5",
        "STS [R10+0x8], R6",
        "STS [R10+0xc], R7",
    )
    assert sass.global_load_waits(body) == 1


def test_a_load_stored_before_the_next_load_is_a_round_trip_each():
    body = _body(*[text for k in range(4) for text in (
        f"LDG.E R15, desc[UR22][R12.64+{hex(0x20 * k)}]", f"STS [R44+{hex(0x4000 + 0x400 * k)}], R15")])
    assert len(body) == 8 and sass.global_load_waits(body) == 4


def test_a_wide_load_writes_its_whole_register_range():
    assert sass.global_load_waits(_body("LDG.E.128 R4, desc[UR4][R2.64]", "FADD R0, R7, R0")) == 1  # R4..R7
    assert sass.global_load_waits(_body("LDG.E.128 R4, desc[UR4][R2.64]", "FADD R0, R8, R0")) == 0
    assert sass.global_load_waits(_body("LDG.E.64 R4, desc[UR4][R2.64]", "FADD R0, R5, R0")) == 1  # R4, R5
    assert sass.global_load_waits(_body("LDG.E.U16 R4, desc[UR4][R2.64]", "FADD R0, R5, R0")) == 0  # R4 only
    assert sass.load_destination(_body("LDG.E.128.CONSTANT R8, desc[UR4][R2.64]")[0]) == {8, 9, 10, 11}
    assert sass.load_destination(_body("LDG.E.S16 R8, desc[UR4][R2.64]")[0]) == {8}


def test_a_store_waits_for_its_address_and_for_its_whole_value():
    # STS [R10+0x4], R4: the address register is the load's destination, the value is not.
    assert sass.global_load_waits(_body("LDG.E R10, desc[UR4][R2.64]", "STS [R10+0x4], R4")) == 1
    assert sass.global_load_waits(_body("LDG.E R11, desc[UR4][R2.64]", "STS [R10+0x4], R4")) == 0
    # STS.128 [R2], R4 stores R4..R7; STG's address R6.64 is the pair R6, R7.
    assert sass.global_load_waits(_body("LDG.E R7, desc[UR4][R2.64]", "STS.128 [R2], R4")) == 1
    assert sass.global_load_waits(_body("LDG.E R7, desc[UR4][R2.64]", "STG.E desc[UR4][R6.64], R0")) == 1
    assert sass.global_load_waits(_body("LDG.E R8, desc[UR4][R2.64]", "STG.E.64 desc[UR4][R6.64], R0")) == 0


def test_a_load_whose_address_needs_another_load_is_a_second_round_trip():
    body = _body(
        "LDG.E R4, desc[UR4][R2.64]",  # j = idx[i]
        "IMAD.WIDE R6, R4, 0x4, R8",  # &x[j]: waits for j (1)
        "LDG.E R10, desc[UR4][R6.64]",  # x[j]
        "FADD R0, R10, R0",  # waits for x[j] (2)
    )
    assert sass.global_load_waits(body) == 2


def test_overwriting_a_register_in_flight_waits_once_and_ends_its_flight():
    """The chosen rule: a write to a register in flight waits too (the load's late write-back must not land on
    the new value), and the register then holds the new value: the read after it does not wait again."""
    body = _body(
        "LDG.E R4, desc[UR4][R2.64]",
        "IMAD.MOV.U32 R4, RZ, RZ, 0x1",  # writes R4 while the load is in flight: waits (1)
        "FADD R0, R4, R0",  # reads the new R4: no wait
    )
    assert sass.global_load_waits(body) == 1


def test_what_is_not_a_register_in_flight():
    body = _body(
        "LDG.E R4, desc[UR4][R2.64]",
        "ISETP.GE.AND P4, PT, RZ, UR4, PT",  # RZ, a uniform register UR4, predicates
        "S2R R9, SR_TID.X",  # a special register
        "CS2R R12, SRZ",
        "FADD R0, R44, R40",  # R44 and R40 are not R4
        "R2UR UR5, R5",
        "CALL.REL.NOINC `(R4_function)",  # a name, not a register
        "@P4 BRA `(.L_x_0)",
    )
    assert sass.global_load_waits(body) == 0
    assert sass.global_load_waits(body + _body("FMNMX R12, R4.reuse, R12, !PT")) == 1  # .reuse is still R4
    assert sass.touched_registers(_body("LOP3.LUT P0, RZ, R11.reuse, 0xff, RZ, 0xc0, !PT")[0]) == {11}
    assert sass.touched_registers(_body("HADD2.F32 R27, -RZ, R24.H0_H0")[0]) == {27, 24}
    assert sass.touched_registers(_body("LDS.64 R6, [R2.64+UR4+0x10]")[0]) == {2, 3, 6}  # not a wide value


def test_only_global_loads_are_waited_for():
    assert sass.global_load_waits(_body("LDS R4, [R2]", "FADD R0, R4, R0")) == 0
    assert sass.global_load_waits(_body("LDL R4, [R1+0x10]", "FADD R0, R4, R0")) == 0
    assert sass.global_load_waits(_body("LDGSTS.E.128 [R8], desc[UR4][R2.64]", "LDS R4, [R8]",
                                        "FADD R0, R4, R0")) == 0  # asynchronous: no register written
    assert sass.global_load_waits(_body("LD.E R4, [R2.64]", "FADD R0, R4, R0")) == 1  # a generic load counts
    assert sass.global_load_waits(_body("@P0 LDG.E R4, desc[UR4][R2.64]", "FADD R0, R4, R0")) == 1  # predicated
    assert sass.global_load_waits(_body("LDG.E R4, desc[UR4][R2.64]", "RET.REL.NODEC R4 `(f)")) == 1  # a branch
    assert sass.global_load_waits(_body("LDG.E R4, desc[UR4][R2.64]")) == 0  # still in flight at the end
    assert sass.global_load_waits([]) == 0


def test_each_round_trip_waits_for_the_loads_before_it_only():
    body = _body(
        "LDG.E R4, desc[UR4][R2.64]",
        "FADD R0, R4, R0",  # 1
        "LDG.E R5, desc[UR4][R2.64+0x4]",
        "LDG.E R6, desc[UR4][R2.64+0x8]",
        "FADD R0, R6, R0",  # 2: R5, issued before R6, arrived with it
        "FADD R0, R5, R0",
        "FADD R0, R4, R0",
    )
    assert sass.global_load_waits(body) == 2


# ----------------------------------------------------------------------------------------------------
# Two real kernels whose round trips per iteration are known from the source. Each inner loop's exit depends
# on the data it loads, so the compiler cannot unroll it: one SASS iteration is one Python iteration.

REAL_KERNELS = r"""
import json, os, sys
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
from fa_numba import profile
from numba import float32, types


def one_round_trip(x, y, nxt, out):
    # inner loop: x[i], y[i] and nxt[i] are independent: issued back to back, one round trip
    total = float32(0)
    row = 0
    while row < out.shape[0]:
        acc = float32(0)
        i = nxt[row]
        while i >= 0:
            acc += x[i] * y[i]
            i = nxt[i]
        total += acc
        row += 1
    out[0] = total


def two_round_trips(x, idx, nxt, out):
    # x[idx[i]]'s address needs idx[i]: two round trips per iteration
    acc = float32(0)
    i = nxt[0]
    while i >= 0:
        acc += x[idx[i]]
        i = nxt[i]
    out[0] = acc


f, n = types.Array(types.float32, 1, "C"), types.Array(types.int32, 1, "C")
found = {}
for fn, args in ((one_round_trip, (f, f, n, f)), (two_round_trips, (f, n, n, f))):
    cubin, _, _ = profile.compile_for_launch(fn, args)
    found[fn.__name__] = profile.disassemble(cubin)
json.dump(found, sys.stdout)
"""


@pytest.fixture(scope="module")
def real_listings():
    done = subprocess.run([sys.executable, "-c", REAL_KERNELS], env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def _loads(loop) -> int:
    return sum(1 for i in loop.own if i.base in sass.GLOBAL_LOADS)


@pytest.mark.slow  # two sm_90a compiles, ~6 s: the default tier has no seconds to spare (README)
@NEEDS_NVDISASM
def test_real_kernels_round_trips_and_tile_loop(real_listings):
    text = real_listings["one_round_trip"]
    tree = sass.loop_tree(text)
    leaves = [node for node in tree if not node.children]
    assert [(n.start, n.end, n.depth) for n in leaves] == [(n.start, n.end, n.depth)
                                                           for n in sass.innermost_loops(text)]
    (inner,) = [node for node in tree if _loads(node) == 3]  # x[i], y[i], nxt[i]
    outer = tree[inner.parent]
    assert inner.depth == 2 and outer.depth == 1 and sass.enclosing_loop(tree, [inner]) == outer
    assert sass.global_load_waits(inner.own) == 1

    tree = sass.loop_tree(real_listings["two_round_trips"])
    (loop,) = tree
    assert _loads(loop) == 3 and sass.global_load_waits(loop.own) == 2  # idx[i] and nxt[i], then x[idx[i]]


def test_copies_committed_together_cost_one_wait_and_a_wait_with_none_in_flight_costs_none():
    copy = "LDGSTS.E.BYPASS.128 [R17], desc[UR28][R14.64], P2"
    together = _body(copy, copy, copy, "LDGDEPBAR", "DEPBAR.LE SB0, 0x0", "BAR.SYNC.DEFER_BLOCKING 0x0")
    apart = _body(copy, "LDGDEPBAR", "DEPBAR.LE SB0, 0x0", copy, "LDGDEPBAR", "DEPBAR.LE SB0, 0x0")
    # one wait each, covered only by the commit between the newest copy and it (1 of 6 instructions)
    assert sass.async_copy_covers(together) == [1 / 6] and sass.async_copy_covers(apart) == [1 / 6, 1 / 6]
    assert sass.async_copy_covers(_body("DEPBAR.LE SB0, 0x0", "HMMA.16816.F32 R4, R8, R12, R4")) == []
    assert sass.global_load_waits(together) == 0  # a cp.async writes no register: not a global-load wait


def test_a_copy_issued_before_the_work_it_waits_after_is_covered_by_that_work_around_the_back_edge():
    """FlashAttention-2's order: K_j+1 issued after S (late in the body) and waited for at the top of the
    next iteration; V_j issued at the top and waited for after S. Each wait is covered by the instructions
    between its copy and it: V's by the commit and S's 4 HMMA (5 of 14), K's by the commit and P V's 4 HMMA,
    counted around the back edge to the top's wait (5 of 14)."""
    copy, mma = "LDGSTS.E.BYPASS.128 [R17], desc[UR28][R14.64], P2", "HMMA.16816.F32 R4, R8, R12, R4"
    body = _body("DEPBAR.LE SB0, 0x0", copy, "LDGDEPBAR", mma, mma, mma, mma, "DEPBAR.LE SB0, 0x0", copy,
                 "LDGDEPBAR", mma, mma, mma, mma)
    # V_j: copy at 1, wait at 7 (5 between); K_j+1: copy at 8, wait at 14 + 0 (5 to the end, none before it)
    assert sass.async_copy_covers(body) == [5 / 14, 5 / 14]
    issued_then_waited = _body(mma, mma, copy, "LDGDEPBAR", "DEPBAR.LE SB0, 0x0", mma)
    assert sass.async_copy_covers(issued_then_waited) == [1 / 6]  # the one-stage order: nothing to hide behind


def test_a_wait_that_leaves_groups_in_flight_is_pipelined_not_a_round_trip():
    copy = "LDGSTS.E.BYPASS.128 [R17], desc[UR28][R14.64], P2"
    one_ahead = _body(copy, copy, "LDGDEPBAR", "DEPBAR.LE SB0, 0x1", "BAR.SYNC.DEFER_BLOCKING 0x0")
    two_ahead = _body(copy, "LDGDEPBAR", "DEPBAR.LE SB0, 0x2")
    assert sass.async_copy_covers(one_ahead) == [] and sass.pipelined_copy_waits(one_ahead) == 1.0
    assert sass.async_copy_covers(two_ahead) == [] and sass.pipelined_copy_waits(two_ahead) == 0.5
    waits_all = _body(copy, "LDGDEPBAR", "DEPBAR.LE SB0, 0x0")
    assert sass.async_copy_covers(waits_all) == [1 / 3] and sass.pipelined_copy_waits(waits_all) == 0.0
    assert sass.pipelined_copy_waits(_body("DEPBAR.LE SB0, 0x1", "HMMA.16816.F32 R4, R8, R12, R4")) == 0.0  # no copy


def test_an_at_not_pt_placeholder_never_executes():
    placeholder, real = _body("@!PT LDS RZ, [RZ]", "@P0 LDS R4, [R2]")
    assert placeholder.never and placeholder.predicated and not real.never and real.predicated
