"""The schedule and the communication model of ring attention (fa_numba.distributed), beside iomodel's HBM
model: which chunks a rank holds, each chunk pair's kind (L3 on chunks), the bytes each rank sends and
receives per step, forward and backward, and the step time max(compute, transfer). No torch needed.

Per step a rank sends one K/V shard to rank r + 1 and receives one from rank r - 1, concurrently: B H_kv (N / W)
d elements each of K and V at the input's itemsize; the backward's steps carry dK and dV (float32) with them,
and it makes W transfers (the last sends the accumulators home), the forward W - 1. The link: NVIDIA's H200
SXM datasheet gives 900 GB/s of NVLink bandwidth per GPU, counted in both directions together, so a ring step,
which sends and receives at once, moves each way at LINK_BYTES_PER_S = 450 GB/s. Compute per step is the
rank's chunk pairs that step (`distributed.pair_kind`: a diagonal pair costs half) at `tflops` (an argument:
the default is the whole-kernel model's v2 estimate at d = 128, float32, docs/profile.md: **an estimate**).
A step takes max(compute, transfer) when the transfer overlaps the work, as the forward's does; the
backward sends after its work, so its steps take compute + transfer.
"""

from __future__ import annotations

LINK_BYTES_PER_S = 450e9
DEFAULT_TFLOPS = 28.4  # the v2 kernel's whole-kernel estimate at d = 128 (float32, H200): a model, not a timing


LAYOUTS = ("contiguous", "zigzag")
SKIP, FULL, PARTIAL = "skip", "full", "partial"


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunks rank holds, in sequence order: (rank,) or (rank, 2W - 1 - rank)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def pair_kind(i: int, j: int, causal: bool) -> str:
    """L3 on chunks of equal size (N_q = N_k, so bottom-right is top-left): query chunk i, key chunk j."""
    if not causal:
        return FULL
    return SKIP if j > i else PARTIAL if j == i else FULL


def pair_counts(world: int, layout: str, causal: bool) -> list[dict]:
    """Per rank, the (query chunk, key chunk) pairs it computes over the W steps, by kind: what zigzag balances."""
    counts = []
    for rank in range(world):
        seen = {FULL: 0, PARTIAL: 0, SKIP: 0}
        for step in range(world):
            source = (rank - step) % world
            for i in chunk_ids(rank, world, layout):
                for j in chunk_ids(source, world, layout):
                    seen[pair_kind(i, j, causal)] += 1
        counts.append(seen)
    return counts


def ring_steps(world: int, n: int, d: int, *, batch: int = 1, heads: int = 1, heads_kv: int | None = None,
               itemsize: int = 2, layout: str = "zigzag", causal: bool = True, tflops: float = DEFAULT_TFLOPS,
               link_bytes_per_s: float = LINK_BYTES_PER_S, mask=None) -> list[dict]:
    """Per step, the slowest rank's compute (s), the bytes every rank sends (= receives), the transfer time and
    the step time, forward and backward (the backward's pairs cost 2.5 forward ones: its five products). mask: an
    interval mask over the global sequence (not with causal), as ring_attention takes it: a chunk pair then costs
    its share of visible pairs (0 for a pair the mask empties, which is never computed; its K/V still travel)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    heads_kv = heads if heads_kv is None else heads_kv
    count = world * len(chunk_ids(0, 1, layout))
    if n % count:
        raise ValueError(f"n must be divisible by {count} chunks for layout {layout!r} on {world} ranks, got {n}")
    c = n // count
    pair_flops = 4 * batch * heads * c * c * d  # S = Q K^T and P V, 2 flops per multiply-add
    share = _mask_shares(mask, n, c, count) if mask is not None else None
    shard = batch * heads_kv * (n // world) * d
    steps = []
    for step in range(world):
        work = []
        for rank in range(world):
            source = (rank - step) % world
            if share is not None:
                work.append(sum(share[i, j] for i in chunk_ids(rank, world, layout)
                                for j in chunk_ids(source, world, layout)))
                continue
            kinds = [pair_kind(i, j, causal) for i in chunk_ids(rank, world, layout)
                     for j in chunk_ids(source, world, layout)]
            work.append(sum(0.5 if k == PARTIAL else 0.0 if k == SKIP else 1.0 for k in kinds))
        compute = max(work) * pair_flops / (tflops * 1e12)
        sent_fwd = 2 * shard * itemsize if step < world - 1 else 0
        sent_bwd = 2 * shard * itemsize + 2 * shard * 4
        t_fwd, t_bwd = sent_fwd / link_bytes_per_s, sent_bwd / link_bytes_per_s
        steps.append(dict(step=step, pairs=max(work), compute_s=compute, forward_bytes=sent_fwd,
                          forward_s=max(compute, t_fwd), backward_bytes=sent_bwd,
                          backward_s=2.5 * compute + t_bwd, transfer_fwd_s=t_fwd, transfer_bwd_s=t_bwd))
    return steps


def _mask_shares(mask, n: int, c: int, count: int):
    """(count, count): the share of chunk pair (i, j)'s c x c pairs the mask makes visible, from its row
    intervals over the global sequence (ValueError for a mask without them)."""
    import numpy as np

    mask.check(n, n)
    intervals = mask.row_intervals(n, n)
    if intervals is None:
        raise ValueError(f"mask must be one whose rows each see one interval, got {mask!r}")
    lo, hi = (x.astype(np.int64).reshape(count, c, 1) for x in intervals)
    starts = np.arange(count, dtype=np.int64) * c
    seen = np.clip(np.minimum(hi, starts + c) - np.maximum(lo, starts), 0, None)  # (count, c rows, count)
    return seen.sum(axis=1) / (c * c)


def render(steps: list[dict], title: str) -> str:
    lines = [title, f"{'step':>4} {'pairs':>6} {'compute us':>10} {'fwd MiB':>8} {'fwd us':>8} {'bwd MiB':>8} "
                    f"{'bwd us':>8}"]
    for s in steps:
        lines.append(f"{s['step']:>4} {s['pairs']:>6.3g} {s['compute_s'] * 1e6:>10.1f} "
                     f"{s['forward_bytes'] / 2**20:>8.2f} {s['forward_s'] * 1e6:>8.1f} "
                     f"{s['backward_bytes'] / 2**20:>8.2f} {s['backward_s'] * 1e6:>8.1f}")
    total_f, total_b = sum(s["forward_s"] for s in steps), sum(s["backward_s"] for s in steps)
    lines.append(f"total: forward {total_f * 1e6:.1f} us, backward {total_b * 1e6:.1f} us (a model: compute at the "
                 f"v2 estimate's TFLOP/s, transfers at {LINK_BYTES_PER_S / 1e9:.0f} GB/s each way; "
                 "not a timing)")
    return "\n".join(lines)
