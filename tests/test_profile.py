"""The static SASS profile: its parsing and arithmetic on hand-written input, and on real compiled kernels.

The SASS tests compile for sm_90a on the CPU in a subprocess with the real numba.cuda (the simulator is
chosen in this one) and need nvdisasm (the `profile` extra, installed by CI): without it they skip.

Two tiers. The default run tests the parsing and the arithmetic on hand-written input and small kernels; the
default run also reads the committed SASS table of every shipped configuration
(benchmarks/results/sass_table_sm90a.json): made from today's kernel sources (their digest), complete, and every
configuration sound. The slow tier (deselected by default, `.ci/run`'s second pytest invocation, `python -m
pytest -m slow`) compiles `REPRESENTATIVES`, one configuration per kernel at its extreme, named with the reason
it was chosen, and a 3xTF32 build, in a process of its own, and checks them against that table.
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import threading

import pytest

from fa_numba import profile, sources, whole_kernel
from fa_numba.kernels import SIMT_VARIANTS, backward
from fa_numba.kernels.common import SHARED_BYTES_LIMIT

HERE = pathlib.Path(__file__).resolve().parent
NEEDS_NVDISASM = pytest.mark.skipif(profile.nvdisasm_path() is None,
                                    reason="nvdisasm is missing: install the profile extra (pip install -e '.[profile]')")
REAL_CUDA = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}

# A made-up listing in nvdisasm's format: a top-level loop 0x0010-0x0090 holding an inner loop 0x0030-0x0060,
# a separate loop 0x00b0-0x00c0, and the self-branch that ends every kernel.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   IMAD.WIDE R4, R0, 0x4, R4 ;
.L_x_1:
        /*0030*/                   LDS R3, [R6] ;
        /*0040*/                   FFMA R8, R3, R2, R8 ;
        /*0050*/                   LDL R9, [R1+0x10] ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
        /*0070*/                   MUFU.EX2 R10, R8 ;
        /*0080*/                   FMUL R10, R10, R10 ;
        /*0090*/              @!P1 BRA `(.L_x_0) ;
        /*00a0*/                   BSSY B0, `(.L_x_3) ;
.L_x_2:
        /*00b0*/                   FFMA R11, R11, R11, R12 ;
        /*00c0*/               @P2 BRA `(.L_x_2) ;
.L_x_3:
        /*00d0*/                   STG.E desc[UR4][R4.64], R8 ;
        /*00e0*/                   EXIT ;
.L_x_4:
        /*00f0*/                   BRA `(.L_x_4) ;
"""


def test_innermost_loops_depth_and_mix_of_a_known_listing():
    loops = profile.innermost_loops(LISTING)
    assert [(loop.start, loop.end, loop.depth) for loop in loops] == [(0x30, 0x60, 2), (0xB0, 0xC0, 1)]
    inner = loops[0]
    assert inner.issued == 4 and inner.ffma == 1 and inner.issued_per_ffma == 4
    assert inner.mix == {"FFMA": 1, "FMUL": 0, "FADD": 0, "HFMA2/HMMA": 0, "LDS/STS": 1, "LDL/STL": 1,
                         "LDG/STG": 0, "MUFU": 0, "integer": 0, "branch": 1, "other": 0}
    assert inner.instructions[-1].predicated and not inner.instructions[0].predicated
    assert profile.hot_loops(loops) == [inner]  # the loop at 0xb0 has an FFMA but loads nothing from on-chip memory
    assert profile.hot_loops(loops[1:]) == loops[1:]  # without a matrix-product loop, every FFMA loop counts


def test_instruction_categories():
    cases = {"FFMA.FTZ": "FFMA", "FMUL": "FMUL", "FADD.FTZ": "FADD", "HFMA2.MMA": "HFMA2/HMMA", "HMMA.16816.F32": "HFMA2/HMMA",
             "LDS.128": "LDS/STS", "STS.64": "LDS/STS", "LDL.64": "LDL/STL", "STL.128": "LDL/STL", "LDG.E.128": "LDG/STG",
             "STG.E": "LDG/STG", "MUFU.EX2": "MUFU", "IMAD.WIDE.U32": "integer", "UIADD3": "integer", "LOP3.LUT": "integer",
             "ISETP.GE.AND": "integer", "BRA": "branch", "EXIT": "branch", "BAR.SYNC.DEFER_BLOCKING": "other",
             "FSETP.GEU.AND": "other", "ULDC.64": "other"}
    for opcode, category in cases.items():
        assert profile.Instruction(0, opcode, "", False).category == category, opcode


def test_no_loop_and_self_branch_only():
    assert profile.innermost_loops("        /*0000*/  EXIT ;\n.L_x_9:\n        /*0010*/  BRA `(.L_x_9) ;\n") == []
    assert profile.hot_loops([]) == []


