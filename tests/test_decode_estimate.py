"""The decode estimate: its arithmetic on probes with known answers, then the compiled split kernel's counts."""

import os
import subprocess
import sys

import pytest

from fa_numba import decode_estimate, iomodel, profile
from fa_numba.kernels import decode as kernels
from fa_numba.machine import H200

NEEDS_NVDISASM = pytest.mark.skipif(
    profile.nvdisasm_path() is None, reason="nvdisasm is missing: install the profile extra (pip install -e '.[profile]')")


def probe(instructions=0.0, wavefronts=0.0, round_trips=0.0, blocks_per_sm=6):
    """A made-up compiled split kernel with the given per-iteration costs (no compiler involved)."""
    layout = kernels.decode_layout(4, 128)
    counts = dict(instructions=instructions, mufu=0.0, load_round_trips=round_trips, ffma=0.0, products=2.0,
                  unattributed=[], shared_accesses={})
    cfg = dict(variant="decode", block_q=layout.block_q, block_k=layout.block_k, head_dim=128, dtype="float16",
               causal=False)
    return dict(cfg=cfg, layout=layout, counts=counts, wavefronts=wavefronts, agree=True, registers=64,
                occupancy={"blocks_per_sm": blocks_per_sm, "limiter": "shared memory"})


def test_a_kernel_that_costs_nothing_on_chip_runs_at_the_hbm_bound():
    row = decode_estimate.estimate_shape(probe(), 1, 32768, 32, 8, 1, None)
    assert row["hbm_fraction"] == pytest.approx(1.0)
    ledger = iomodel.traffic_decode([32768], 1, 128, 4, 32, -(-1024 // row["splits"]), row["splits"], True, 32, 8)
    assert row["bytes"] == iomodel.total_bytes(ledger, 2)  # every byte both kernels move, K and V once
    assert row["seconds"] == pytest.approx(row["bytes"] / H200.hbm_bytes_per_s)


def mma_probe(instructions=0.0, pipelined_waits=1.0, blocks_per_sm=5):
    """A made-up tensor-core split kernel: one warp, B_c = 32, a pipelined wait an iteration."""
    from fa_numba.kernels.mma import decode as mma_decode

    layout = mma_decode.decode_split("float16", 4, 128)
    counts = dict(instructions=instructions, mufu=0.0, load_round_trips=0.0, hmma=0.0, products=2.0,
                  pipelined_waits=pipelined_waits, unattributed=[], shared_accesses={})
    cfg = dict(variant="decode-mma", block_q=16, block_k=32, head_dim=128, dtype="float16", causal=False)
    return dict(cfg=cfg, engine="mma", layout=layout, counts=counts, wavefronts=0.0, agree=True, registers=168,
                occupancy={"blocks_per_sm": blocks_per_sm, "limiter": "shared memory"})


def test_a_pipelined_probe_pays_its_latency_once_an_iteration_and_once_more_to_fill():
    """Unsplit (8 blocks, one per K/V head), every iteration of a one-warp block waits an L2 round trip for the
    tile issued an iteration earlier, and the pipeline's fill costs one more: (1024 + 1) x L per block."""
    row = decode_estimate.estimate_shape(mma_probe(), 1, 32768, 32, 8, 1, 1)
    assert row["limiter"] == "latency" and row["blocks"] == 8
    assert row["split_seconds"] == pytest.approx((32768 // 32 + 1) * H200.l2_latency_cycles / H200.cycles_per_s)
    work = decode_estimate.estimate_shape(mma_probe(instructions=2 * H200.l2_latency_cycles), 1, 32768, 32, 8, 1, 1)
    assert work["split_seconds"] == pytest.approx(2 * row["split_seconds"])  # the work, not work + latency


def test_a_latency_bound_probe_takes_its_round_trips():
    """One round trip per iteration of 1e6 cycles: every block's iterations in sequence, the waves in sequence."""
    row = decode_estimate.estimate_shape(probe(round_trips=1e6 / H200.l2_latency_cycles), 1, 32768, 32, 8, 1, 1)
    assert row["limiter"] == "latency" and row["splits"] == 1 and row["blocks"] == 8
    iterations = 32768 // 32  # one split: every key tile in one block
    split_seconds = iterations * (1e6 + 0) / H200.cycles_per_s  # own issue is 0 instructions
    assert row["split_seconds"] == pytest.approx(split_seconds)
    # doubling the latency doubles it
    twice = decode_estimate.estimate_shape(probe(round_trips=1e6 / H200.l2_latency_cycles), 1, 32768, 32, 8, 1, 1,
                                           latency_factor=2.0)
    assert twice["split_seconds"] == pytest.approx(2 * split_seconds)


@pytest.mark.slow
@NEEDS_NVDISASM
def test_the_compiled_split_kernel_counts_two_products_and_agrees_with_the_trace():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    done = subprocess.run([sys.executable, "-m", "fa_numba.decode_estimate", "--batch", "1", "--n-k", "32768"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for head in (line for line in done.stdout.splitlines() if "split kernel:" in line):
        assert "(2.0" in head and "SASS and trace agree: True" in head and "unattributed" not in head
    rows = [line.split() for line in done.stdout.splitlines() if line.strip().startswith("1 ")]
    assert len(rows) == 8  # two engines: split and unsplit, each at two latencies
    for engine in (rows[:4], rows[4:]):
        split, unsplit = [r for r in engine if r[2] != "1"], [r for r in engine if r[2] == "1"]
        assert len(split) == len(unsplit) == 2
        assert all(float(a[4]) < float(b[4]) for a, b in zip(split, unsplit))  # splitting fills the GPU: faster
    heads = [line for line in done.stdout.splitlines() if "split kernel:" in line]
    assert [h.split()[0] for h in heads] == ["simt", "mma"] and "1 pipelined waits" in heads[1]
