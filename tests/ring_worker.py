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
        q, dout = (torch.from_numpy(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(2))
        k, v = (torch.from_numpy(rng.standard_normal((b, h_kv, n, d)).astype(np.float32)) for _ in range(2))
        layout, causal = case["layout"], case["causal"]
        import fa_numba

        calls = {"full": 0, "partial": 0}
        forward = fa_numba.attention

        def counted(*args, **kwargs):  # the forward's block calls, by kind, as the ring makes them
            calls["partial" if kwargs.get("causal") else "full"] += 1
            return forward(*args, **kwargs)

        fa_numba.attention = counted
        shards = [fd.shard(x, layout=layout).requires_grad_() for x in (q, k, v)]
        out, lse = fd.ring_attention(*shards, causal=causal, layout=layout, block=case["block"], return_lse=True)
        out.backward(fd.shard(dout, layout=layout))
        full = [fd.unshard(x, layout=layout) for x in (out.detach(), *(s.grad for s in shards))]
        full.append(fd.unshard(lse[..., None], layout=layout)[..., 0])
        work = [None] * world
        dist.all_gather_object(work, calls)
        if rank == 0:
            np.savez(path, q=q.numpy(), k=k.numpy(), v=v.numpy(), dout=dout.numpy(),
                     work=np.array([[w["full"], w["partial"]] for w in work]),
                     **{name: x.numpy() for name, x in zip(("out", "dq", "dk", "dv", "lse"), full)})
    finally:
        dist.destroy_process_group()