def test_float64_instructions_are_found():
    listing = "        /*0000*/  DFMA R2, R2, R4, R6 ;\n        /*0010*/  F2F.F64.F32 R2, R0 ;\n        /*0020*/  FFMA R0, R0, R0, R0 ;\n"
    assert profile.float64_instructions(listing) == ["DFMA", "F2F.F64.F32"]
    assert profile.float64_instructions(LISTING) == []


def test_ptxas_log_is_parsed():
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 16 bytes cumulative stack size, 32768 bytes smem"""
    assert profile.parse_ptxas(log) == dict(registers=40, spill_stores=8, spill_loads=12, stack=16, smem=32768)


@pytest.mark.parametrize("threads, registers, smem, warps, limiter", [
    (64, 72, 32768, 12, "shared memory"),  # today's v2: 6 blocks of 33 KB (32 KB + 1 KB reserved)
    (256, 128, 0, 16, "registers"),  # 4096 registers per warp: 16 warps
    (1024, 32, 0, 64, "registers"),  # 64 warps by registers and by warps: the first limit named wins
    (32, 16, 0, 32, "blocks"),  # 32 blocks of one warp
    (256, 24, 0, 64, "warps"),  # 768 registers per warp would allow 85 warps; 8 blocks of 8 warps fill the SM
    (96, 33, 1000, 51, "registers"),  # 1056 registers per warp round up to 1280: 51 warps, 17 blocks of 3
])
def test_occupancy_by_the_sm90_table(threads, registers, smem, warps, limiter):
    occ = profile.occupancy(threads, registers, smem)
    by = occ["by_resource"]
    regs_per_warp = math.ceil(registers * 32 / 256) * 256
    assert by["registers"] == 65536 // regs_per_warp // math.ceil(threads / 32)
    assert by["shared memory"] == 233472 // (math.ceil(smem / 128) * 128 + 1024)
    assert occ["warps_per_sm"] == min(by.values()) * math.ceil(threads / 32) == warps
    assert occ["limiter"] == limiter


def test_bound_arithmetic():
    loops = profile.innermost_loops(LISTING)
    occ = profile.occupancy(64, 72, 32768)  # 12 warps per SM
    full = profile.bound(loops, occ, launch_warps=10**6)
    # hot loop: 1 FFMA in 4 issued, 2 LDS/LDL: min(1/4, 1/(4*2)) = 1/8 of the peak, every scheduler busy
    assert full["ffma_fraction"] == 0.25 and full["lsu_fraction"] == 0.125 and full["fill"] == 1.0
    assert full["tflops"] == round(profile.H200.peak_fp32_tflops / 8, 2)
    small = profile.bound(loops, occ, launch_warps=profile.H200.sms)  # one warp per SM: 1 of 4 schedulers
    assert small["fill"] == 0.25 and small["fraction_of_peak"] == round(0.125 * 0.25, 4)
    assert profile.bound([], occ, 10**6)["tflops"] == 0.0  # no FFMA loop: no FP32 claim
    assert round(profile.H200.peak_fp32_tflops, 1) == 66.9


def test_arch_is_checked():
    assert profile._cc("sm_90a") == (9, 0, "a") and profile._cc("sm_90") == (9, 0)
    for bad in ("sm_80", "90", "sm_9x"):
        with pytest.raises(ValueError, match="arch"):
            profile._cc(bad)


@pytest.fixture(scope="module")
def probe():
    done = subprocess.run([sys.executable, str(HERE / "profile_probe.py")], env=REAL_CUDA, capture_output=True,
                          text=True, timeout=600, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@NEEDS_NVDISASM
def test_a_register_fma_loop_is_found_and_counted_exactly(probe):
    found = probe["three_fmas"]
    assert len(found["loops"]) == 1
    loop = found["loops"][0]
    assert loop["mix"]["FFMA"] == 3 and loop["mix"]["LDL/STL"] == 0 and loop["mix"]["LDS/STS"] == 0
    assert [h["start"] for h in found["hot_loops"]] == [loop["start"]] and found["hot_loops"][0]["opcodes"]["FFMA"] == 3
    assert found["spill_stores"] == found["spill_loads"] == 0


@NEEDS_NVDISASM
def test_a_local_array_read_is_one_ldl_per_iteration(probe):
    assert len(probe["reads_a_local_array"]["loops"]) == 1
    (loop,) = probe["reads_a_local_array"]["hot_loops"]
    assert loop["mix"]["FFMA"] == 1 and loop["mix"]["LDL/STL"] == 1 and loop["opcodes"].get("LDL") == 1


@NEEDS_NVDISASM
def test_spills_are_reported(probe):
    free, capped = probe["many_live_values"], probe["many_live_values_capped"]
    assert free["spill_stores"] == 0 and free["registers"] > 24
    assert capped["registers"] <= 24 and capped["spill_stores"] > 0 and capped["spill_loads"] > 0
    assert capped["hot_loops"][0]["mix"]["LDL/STL"] > 0  # the spills land in the loop


@NEEDS_NVDISASM
def test_the_profiled_sass_is_what_a_launch_links(probe):
    assert probe["same_sass_as_numba_launch_path"] is True


@pytest.mark.slow  # two v2 compiles, about 20 s
@NEEDS_NVDISASM
def test_the_v2_tile_loads_of_a_contiguous_operand_are_global_loads_at_immediate_offsets():
    """v2's tile loop (d = 64, float32) loads K_j along rows and V_j down columns: compiled for C-contiguous
    inputs, all 32 of a thread's loads are LDG off two address registers, one per tile, each load an immediate
    offset (kernels.tile_loads.rows_from); compiled for strided views, V's column view takes a run-time stride and
    the loads spread over many address registers (generic LD: what the contiguous build did until 2026-12-05)."""
    done = subprocess.run([sys.executable, str(HERE / "tile_loads.py")], env=REAL_CUDA, capture_output=True,
                          text=True, timeout=900, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout)
    contiguous = found["contiguous"]
    assert (contiguous["loads"], contiguous["generic"], len(contiguous["bases"])) == (32, 0, 2), found
    assert found["strided"]["loads"] == 32 and len(found["strided"]["bases"]) > 2, found


@pytest.mark.slow  # one bwd-kv compile, about 20 s
@NEEDS_NVDISASM
def test_the_backward_visit_loads_its_tiles_at_immediate_offsets():
    """bwd-kv's visit loop (d = 64, float32, 64 threads): Q_i's and dO_i's 32 elements a thread each, LSE_i and
    D_i, all LDG in the loop itself (their chunks written out, no loop of their own) off at most three address
    registers (kernels.tile_loads.row_tile_loader; until 2026-12-05 a loop over chunks held 24 of them, with a
    division and a 4-d index per element), and its 32 atomic adds into dQ. The other registers' counts are the
    compiler's; these are the loaders' shape."""
    done = subprocess.run([sys.executable, str(HERE / "tile_loads.py"), "backward"], env=REAL_CUDA,
                          capture_output=True, text=True, timeout=900, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout)
    assert (found["loads"], found["generic"], found["nested_loads"], found["adds"]) == (2 * 32 + 2, 0, 0, 32), found
    assert len(found["bases"]) <= 3, found


# One configuration per registered kernel for the slow tier's live compile, each the one most likely to break
# what the SASS tests check (spills, float64, the 48 KB shared-memory budget): its kernel's largest register
# count or shared memory in the committed table (benchmarks/results/sass_table_sm90a.json). Together they cover
# every head dim, dtype and causal setting (the profile's masked form: PARTIAL tiles masked in the kernel),
# which test_the_representatives_cover_every_kernel_and_setting checks against profile.configurations().
REPRESENTATIVES = [
    (dict(variant="v1", head_dim=128, dtype="float16", causal=False),
     "v1's most registers (175) and the full 48 KB of shared memory; the float16 loads of the tile engine"),
    (dict(variant="v2", head_dim=128, dtype="float32", causal=True),
     "v2's most registers (133) at 48 KB of shared memory; the causal mask of PARTIAL tiles on the tile engine"),
    (dict(variant="v1-rowwise", head_dim=256, dtype="float16", causal=False),
     "the largest per-thread local arrays (2112-byte stack) and shared memory (32 KB) of v1-rowwise; float16"),
    (dict(variant="v2-rowwise", head_dim=256, dtype="float32", causal=True),
     "the largest local arrays and shared memory of v2-rowwise, with its causal mask"),
    (dict(variant="v1-mma", head_dim=128, dtype="float16", causal=True),
     "the tensor-core v1 at its most registers (255, no spill) and shared memory (34 KB), causal: its exact P V path"),
    (dict(variant="v2-mma", head_dim=64, dtype="float16", causal=False),
     "the tensor-core v2 on FULL tiles only: no exact path, the fragment loops unrolled (the estimate's case)"),
    (dict(variant="bwd-kv", head_dim=64, dtype="float32", causal=True),
     "the backward's largest shared memory (44.3 KB, d = 64 tiles) and most registers (250), causal, dQ by atomics"),
    (dict(variant="bwd-kv-det", head_dim=64, dtype="float32", causal=False),
     "the deterministic K/V pass at its largest shared memory, FULL tiles only (168 registers; 221 causal)"),
    (dict(variant="bwd-q-dq", head_dim=64, dtype="float32", causal=True),
     "the dQ-only pass of deterministic=True at its largest shared memory (128 registers), causal"),
    (dict(variant="bwd-q", head_dim=256, dtype="float32", causal=True),
     "the q order at its smallest tile (8 x 8, d = 256), causal (255 registers before its loads and adds went to "
     "compile-time offsets, 128 since)"),
    (dict(variant="bwd-kv-mma", head_dim=128, dtype="float16", causal=True),
     "the tensor-core kv backward at 254 registers and its largest shared memory (46 KB), causal: its exact path"),
    (dict(variant="bwd-kv-mma-det", head_dim=64, dtype="float16", causal=False),
     "the tensor-core kv pass of deterministic=True: no dQ, no atomics, FULL tiles only"),
    (dict(variant="bwd-dq-mma", head_dim=128, dtype="float16", causal=True),
     "the tensor-core dQ pass at 255 registers, causal: where it would spill first"),
]

def _representative_configurations():
    """The configurations of profile.configurations() that REPRESENTATIVES name, in REPRESENTATIVES' order."""
    configs = list(profile.configurations())
    chosen = []
    for wanted, _ in REPRESENTATIVES:
        matches = [c for c in configs if all(c.get(k) == v for k, v in wanted.items())]
        assert matches, f"no shipped configuration is {wanted}: update REPRESENTATIVES"
        chosen.append(matches[0])
    return chosen


