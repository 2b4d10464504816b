"""One rank of a ring-attention test (spawned by tests/test_distributed.py): gloo on CPU, the kernels in the
simulator. Every rank draws the same full q, k, v, dout from the case's seed, runs its shard forward and
backward, and rank 0 writes the unsharded O, dQ, dK, dV to the case's file."""

import datetime


def run(rank: int, world: int, port: int, case: dict, path: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import fa_numba.distributed as fd

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=case.get("timeout_s", 120)))
    try:
        if case.get("fail_rank") == rank:
            raise RuntimeError(f"rank {rank} fails on purpose before the ring")
        rng = np.random.default_rng(case["seed"])
        b, h, h_kv, n, d = case["shape"]
        dtype = getattr(torch, case.get("dtype", "float32"))
        d_v = case.get("d_v") or d  # V's (and O's, dO's) head dim
        draw = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)  # noqa: E731
        q, dout, k, v = draw(b, h, n, d), draw(b, h, n, d_v), draw(b, h_kv, n, d), draw(b, h_kv, n, d_v)
        layout, causal = case["layout"], case["causal"]
        import fa_numba

        calls = {"full": 0, "partial": 0, "engines": set()}
        forward, backward = fa_numba.attention, fa_numba.attention_backward

        def counted(*args, **kwargs):  # the forward's block calls, by kind, as the ring makes them
            calls["partial" if kwargs.get("causal") else "full"] += 1
            calls["engines"].add(kwargs.get("engine", "auto"))
            return forward(*args, **kwargs)

        def seen(*args, **kwargs):  # the backward's block calls: the engine they were given
            calls["engines"].add(kwargs.get("engine", "auto"))
            return backward(*args, **kwargs)

        fa_numba.attention, fa_numba.attention_backward = counted, seen
        shards = [fd.shard(x, layout=layout).requires_grad_() for x in (q, k, v)]
        sinks = dlse = None
        if case.get("sinks"):  # learnable sinks, and a loss that reads LSE too (proofs/L14)
            sinks = torch.from_numpy((2 * rng.standard_normal(h)).astype(np.float32)).requires_grad_()
            dlse = torch.from_numpy(rng.standard_normal((b, h, n)).astype(np.float32))
        mask = fa_numba.masks.parse(case["mask"]) if case.get("mask") else None  # over the global sequence
        out, lse = fd.ring_attention(*shards, causal=causal, layout=layout, block=case["block"], return_lse=True,
                                     engine=case.get("engine", "auto"), sinks=sinks, mask=mask)
        if sinks is None:
            out.backward(fd.shard(dout, layout=layout))
        else:
            loss = (out * fd.shard(dout, layout=layout)).sum() + (lse * fd.shard(dlse[..., None], layout=layout)[..., 0]).sum()
            loss.backward()
        full = [fd.unshard(x.float(), layout=layout) for x in (out.detach(), *(s.grad for s in shards))]
        full.append(fd.unshard(lse[..., None], layout=layout)[..., 0])
        work = [None] * world
        dist.all_gather_object(work, calls)
        extra = {} if sinks is None else dict(sinks=sinks.detach().numpy(), dsinks=sinks.grad.numpy(),
                                              dlse=dlse.numpy())
        if rank == 0:
            np.savez(path, **extra, q=q.float().numpy(), k=k.float().numpy(), v=v.float().numpy(), dout=dout.float().numpy(),
                     work=np.array([[w["full"], w["partial"]] for w in work]),
                     engines=np.array(sorted(set().union(*(w["engines"] for w in work)))),
                     **{name: x.numpy() for name, x in zip(("out", "dq", "dk", "dv", "lse"), full)})
        # Every rank reaches teardown together: a run of the slow tier (2026-12-03) saw a rank abort in gloo's
        # teardown ("terminate called without an active exception", SIGABRT) while its peer was still writing.
        dist.barrier()
    finally:
        dist.destroy_process_group()
