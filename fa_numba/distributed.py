"""Ring attention over torch.distributed: a sequence sharded over W ranks, K/V passed around the ring, the
partial (O, LSE) of each visited block merged by the online-softmax merge (proofs/L12_ring_attention.md).

    out = fa_numba.distributed.ring_attention(q, k, v, causal=True)      # q, k, v: this rank's shard

Layouts. The global sequence of N positions is cut into C equal chunks: C = W ("contiguous": rank r holds
chunk r) or C = 2W ("zigzag": rank r holds chunks r and 2W - 1 - r, so that under causal masking every rank
computes the same number of chunk pairs). A rank's shard is its chunks concatenated in increasing order along
the sequence axis; `shard` cuts it from a full tensor, `unshard` gathers the full tensor back.

Forward. Step s = 0 .. W - 1: the rank holds the K/V shard of rank (r - s) mod W; it starts sending that shard
to rank r + 1 and receiving the next from rank r - 1 (torch.distributed isend / irecv, which overlap with the
work), then computes, for each of its query chunks i and each held key chunk j, the pair's kind by L3 on
chunks (causal: j > i SKIP, j = i PARTIAL, j < i FULL; without masking every pair FULL): SKIP pairs are never
computed; the others run `fa_numba.attention` (causal only on the diagonal), whose (O, LSE) is merged into
chunk i's state as the combine kernel of split-KV decoding merges splits (`merge`). Then it waits for the
transfers. After W steps every (query chunk, key chunk) pair has been visited once (L12).

Backward (L7). With the forward's O and LSE of the whole rows, each pair's gradients are exactly its terms
of dQ, dK, dV (P recomputed from the global LSE; D from the global O): dQ of chunk i sums its pairs in place,
and dK, dV of a key chunk travel around the ring with its K and V, summed by every rank that sees it, and are
sent home after the last step. Gradients and the merge are float32; O comes back in q's dtype.

The same code runs with CUDA tensors on NCCL; only gloo on CPU (the kernels in Numba's simulator) is tested
here: no GPU has been lent to this project.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fa_numba import shapes
from fa_numba.ring_model import FULL, LAYOUTS, PARTIAL, SKIP, chunk_ids, pair_counts, pair_kind  # noqa: F401


def _group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    return group if group is not None else dist.group.WORLD


def _rank_world(group) -> tuple[int, int]:
    group = _group(group)
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of a full (..., N, d) tensor: its chunks (`chunk_ids`) concatenated."""
    rank, world = _rank_world(group)
    count = world * (1 if layout == "contiguous" else 2)
    n = x.shape[-2]
    if n % count:
        raise ValueError(f"x must have a sequence length N (axis -2) divisible by {count} chunks for layout "
                         f"{layout!r} on {world} ranks, got N = {n}")
    pieces = x.chunk(count, dim=-2)
    return torch.cat([pieces[c] for c in chunk_ids(rank, world, layout)], dim=-2).contiguous()