def _say(pytestconfig, line):
    """Write a line to the terminal past pytest's output capture, so a long compile is not silent."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    reporter = pytestconfig.pluginmanager.getplugin("terminalreporter")
    with capture.global_and_fixture_disabled():
        if reporter is not None:
            reporter.write_line(line)
        else:
            sys.stderr.write(line + "\n")


def _compile(pytestconfig, argv, timeout):
    """Run `python argv...` with the real numba.cuda, echo its progress lines (stderr) to the terminal as they
    come, and return (exit code, stdout, stderr)."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, *argv], env=REAL_CUDA, stdout=out, stderr=subprocess.PIPE,
                                text=True, cwd=HERE.parent)
        timer = threading.Timer(timeout, proc.kill)  # a hung compile fails the test instead of the whole run
        timer.start()
        errors = []
        try:
            for line in proc.stderr:
                errors.append(line)
                if line.startswith("["):  # "[i/N] variant d=... (s)": one per configuration compiled
                    # the first starts a line of its own: pytest's row of dots has no newline yet
                    _say(pytestconfig, ("\n" if line.startswith("[1/") else "") + f"sm_90a profile {line.rstrip()}")
            code = proc.wait()
        finally:
            timer.cancel()
        out.seek(0)
        return code, out.read(), "".join(errors)


