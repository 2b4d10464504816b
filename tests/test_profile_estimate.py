"""profile_estimate.attach_estimates on made-up profiles (no compiler): a causal tensor-core build, whose own
counts price no iteration, is priced by the non-causal build's FULL-tile counts with its own occupancy and the
causal launch; without that build in the run it stays withheld."""

import json
from types import SimpleNamespace

import pytest

from fa_numba import cycle_model, profile_estimate, whole_kernel
from fa_numba.machine import H200

LAUNCH = {"batch": 4, "heads": 16, "n": 4096}
COUNTS = {"instructions": 600.0, "mufu": 40.0, "load_round_trips": 1.0, "pipelined_waits": 0.0, "hmma": 64.0,
          "products": 2.0, "unattributed": [], "shared_accesses": {"LDSM": 96, "LDGSTS": 8}, "ffma": 0.0}


def made_up(causal: bool, counts: dict, blocks_per_sm: int):
    config = {"variant": "v2-mma", "block_q": 64, "block_k": 64, "head_dim": 64, "dtype": "float16",
              "causal": causal, "launch": {"grid": [64, 64], "block": [128]}}
    return SimpleNamespace(config=config, counts=counts, threads=128, estimate=None,
                           occupancy={"blocks_per_sm": blocks_per_sm, "warps_per_sm": 4 * blocks_per_sm})


def wavefronts():
    key = json.dumps(profile_estimate._traced_config(made_up(False, COUNTS, 3).config), sort_keys=True)
    return {key: {"total": {"wavefronts": 640.0, "accesses": 104 * 4}}}


def test_a_causal_build_is_priced_by_the_full_tile_counts_with_its_own_occupancy_and_launch():
    causal_counts = {**COUNTS, "unattributed": ["0x1000-0x1400"], "instructions": 9999.0}  # its exact path
    plain, causal = made_up(False, COUNTS, 3), made_up(True, causal_counts, 2)
    profile_estimate.attach_estimates([plain, causal], wavefronts(), LAUNCH)
    assert "counts_from" in causal.estimate and "counts_from" not in plain.estimate
    # by hand: the same iteration (600 instructions x 4 warps ...) at the causal build's 2 blocks per SM, over
    # the causal launch's iterations (about half the tiles) and flops (half)
    cost = cycle_model.IterationCost(warp_instructions=600 * 4, mufu=40 * 4, wavefronts=640.0, load_round_trips=1.0,
                                     flops=0.0, tensor_cycles=64 * 4 * H200.mma_cycles("m16n8k16"))
    iterations = whole_kernel.iterations_per_block(causal.config, 64, 4096, 4096)
    assert iterations < 64 * 0.52  # causal: about half of the 64 key tiles a query tile has
    run = cycle_model.Launch(blocks=64 * 64, warps_per_block=4, blocks_per_sm=2, iterations_per_block=iterations,
                             hbm_bytes=0)
    assert causal.estimate["seconds"] == pytest.approx(cycle_model.estimate(cost, run).seconds, rel=1e-6)
    assert causal.estimate["shared_accesses"]["agree"]


def test_a_causal_build_without_its_non_causal_sibling_stays_withheld():
    causal = made_up(True, {**COUNTS, "unattributed": ["0x1000-0x1400"]}, 2)
    profile_estimate.attach_estimates([causal], wavefronts(), LAUNCH)
    assert "tflops" not in causal.estimate and "trip-count rule" in causal.estimate["withheld"]


@pytest.mark.slow  # 17 s: two simulator processes of their own, beside the default tier's two workers
def test_tracing_is_dealt_among_processes_and_gives_what_one_process_gives(tmp_path, monkeypatch):
    """start_wavefronts(configs, jobs=2) traces two configurations in two simulator processes (a backward
    kernel's trace takes many minutes on one core); finish_wavefronts merges them into what one process gives,
    and caches them: a second start finds everything known and starts none."""
    small = [dict(variant="v2", block_q=16, block_k=32, head_dim=16, dtype="float32", causal=False),
             dict(variant="v1", block_q=16, block_k=32, head_dim=16, dtype="float32", causal=True)]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "two"))
    known, procs = profile_estimate.start_wavefronts(small, jobs=2)
    assert known == {} and len(procs) == 2
    two = profile_estimate.finish_wavefronts((known, procs))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "one"))
    one = profile_estimate.finish_wavefronts(profile_estimate.start_wavefronts(small, jobs=1))
    assert sorted(two) == sorted(one) == sorted(json.dumps(profile_estimate._traced_config(c), sort_keys=True)
                                                for c in small)
    assert all(two[k]["total"] == one[k]["total"] and two[k]["total"]["wavefronts"] > 0 for k in one)
    assert profile_estimate.start_wavefronts(small, jobs=2) == (one, [])  # cached: nothing to trace


def test_a_configuration_with_a_micro_tile_of_its_own_is_priced_by_its_own_trace():
    """A configuration that names its micro-tile (decode_estimate's layouts, an exploration of v2's) is traced at
    that layout, so its estimate reads that trace, never the default layout's nor "no wavefronts traced"."""
    own = made_up(False, COUNTS, 3)
    own.config = {**own.config, "micro": [4, 2]}
    key = json.dumps(profile_estimate._traced_config(own.config), sort_keys=True)
    assert key not in wavefronts()  # the default layout's trace is another one
    profile_estimate.attach_estimates([own], {key: {"total": {"wavefronts": 320.0, "accesses": 104 * 4}}}, LAUNCH)
    plain = made_up(False, COUNTS, 3)
    profile_estimate.attach_estimates([plain], wavefronts(), LAUNCH)
    assert "tflops" in own.estimate and own.estimate["wavefronts"] == 320.0 and plain.estimate["wavefronts"] == 640.0