def unshard(x: torch.Tensor, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The full tensor from every rank's shard (an all_gather), in sequence order."""
    group = _group(group)
    rank, world = _rank_world(group)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    per = len(chunk_ids(0, world, layout))
    pieces = {}
    for r, part in enumerate(gathered):
        for c, piece in zip(chunk_ids(r, world, layout), part.chunk(per, dim=-2)):
            pieces[c] = piece
    return torch.cat([pieces[c] for c in sorted(pieces)], dim=-2)


class _State:
    """One query chunk's merge of its visited blocks: (m, l, acc) as the decode combine keeps them (L11, L12)."""

    def __init__(self):
        self.m = self.l = self.acc = None

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge a block's (O, LSE): rows with LSE = -inf (no visible key in the block) are the identity."""
        full = lse != -math.inf
        if self.m is None:  # merge(identity, a) = a
            self.m = torch.where(full, lse, torch.full_like(lse, -math.inf))
            self.l = full.to(lse.dtype)
            self.acc = torch.where(full[..., None], out, torch.zeros_like(out))
            return
        seen = self.l > 0
        m_new = torch.where(seen, torch.maximum(self.m, lse), lse)
        alpha = torch.where(seen, torch.exp(self.m - m_new), torch.zeros_like(m_new))
        beta = torch.exp(lse - m_new)
        m = torch.where(full, m_new, self.m)
        l = torch.where(full, alpha * self.l + beta, self.l)
        acc = torch.where(full[..., None], alpha[..., None] * self.acc + beta[..., None] * out, self.acc)
        self.m, self.l, self.acc = m, l, acc

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        alive = self.l > 0
        out = torch.where(alive[..., None], self.acc / torch.where(alive, self.l, torch.ones_like(self.l))[..., None],
                          torch.zeros_like(self.acc))
        lse = torch.where(alive, self.m + torch.log(torch.where(alive, self.l, torch.ones_like(self.l))),
                          torch.full_like(self.m, -math.inf))
        return out, lse


def _exchange(tensors, rank: int, world: int, group):
    """Start sending `tensors` to rank + 1 and receiving their like from rank - 1; returns (buffers, requests)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    peers = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    buffers = [torch.empty_like(t) for t in tensors]
    requests = [dist.isend(t.contiguous(), peers[0], group=group) for t in tensors]
    requests += [dist.irecv(b, peers[1], group=group) for b in buffers]
    return buffers, requests


def _tiles(x: torch.Tensor, block):
    """The kernels' tiles: `block` if given, else 16 on CPU tensors (the simulator), else the defaults."""
    if block is not None:
        return dict(block_q=block, block_k=block)
    return dict(block_q=16, block_k=16) if x.device.type == "cpu" else {}


def ring_forward(q, k, v, *, group=None, causal=False, layout="zigzag", scale=None, block=None, engine="auto",
                 sinks=None, mask=None):
    """(O, LSE) of this rank's query shard against the whole sequence: O float32 (B, H, N/W, d), LSE float32;
    each block call on `engine` (fa_numba.attention's). sinks: (H,) sink logits, merged once into each row after
    the ring's blocks (proofs/L14). mask: an interval mask over the global sequence (`_pair`)."""
    import fa_numba

    group = _group(group)
    rank, world = _rank_world(group)
    mine = chunk_ids(rank, world, layout)
    q_chunks = [c.contiguous() for c in q.chunk(len(mine), dim=-2)]
    states = [_State() for _ in mine]
    held = (k.contiguous(), v.contiguous())
    tiles = _tiles(q, block)
    for step in range(world):
        source = (rank - step) % world
        pending = _exchange(held, rank, world, group) if step < world - 1 else None  # overlaps the work below
        k_chunks, v_chunks = ([c.contiguous() for c in x.chunk(len(mine), dim=-2)] for x in held)
        for qi, state, q_c in zip(mine, states, q_chunks):
            for kj, k_c, v_c in zip(chunk_ids(source, world, layout), k_chunks, v_chunks):
                kind, pair_mask = _pair(qi, kj, causal, mask, q_c.shape[-2], world * len(mine))
                if kind != SKIP:
                    o, m = fa_numba.attention(q_c, k_c, v_c, causal=kind == PARTIAL and mask is None, scale=scale,
                                              return_lse=True, engine=engine, mask=pair_mask, **tiles)
                    state.add(o, m)
        if pending is not None:
            buffers, requests = pending
            for request in requests:
                request.wait()
            held = tuple(buffers)
    if sinks is not None:  # the sink's state (s_h, 1, 0), merged once per row (L14)
        for state in states:
            rows = state.m.shape
            state.add(torch.zeros_like(state.acc), sinks.to(torch.float32).view(1, -1, 1).expand(rows).contiguous())
    outs, lses = zip(*(state.result() for state in states))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def ring_backward(q, k, v, out, lse, dout, *, group=None, causal=False, layout="zigzag", scale=None, block=None,
                  engine="auto", sinks=None, dlse=None, mask=None):
    """(dQ, dK, dV) of this rank's shards (float32), K/V travelling with their dK/dV accumulators (L7, L12);
    each block call on `engine` (fa_numba.attention_backward's). out and lse: the ring's, with the sinks where
    given; dlse: LSE's cotangent (this rank's rows), passed to every block of its rows (dS = P (dP - D + dLSE)
    pair by pair, L14). With sinks, (dQ, dK, dV, dsinks): dsinks summed over this rank's rows, then over the
    group (all_reduce)."""
    import fa_numba

    group = _group(group)
    rank, world = _rank_world(group)
    mine = chunk_ids(rank, world, layout)
    per = len(mine)
    q_chunks, o_chunks, do_chunks = ([c.contiguous() for c in x.chunk(per, dim=-2)] for x in (q, out, dout))
    lse_chunks = [c.contiguous() for c in lse.chunk(per, dim=-1)]
    dlse_chunks = [None] * per if dlse is None else [c.contiguous() for c in dlse.float().chunk(per, dim=-1)]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq_chunks = dq.chunk(per, dim=-2)
    zeros = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (k, v)]  # dK, dV (d_v may differ)
    held = (k.contiguous(), v.contiguous(), *zeros)
    block = block if block is not None else (16 if q.device.type == "cpu" else None)
    for step in range(world):
        source = (rank - step) % world
        k_h, v_h, dk_h, dv_h = held
        dk_chunks, dv_chunks = dk_h.chunk(per, dim=-2), dv_h.chunk(per, dim=-2)
        for qi, q_c, o_c, do_c, m_c, dl_c, dq_c in zip(mine, q_chunks, o_chunks, do_chunks, lse_chunks, dlse_chunks,
                                                       dq_chunks):
            for kj, k_c, v_c, dk_c, dv_c in zip(chunk_ids(source, world, layout), k_h.chunk(per, dim=-2),
                                                v_h.chunk(per, dim=-2), dk_chunks, dv_chunks):
                kind, pair_mask = _pair(qi, kj, causal, mask, q_c.shape[-2], world * per)
                if kind != SKIP:
                    g_q, g_k, g_v = fa_numba.attention_backward(q_c, k_c.contiguous(), v_c.contiguous(), o_c, m_c, do_c,
                                                                causal=kind == PARTIAL and mask is None, scale=scale,
                                                                block_q=block, block_k=block, engine=engine,
                                                                dlse=dl_c, mask=pair_mask)
                    dq_c += g_q
                    dk_c += g_k
                    dv_c += g_v
        if world > 1:
            buffers, requests = _exchange(held, rank, world, group)  # after the step: dK, dV carry its sums
            for request in requests:
                request.wait()
            held = tuple(buffers)
    # W exchanges: the accumulators of this rank's own K/V are back
    if sinks is None:
        return dq, held[2], held[3]
    d_row = (dout.float() * out.float()).sum(dim=-1) - (0 if dlse is None else dlse.float())
    p_sink = torch.where(lse == -math.inf, torch.zeros_like(lse), torch.exp(sinks.float().view(1, -1, 1) - lse))
    dsinks = -(p_sink * d_row).sum(dim=(0, 2))
    dist.all_reduce(dsinks, group=group)  # every rank's rows of head h read s_h
    return dq, held[2], held[3], dsinks