def _committed() -> dict:
    return json.loads(profile.SHIPPED_TABLE.read_text())


# The 3xTF32 family (float32 on tensor cores) is not among REPRESENTATIVES' dtypes of their kernels: its
# cheapest build joins the slow tier's live compile, so every kernel family and dtype class is compiled there.
LIVE_EXTRAS = [dict(variant="bwd-kv-mma", head_dim=64, dtype="float32", causal=False)]


@pytest.fixture(scope="module")
def representatives(pytestconfig):
    """REPRESENTATIVES and LIVE_EXTRAS compiled now, in a process with the real numba.cuda (two at a time)."""
    configs = [c for c in list(profile.configurations())
               if any(all(c.get(k) == v for k, v in want.items()) for want in
                      [w for w, _ in REPRESENTATIVES] + LIVE_EXTRAS)]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, str(HERE / "profile_configs.py"), json.dumps(configs)],
                                env=REAL_CUDA, stdout=out, stderr=subprocess.PIPE, text=True, cwd=HERE.parent)
        errors = []
        timer = threading.Timer(3600, proc.kill)  # a hung compile fails the test instead of the whole run
        timer.start()
        try:
            for line in proc.stderr:
                errors.append(line)
                if line.startswith("["):
                    _say(pytestconfig, ("\n" if line.startswith("[1/") else "") + f"sm_90a profile {line.rstrip()}")
            code = proc.wait()
        finally:
            timer.cancel()
        assert code == 0, "".join(errors)[-4000:]
        out.seek(0)
        return configs, json.loads(out.read())


def _assert_sound(profiles):
    """What every compiled configuration must show: registers read back, no spills, no float64 instruction,
    shared memory within the static budget, a positive occupancy, and hot loops found (a tensor-core kernel:
    HMMA in its tile loop; the non-causal kv backward on tensor cores has no FFMA loop at all)."""
    assert profiles
    for p in profiles:
        c = p["config"]
        label = f"{c['variant']} d={c['head_dim']} {c['dtype']} causal={c['causal']}"
        assert p["registers"] is not None and 0 < p["registers"] <= 255, label
        assert p["spill_stores"] == 0 and p["spill_loads"] == 0, label
        assert p["float64"] == [], label
        assert 0 < p["smem"] <= SHARED_BYTES_LIMIT, label
        assert p["occupancy"]["warps_per_sm"] > 0, label
        if c["variant"] in whole_kernel.MMA_KERNELS:  # products on tensor cores: HMMA in a loop, not FFMA loops
            assert p["counts"].get("hmma", 0) > 0, label
        else:
            assert p["hot_loops"], label


def test_the_representatives_cover_every_kernel_and_setting():
    """One representative per registered kernel, each a real configuration, together taking every value each
    setting (head dim, dtype, causal, and any setting a configuration gains later) takes in the whole table."""
    chosen = _representative_configurations()
    assert [c["variant"] for c in chosen] == profile.kernel_names(), \
        "REPRESENTATIVES needs one configuration (and its reason) per registered kernel, in registry order"
    assert all(reason for _, reason in REPRESENTATIVES)
    configs = list(profile.configurations())
    for key in configs[0]:
        if key in ("variant", "block_q", "block_k"):  # the kernels are covered above; tiles follow the head dim
            continue
        assert {c[key] for c in chosen} == {c[key] for c in configs}, f"no representative has every {key}"


def test_a_value_head_dim_is_profiled_on_the_kernels_that_take_it_natively():
    """--value-dim: the configurations of every head dim other than d_v carry it, for the kernels that take it
    natively (the tile engine's forwards, every CUDA-core backward, the 16-bit tensor-core kernels) at the
    tiles of the wider head dim; the rowwise forwards and 3xTF32 pad (a configuration of max(d, d_v) is theirs)."""
    from fa_numba.kernels import backward, default_tiles
    from fa_numba.kernels.mma.backward import default_tiles as mma_backward_tiles

    configs = list(profile.configurations(head_dims=(64, 128), value_dim=128))
    own = [c for c in configs if "value_dim" in c]
    assert {c["head_dim"] for c in own} == {64} and {c["value_dim"] for c in own} == {128}
    assert {c["variant"] for c in own} == set(profile.NATIVE_VALUE_DIM)
    assert not any(c["dtype"] == "float32" for c in own if c["variant"] in whole_kernel.MMA_KERNELS)
    assert not any(c["variant"].endswith("rowwise") and c["head_dim"] == 64 for c in configs)
    for c in own:  # the tiles of d = 128, as the call takes them
        if c["variant"] in ("v1", "v2"):
            assert (c["block_q"], c["block_k"]) == default_tiles(128)
        elif c["variant"] in backward.VARIANTS:
            assert c["block_q"] == backward.default_backward_tiles(128)[0]
        elif c["variant"] == "bwd-kv-mma":
            assert (c["block_q"], c["block_k"]) == mma_backward_tiles("kv", 128)[1:]
    plain = [c for c in configs if c["head_dim"] == 128]  # d = d_v: the shipped configurations, unchanged
    assert plain == [c for c in profile.configurations(head_dims=(128,))]


def test_the_committed_sass_table_was_made_from_todays_kernel_sources():
    """benchmarks/results/sass_table_sm90a.json carries the digest of the sources it was compiled from: a
    change to a kernel (or to any module a kernel build imports) fails here until the table is made again."""
    assert _committed()["sources"] == sources.kernel_digest(), (
        "the kernel sources changed since the committed SASS table was made: run `python -m fa_numba profile "
        f"--no-estimate --json {profile.SHIPPED_TABLE.relative_to(HERE.parent)}` (docs/testing.md gives its time) "
        "and commit the table")


def test_every_shipped_configuration_is_in_the_committed_table():
    table = _committed()
    configs = list(profile.configurations())
    heads = len(profile.SHIPPED_HEAD_DIMS)
    # CUDA-core forwards at both dtypes, tensor-core ones at d <= 128 only (the forwards at float16, and float32 by
    # 3xTF32 non-causal only, the backward's at float16, and its atomic kv kernel at float32 by 3xTF32), the
    # CUDA-core backward at float32; each causal or not
    mma_heads = sum(d <= 128 for d in profile.SHIPPED_HEAD_DIMS)
    expected = ((len(SIMT_VARIANTS) * 2 * heads + len(whole_kernel.MMA_KERNELS) * mma_heads
                 + len(backward.VARIANTS) * heads + mma_heads) * 2
                + len(whole_kernel.MMA_VARIANTS) * mma_heads)  # float32 tensor-core forwards: non-causal only
    assert len(table["profiles"]) == len(configs) == expected
    for p, cfg in zip(table["profiles"], configs):  # each with its own keys (row_blocks where a warp owns two)
        assert {k: p["config"][k] for k in cfg} == cfg and p["config"].get("row_blocks", 1) == cfg.get("row_blocks", 1)