def _pair(i: int, j: int, causal: bool, mask, chunk: int, count: int):
    """(kind, mask) of query chunk i against key chunk j: L3 on chunks without a mask; with one, the chunk pair's
    kind and, for a PARTIAL pair, its own mask in the pair's local positions (`packed.restrict`: from the global
    mask's row intervals over count chunks of `chunk` positions)."""
    if mask is None:
        return pair_kind(i, j, causal), None
    from fa_numba import packed

    from fa_numba import tiling

    n = chunk * count
    kind, pair_mask = packed.restrict(mask, n, n, (i * chunk, (i + 1) * chunk), (j * chunk, (j + 1) * chunk))
    return {tiling.SKIP: SKIP, tiling.FULL: FULL, tiling.PARTIAL: PARTIAL}[kind], pair_mask


class RingAttention(torch.autograd.Function):
    """ring_forward / ring_backward as one differentiable function of this rank's q, k, v shards."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, block, engine, sinks, mask):
        sink = None if sinks is None else sinks.detach()
        out, lse = ring_forward(q.detach(), k.detach(), v.detach(), group=group, causal=causal, layout=layout,
                                scale=scale, block=block, engine=engine, sinks=sink, mask=mask)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.options = dict(group=group, causal=causal, layout=layout, scale=scale, block=block, engine=engine,
                           mask=mask)
        ctx.set_materialize_grads(False)  # a loss that reads O alone gives no dLSE: no shift of D then
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        grads = ring_backward(q, k, v, out, lse, dout, sinks=None if sinks is None else sinks.detach(), dlse=dlse,
                              **ctx.options)
        dsinks = None if sinks is None else grads[3].to(sinks.dtype)
        return (grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)) + (None,) * 6 + (dsinks, None)


def ring_attention(q, k, v, *, group=None, causal: bool = False, layout: str = "zigzag", scale: float | None = None,
                   engine: str = "auto", block: int | None = None, return_lse: bool = False, sinks=None, mask=None):
    """Attention of this rank's shard of the sequence against the whole sequence, differentiable (see the module
    docstring). q (B, H, N / W, d), k (B, H_kv, N / W, d), v (B, H_kv, N / W, d_v) (d_v may differ from d, as in
    fa_numba.attention): the shards `shard(x, group, layout)` cuts, the same layout on every rank. causal is
    over the global sequence (N_q = N_k). Returns O (B, H, N / W, d_v) in
    q's dtype, the same shard of the single-device result, and with return_lse=True also its float32 LSE
    (B, H, N / W), differentiable (a loss may read it: L14). sinks: learnable sinks, an (H,) float32 tensor on q's
    device (the same on every rank), merged once into every row after the ring, differentiable (its gradient
    summed over the group). mask: a mask over the global sequence (N = W times the shard length) whose rows
    each see one interval (sliding_window, prefix_lm, documents, a packed batch's `packed.varlen`), not with
    causal=True: every chunk pair is classified by it, and a PARTIAL pair runs with its restriction to the
    pair (`packed.restrict`); the layout's chunks are the global sequence's. engine: each block's, as
    fa_numba.attention and attention_backward take it: "auto" (the tensor cores for float16 and bfloat16 where they take the call, else the CUDA cores),
    "simt" or "mma" (float32 by 3xTF32, forward and backward; "mma-tf32" without gradients only);
    block: the kernels' square tile (default 16 for CPU tensors, else the kernels' defaults)."""
    from fa_numba import autograd, engines

    engines.backward(engine)  # the engine's name, before anything is read
    autograd.check_gradients_engine(engine, q, k, v)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D torch tensor (B, H, N / W, d), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if q.shape[-2] != k.shape[-2] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"q, k, v must be shards of one sequence: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.shape[-2] % len(chunk_ids(0, 1, layout)):
        raise ValueError(f"q's shard length must divide into {len(chunk_ids(0, 1, layout))} chunks for layout "
                         f"{layout!r}, got {q.shape[-2]}")
    from fa_numba import torch_ops

    if sinks is not None and not (isinstance(sinks, torch.Tensor) and tuple(sinks.shape) == (q.shape[1],)):
        raise ValueError(f"sinks must be a torch tensor of shape ({q.shape[1]},) (one logit per query head), got "
                         f"{getattr(sinks, 'shape', type(sinks).__name__)}")
    torch_ops.refuse_forward_ad(("q", q), ("k", k), ("v", v), ("sinks", sinks))  # a tangent would be dropped
    causal, mask = shapes.check_mask(causal, mask)
    if mask is not None:
        n = q.shape[-2] * _rank_world(_group(group))[1]  # the global sequence: W shards
        mask.check(n, n)
        if mask.row_intervals(n, n) is None:
            raise ValueError(f"mask must be one whose rows each see one interval (window, prefix-LM, documents, "
                             f"packed sequences), got {mask!r}")
    out, lse = RingAttention.apply(q, k, v, group, bool(causal), layout, scale, block, engine, sinks, mask)
    return (out, lse) if return_lse else out


def ring_tolerances(q, k, v, causal: bool, world: int, layout: str, block: int, scale=None,
                    p_dtype: str | None = None, sinks=None, mask=None) -> tuple[float, float]:
    """(atol_out, atol_lse) of the ring's result on full host arrays q (B, H, N, d), k, v (B, H_kv, N, d): for each
    query chunk, `split_kv.combined_tolerances` over the key chunks it visits, each a v2 call with tiles
    `block` judged by the v2 rule (with p_dtype, "float16" or "bfloat16", that of a tensor-core call, which
    rounds P to it: tolerance.baseline), the merge's rounding over their number the derived term (proofs/L12);
    sinks: (H,) the sink logits, one more exact part of every row's merge (proofs/L14); mask: the ring's global
    mask (not with causal), each pair judged with its restriction."""
    import numpy as np

    from fa_numba import masks, reference, split_kv, tolerance

    count = world * len(chunk_ids(0, 1, layout))
    n = q.shape[-2]
    c = n // count
    visible = masks.causal().dense(n, n) if causal else None if mask is None else mask.dense(n, n)
    atol = np.zeros(2)
    for i in range(count):
        rows = slice(i * c, (i + 1) * c)
        q_i = q[..., rows, :]
        row_mask = masks.from_dense(visible[rows]) if visible is not None else None
        whole = tolerance.baseline(q_i, k, v, scale=scale, contractions=("matmul",), mask=row_mask, p_dtype=p_dtype)
        parts = []
        for j in range(count):
            kind, pair_mask = _pair(i, j, causal, mask, c, count)
            if kind != SKIP:
                parts.append(tolerance.baseline(q_i, k[..., j * c:(j + 1) * c, :], v[..., j * c:(j + 1) * c, :],
                                                scale=scale, causal=causal and i == j, mask=pair_mask, block_q=block,
                                                block_k=block, p_dtype=p_dtype))
        ref_out, ref_lse = whole.out, whole.lse
        if sinks is not None:
            ref_out, ref_lse = reference.attention(q_i, k, v, scale=scale, mask=row_mask, sinks=sinks)
            sink_lse = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None], ref_lse.shape)
            parts.append(split_kv.ExactPart(np.zeros(ref_out.shape), sink_lse))
        atol = np.maximum(atol, split_kv.combined_tolerances(ref_out, ref_lse, parts))
    return float(atol[0]), float(atol[1])


def _demo_rank(rank: int, world: int, port: int, n: int, causal: bool, layout: str, path: str) -> None:
    """One rank of `main`: gloo on this machine, the same seeded inputs on every rank, its shard forward and
    backward; rank 0 saves the unsharded results for the check."""
    import datetime

    import numpy as np

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        rng = np.random.default_rng(0)
        q, k, v, dout = (torch.from_numpy(rng.standard_normal((1, 2, n, 8)).astype(np.float32)) for _ in range(4))
        shards = [shard(x, layout=layout).requires_grad_() for x in (q, k, v)]  # this rank's part of the sequence
        out, lse = ring_attention(*shards, causal=causal, layout=layout, block=8, return_lse=True)
        out.backward(shard(dout, layout=layout))
        full = [unshard(x, layout=layout) for x in (out.detach(), lse[..., None], *(s.grad for s in shards))]
        if rank == 0:
            np.savez(path, q=q, k=k, v=v, dout=dout, out=full[0], lse=full[1][..., 0], dq=full[2], dk=full[3],
                     dv=full[4])
        # Every rank reaches teardown together: without this barrier CI (2026-12-04) saw rank 1 abort in gloo's
        # teardown ("terminate called without an active exception", SIGABRT) while rank 0 was still writing;
        # tests/ring_worker.py met the same race and does the same.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    """`python -m fa_numba.distributed --world 2`: W processes on this machine (gloo, CPU: the kernels in the
    simulator without a GPU) run ring attention on their shards of one sequence, forward and backward; the
    unsharded result is checked against the float64 single-device reference with the rule and its ring term."""
    import argparse
    import os
    import socket
    import tempfile

    import numpy as np
    import torch.multiprocessing as mp

    from fa_numba import arguments, tolerance, tolerance_backward

    p = argparse.ArgumentParser(prog="python -m fa_numba.distributed", description=main.__doc__.split("\n\n")[0])
    p.add_argument("--world", type=arguments.positive, default=2, help="ranks W (default: %(default)s)")
    p.add_argument("--n", type=arguments.positive, default=32,
                   help="sequence length, divisible by 2W (W with --layout contiguous) (default: %(default)s)")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    p.add_argument("--no-causal", action="store_true", help="unmasked (default: causal)")
    args = p.parse_args(argv)
    count = args.world * len(chunk_ids(0, 1, args.layout))
    if args.n % count:
        p.error(f"argument --n: must be divisible by {count} chunks (layout {args.layout} on {args.world} ranks), "
                f"got {args.n}")
    causal = not args.no_causal
    with socket.socket() as s, tempfile.TemporaryDirectory() as tmp:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        path = os.path.join(tmp, "ring.npz")
        mp.start_processes(_demo_rank, args=(args.world, port, args.n, causal, args.layout, path),
                           nprocs=args.world, start_method="spawn")
        got = dict(np.load(path))
    atol_out, atol_lse = ring_tolerances(got["q"], got["k"], got["v"], causal, args.world, args.layout, 8)
    ref = tolerance.baseline(got["q"], got["k"], got["v"], causal=causal, contractions=("matmul",))
    err_out = tolerance.max_error(got["out"], ref.out)
    err_lse = tolerance.max_error(got["lse"], ref.lse)
    try:
        grads = tolerance_backward.check_attention_backward(got["dq"], got["dk"], got["dv"], got["q"], got["k"],
                                                            got["v"], got["dout"], causal=causal)
        gradients = f"dQ {grads.err_dq:.2e} (atol {grads.atol_dq:.2e}), dK {grads.err_dk:.2e}, dV {grads.err_dv:.2e}"
    except AssertionError as failure:
        grads, gradients = None, f"gradients outside the rule: {failure}"
    passed = err_out <= atol_out and err_lse <= atol_lse and grads is not None
    print(f"ring attention, {args.world} ranks, {args.layout}, N = {args.n}{', causal' if causal else ''}: "
          f"O error {err_out:.2e} (atol {atol_out:.2e}), LSE {err_lse:.2e} (atol {atol_lse:.2e}), {gradients}: "
          f"{'pass' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