def test_no_committed_configuration_spills_uses_float64_or_exceeds_the_shared_budget():
    _assert_sound(_committed()["profiles"])


@pytest.mark.slow
@NEEDS_NVDISASM
def test_representative_configurations_compile_as_the_committed_table_says(representatives):
    """REPRESENTATIVES (one per kernel, each at its extreme) and a 3xTF32 build, compiled here: sound, and,
    under the numba-cuda version the table was made with, the table's registers, spills, stack and shared memory
    (the digest test guards the sources; this one the toolchain and the table's making)."""
    configs, live = representatives
    assert len(live) == len(REPRESENTATIVES) + len(LIVE_EXTRAS)
    _assert_sound(live)
    table = _committed()
    if table["numba_cuda"] != profile._numba_cuda_version():
        return  # another compiler: the soundness above is what holds across versions
    keys = ("registers", "spill_stores", "spill_loads", "stack", "smem")
    for cfg, p in zip(configs, live):
        (entry,) = [e for e in table["profiles"] if all(e["config"][k] == v for k, v in cfg.items())]
        assert {k: p[k] for k in keys} == {k: entry[k] for k in keys}, cfg


@pytest.mark.slow
@NEEDS_NVDISASM
def test_the_whole_kernel_estimate_is_below_the_hot_loop_bound_and_names_its_limiter(tmp_path, pytestconfig):
    """`profile` with the estimate, for v2 and bwd-kv at d = 64 (their SASS, and one block of each traced in
    the simulator): every figure positive, under the hot-loop bound (it adds the work that bound leaves out),
    a limiter of the model's, and the counts it rests on: two products for v2, five for bwd-kv."""
    from fa_numba.cycle_model import LIMITERS

    path = tmp_path / "estimate.json"
    argv = ["-m", "fa_numba.profile", "--orders", "v2,bwd-kv", "--head-dims", "64", "--dtypes", "float32",
            "--causal", "off", "--json", str(path)]
    code, table, errors = _compile(pytestconfig, argv, timeout=1800)
    assert code == 0, errors[-4000:]
    assert "estimate TFLOP/s" in table
    for p in json.loads(path.read_text())["profiles"]:
        est = p["estimate"]
        assert 0 < est["tflops"] < p["bound"]["tflops"], p["name"]
        assert est["limiter"] in LIMITERS and est["wavefronts"] > 0, p["name"]
        assert round(p["counts"]["products"]) == {"v2": 2, "bwd-kv": 5}[p["name"]]
        assert p["counts"]["unattributed"] == [] and p["counts"]["load_round_trips"] >= 1
    v2 = next(p for p in json.loads(path.read_text())["profiles"] if p["name"] == "v2")
    assert v2["estimate"]["shared_accesses"]["agree"]  # the tracer's widths are the SASS's LDS/STS (1088 each)


@pytest.mark.slow
@NEEDS_NVDISASM
def test_a_value_head_dim_is_estimated_from_its_own_build_and_trace(tmp_path, pytestconfig):
    """`profile --value-dim 32` at d = 64 on tensor cores (float16, non-causal): the table reads d/d_v, the SASS
    is the d_v build's (v2-mma's 64 x 64 tile per warp: S, B_c / 8 x d / 16 = 32 HMMA, and P V, B_c / 16 x d_v / 8
    = 16: 48, i.e. 1 + 32 / 64 products of B_r B_c d; the kv backward's 3 + 2 x 32 / 64 = 4), the wavefronts traced
    on a d_v build (their cache key carries it) and the estimate is there, under the dense peak."""
    from fa_numba.machine import H200

    path = tmp_path / "value_dim.json"
    argv = ["-m", "fa_numba.profile", "--orders", "v2-mma,bwd-kv-mma", "--head-dims", "64", "--value-dim", "32",
            "--dtypes", "float16", "--causal", "off", "--json", str(path)]
    code, table, errors = _compile(pytestconfig, argv, timeout=1800)
    assert code == 0, errors[-4000:]
    assert table.count(" 64/32 ") == 2
    v2, kv = sorted(json.loads(path.read_text())["profiles"], key=lambda p: p["name"] != "v2-mma")
    assert v2["config"]["value_dim"] == kv["config"]["value_dim"] == 32
    assert v2["config"]["row_blocks"] == 2  # 128 rows, two row blocks a warp: twice the HMMA of one
    assert v2["counts"]["hmma"] == 2 * 48 and v2["counts"]["products"] == 1.5 and v2["counts"]["value_ratio"] == 0.5
    assert kv["counts"]["products"] == 4.0 and kv["counts"]["unattributed"] == []
    for p in (v2, kv):
        assert p["spill_stores"] == p["spill_loads"] == 0
        assert 0 < p["estimate"]["tflops"] < H200.peak_tensor_tflops, p["estimate"]


def test_tf32_is_asked_for_by_name_and_builds_the_tensor_core_forwards_only():
    """"tf32" (engine="mma-tf32") is never in the shipped table; asked for, it is the two tensor-core forwards,
    non-causal, at the float32 kinds' tiles (block_k half the 16-bit one: each element staged as 4 bytes; v2's
    block_q 128, 8 warps of one row block sharing a staged tile, v1's 64), d <= 128, and its HMMA covers one
    m16n8k8 product's multiply-adds (3xTF32's covers a third)."""
    assert all(c["dtype"] != "tf32" for c in profile.configurations())
    asked = list(profile.configurations(dtypes=("tf32",)))
    assert {(c["variant"], c["head_dim"], c["causal"]) for c in asked} == {
        (name, d, False) for name in whole_kernel.MMA_VARIANTS for d in (64, 128)}
    for cfg in asked:
        sixteen = next(profile.configurations([cfg["variant"]], [cfg["head_dim"]], ["float16"], [False]))
        assert cfg["block_k"] * 2 == sixteen["block_k"] and "row_blocks" not in cfg
        assert cfg["block_q"] == (128 if cfg["variant"] == "v2-mma" else 64)
    assert whole_kernel.USEFUL_MACS["tf32"] == 3 * whole_kernel.USEFUL_MACS["float32"] == 16 * 8 * 8
    assert whole_kernel.MMA_SHAPE["tf32"] == whole_kernel.MMA_SHAPE["float32"] == "m16n8k8"


def test_bfloat16_is_asked_for_by_name_and_builds_every_tensor_core_kernel_at_float16s_tiles():
    """"bfloat16" is never in the shipped table; asked for, it is every tensor-core kernel (forwards and backward),
    causal or not, at the head dims and tiles of its float16 build (the same code, the bf16 mma and pack)."""
    assert all(c["dtype"] != "bfloat16" for c in profile.configurations())
    asked = list(profile.configurations(dtypes=("bfloat16",)))
    sixteen = list(profile.configurations(orders=whole_kernel.MMA_KERNELS, dtypes=("float16",)))
    assert [dict(c, dtype="float16") for c in asked] == sixteen
    assert {c["variant"] for c in asked} == set(whole_kernel.MMA_KERNELS) and {c["causal"] for c in asked} == {
        False, True}
    assert whole_kernel.USEFUL_MACS["bfloat16"] == whole_kernel.USEFUL_MACS["float16"]


def test_cli_forwards_profile_and_names_bad_arguments(capsys):
    from fa_numba import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["profile", "--dtypes", "float64"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--dtypes" in err and "tf32" in err  # the message lists the opt-in dtype too


@pytest.mark.slow
@NEEDS_NVDISASM
def test_the_tensor_core_v2_gets_an_estimate_from_its_hmma_and_traced_ldmatrix(tmp_path, pytestconfig):
    """`profile` of v2-mma at d = 64, float16, non-causal (its SASS, and one block traced in the simulator): the
    tile loop has no inner loop, its 128 HMMA per warp are exactly the two products of its two row blocks (each
    S: B_c / 8 x d / 16 = 32, P V: B_c / 16 x d / 8 = 32), K's and V's copies are two waits, each covered by a share of the body
    (FlashAttention-2's order: V_j's by S, K_j+1's by the softmax and P V), the traced shared accesses are the
    SASS's LDSM + LDGSTS, and the estimate is positive, under the tensor peak, with a limiter of the model's;
    the causal kernel (its PARTIAL tiles' loops have no trip-count rule) is priced by its own dependence walk,
    those loops left out and named, at no more than about the non-causal rate."""
    from fa_numba.cycle_model import LIMITERS
    from fa_numba.machine import H200

    path = tmp_path / "mma.json"
    argv = ["-m", "fa_numba.profile", "--orders", "v2-mma", "--head-dims", "64", "--dtypes", "float16",
            "--causal", "both", "--json", str(path)]
    code, table, errors = _compile(pytestconfig, argv, timeout=1800)
    assert code == 0, errors[-4000:]
    plain, causal = sorted(json.loads(path.read_text())["profiles"], key=lambda p: p["config"]["causal"])
    counts, est = plain["counts"], plain["estimate"]
    assert plain["config"]["row_blocks"] == causal["config"]["row_blocks"] == 2  # 128 rows, 32 a warp
    assert counts["hmma"] == 2 * 64 and counts["products"] == 2 and counts["unattributed"] == []
    assert counts["load_round_trips"] == 2 and all(0.2 < c < 0.6 for c in counts["copy_covers"])
    assert est["shared_accesses"]["agree"] and est["limiter"] in LIMITERS
    assert 0 < est["tflops"] < H200.peak_tensor_tflops and est["cycles"]["tensor"] > 0
    assert "withheld" not in causal["estimate"] and "counts_from" not in causal["estimate"]
    assert causal["counts"]["walk"]["left_out"]  # the PARTIAL tiles' loops, left out of its own walk
    assert 0 < causal["estimate"]["tflops"] <= est["tflops"] * 1.05  # the causal launch: fewer tiles per block
    # two row blocks a warp take 238 (255 causal) registers: 2 blocks of 4 warps an SM, no spills
    assert causal["occupancy"]["blocks_per_sm"] == 2 == plain["occupancy"]["blocks_per_sm"]
    assert causal["spill_stores"] == causal["spill_loads"] == causal["stack"] == 0


@pytest.mark.slow
@NEEDS_NVDISASM
def test_the_uncapped_causal_d96_build_and_the_strided_one_have_no_spills(tmp_path, pytestconfig):
    """v2-mma causal at d = 96 (64 x 32 tiles), bfloat16, left to the compiler (at a cap of 168 it spills: not in
    MmaV2Kernel.REGISTER_CAPS): no spills, no stack, 2 blocks of 4 warps an SM; and the strided build of d = 64 at
    one row block a warp, which the cap leaves out, without spills."""
    path = tmp_path / "capped.json"
    argv = ["-m", "fa_numba.profile", "--orders", "v2-mma", "--head-dims", "96", "--dtypes", "bfloat16",
            "--causal", "on", "--no-estimate", "--json", str(path)]
    code, table, errors = _compile(pytestconfig, argv, timeout=1800)
    assert code == 0, errors[-4000:]
    (p,) = json.loads(path.read_text())["profiles"]
    assert p["occupancy"]["blocks_per_sm"] >= 2
    assert p["spill_stores"] == p["spill_loads"] == p["stack"] == 0
    # strided views take the uncapped build (MmaKernel.kernel_for_views); d = 64's default is two row blocks a
    # warp, uncapped anyway: 2 blocks an SM, no spills
    argv = ["-m", "fa_numba.profile", "--orders", "v2-mma", "--head-dims", "64", "--dtypes", "float16",
            "--causal", "on", "--strided", "--no-estimate", "--json", str(path)]
    code, table, errors = _compile(pytestconfig, argv, timeout=1800)
    assert code == 0, errors[-4000:]
    (p,) = json.loads(path.read_text())["profiles"]
    assert p["config"]["row_blocks"] == 2
    assert p["spill_stores"] == p["spill_loads"] == p["stack"] == 0 and p["occupancy"]["blocks_per_sm"] == 2


@pytest.mark.slow
@NEEDS_NVDISASM
def test_the_tensor_core_backward_gets_an_estimate_with_its_rolled_dq_loop_counted(tmp_path, pytestconfig):
    """`profile` of bwd-kv-mma and bwd-dq-mma at d = 64, float16, non-causal (their SASS, one block of each
    traced in the simulator): kv's visit holds S^T, dP^T, dV and dK unrolled (4 x 16 HMMA per warp at B_r = 32)
    and dQ's column-block loop, rolled, whose 4 trips (the layout's DN / SPLIT) complete the 5th product: 80
    HMMA, 5 products; dq's key-tile loop 96 HMMA, 3 products; each estimate positive, under the tensor peak."""
    from fa_numba.cycle_model import LIMITERS
    from fa_numba.machine import H200

    path = tmp_path / "mma_bwd.json"
    argv = ["-m", "fa_numba.profile", "--orders", "bwd-kv-mma,bwd-dq-mma", "--head-dims", "64", "--dtypes",
            "float16", "--causal", "off", "--json", str(path)]
    code, table, errors = _compile(pytestconfig, argv, timeout=1800)
    assert code == 0, errors[-4000:]
    kv, dq = json.loads(path.read_text())["profiles"]
    assert kv["counts"]["hmma"] == 80 and kv["counts"]["products"] == 5 and kv["counts"]["unattributed"] == []
    assert dq["counts"]["hmma"] == 96 and dq["counts"]["products"] == 3 and dq["counts"]["unattributed"] == []
    for prof in (kv, dq):
        est = prof["estimate"]
        assert est["limiter"] in LIMITERS and 0 < est["tflops"] < H200.peak_tensor_tflops, est
