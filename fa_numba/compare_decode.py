"""`python -m fa_numba compare --decode`: split-KV decoding beside the same call unsplit and the v2 kernel on
the same cache, each checked against the float64 reference, with its HBM traffic and the HBM bound.

Variants: "split" (attention_with_kvcache on the CUDA cores, engine="simt", the heuristic's splits or --split-size),
"unsplit" (num_splits=1), "split-mma" and "unsplit-mma" (the same on the tensor cores, engine="mma": float16 and
bfloat16 only, the rows of a float32 shape say so), "v2" (fa_numba.attention, order v2 on the CUDA cores, causal,
on the cache as (B, H_kv, N_k, d): the same problem for the prefill kernel). Bytes are iomodel's
(traffic_decode, traffic); the HBM bound is bytes / 4.8 TB/s (the H200's HBM3e): the least time the call can
take, the physical limit of decoding, **a bound, not a speed**. On a GPU each variant is timed (CUDA events,
median after warm-up) and its bytes / time given as a share of that bandwidth; in the simulator the decode
kernels' HBM accesses are counted and compared with the model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from fa_numba import backend, iomodel, split_kv, timing, tolerance
from fa_numba.kernels.layout import Layout
from fa_numba.machine import H200

VARIANTS = ("split", "unsplit", "split-mma", "unsplit-mma", "v2")
SIMULATOR_TILE = 16


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    heads_kv: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: str = "float32"
    split_size: int | None = None
    block_k: int | None = None
    seed: int = 0


def inputs(s: Shape):
    from fa_numba.compare import input_dtype, kernel_view

    rng = np.random.default_rng(s.seed)
    dtype = input_dtype(s.dtype)
    make = lambda *shape: kernel_view(rng.standard_normal(shape).astype(np.float32).astype(dtype))  # noqa: E731
    return (make(s.batch, s.heads, s.n_q, s.head_dim), make(s.batch, s.heads_kv, s.n_k, s.head_dim),
            make(s.batch, s.heads_kv, s.n_k, s.head_dim))


def _itemsize(s: Shape) -> int:
    return 4 if s.dtype == "float32" else 2


def _engine(variant: str) -> str:
    return "mma" if variant.endswith("-mma") else "simt"


def _decode_call(s: Shape, q, k, v, unsplit: bool, engine: str):
    import fa_numba

    options = dict(num_splits=1) if unsplit else dict(split_size=s.split_size)
    return lambda: fa_numba.attention_with_kvcache(q, k, v, [s.n_k] * s.batch, block_k=s.block_k, return_lse=True,
                                                   engine=engine, **options)


def _splits(s: Shape, unsplit: bool, engine: str = "simt") -> tuple[split_kv.Splits, object]:
    """The split and layout attention_with_kvcache picks for this shape on `engine` (decode's own rule)."""
    from fa_numba import decode
    from fa_numba.kernels import decode as kernels
    from fa_numba.kernels.mma import decode as mma_decode

    rows = s.n_q * s.heads // s.heads_kv
    layout = (mma_decode.decode_split(s.dtype, rows, s.head_dim, s.block_k) if engine == "mma" else
              kernels.decode_layout(rows, s.head_dim, s.block_k))
    key_tiles = -(-s.n_k // layout.block_k)
    blocks = s.batch * s.heads_kv * -(-rows // layout.block_q)
    return decode._resolve_splits(1 if unsplit else None, None if unsplit else s.split_size, blocks, key_tiles,
                                  layout), layout


def run(s: Shape, variants=VARIANTS, *, repeats: int = 20, count: bool | None = None) -> dict:
    """Every variant on the same inputs: checked, its bytes and HBM bound, timed on a GPU, counted in the simulator."""
    import fa_numba

    from fa_numba.compare import reference_view
    from fa_numba.kernels import default_tiles

    q, k, v = inputs(s)
    ref_q, ref_k, ref_v = (reference_view(x) for x in (q, k, v))
    on_gpu = backend.name() == "gpu"
    contractions = ("matmul",) if s.n_k > 4096 else None  # the loop orders are slow on long rows
    # in the simulator, 16-key tiles: the shipped ones run every thread of a wide block as a Python thread
    block_q, block_k = default_tiles(s.head_dim) if on_gpu else (SIMULATOR_TILE, SIMULATOR_TILE)
    if s.block_k is None and not on_gpu:
        s = Shape(**{**asdict(s), "block_k": SIMULATOR_TILE})
    count = (not on_gpu) if count is None else count
    scale = 1 / math.sqrt(s.head_dim)
    rows = []
    for name in variants:
        row = {"variant": name}
        if name == "v2":
            call = lambda: fa_numba.attention(q, k, v, causal=True, order="v2", return_lse=True,  # noqa: E731
                                              block_q=block_q, block_k=block_k, engine="simt")
            out, lse = call()
            judged = lambda: [tolerance.check_attention(  # noqa: E731
                out, lse, ref_q, ref_k, ref_v, causal=True, order="v2", block_q=block_q, block_k=block_k,
                **({} if contractions is None else {"contractions": contractions}))]
            ledger = iomodel.traffic("v2", s.n_q, s.n_k, s.head_dim, block_q, block_k, True, s.batch, s.heads,
                                     s.heads_kv)
            row.update(splits=None, **_judged(judged))
        else:
            engine = _engine(name)
            if engine == "mma" and s.dtype not in ("float16", "bfloat16"):
                rows.append({**row, "skipped": f"engine='mma' decodes float16 and bfloat16, not {s.dtype}"})
                continue
            splits, layout = _splits(s, name.startswith("unsplit"), engine)
            call = _decode_call(s, q, k, v, name.startswith("unsplit"), engine)
            out, lse = call()
            p_dtype = s.dtype if engine == "mma" else None  # P rounded to the input type before P V
            judged = lambda: [split_kv.check(  # noqa: E731
                out[b], lse[b], ref_q[b], ref_k[b], ref_v[b], causal=True, scale=scale, block_k=layout.block_k,
                splits=splits if splits.count > 1 else None, contractions=contractions, p_dtype=p_dtype)
                for b in range(s.batch)]
            ledger = iomodel.traffic_decode([s.n_k] * s.batch, s.n_q, s.head_dim, layout.block_q, layout.block_k,
                                            splits.tiles, splits.count, True, s.heads, s.heads_kv)
            row.update(splits=splits.count, **_judged(judged))
            if count:
                row["counted_equals_model"] = _counted(s, q, k, v, layout, splits, scale) == ledger
        moved = iomodel.total_bytes(ledger, _itemsize(s))
        row.update(bytes=moved, hbm_bound_us=moved / H200.hbm_bytes_per_s * 1e6)
        if on_gpu and row["passed"]:  # a variant that fails its check is never timed
            t = timing.time_call(call, repeats=repeats)
            row.update(timing=t.as_dict(), hbm_share=moved / (t.median_ms * 1e-3) / H200.hbm_bytes_per_s)
        rows.append(row)
    return {"shape": asdict(s), "device": "gpu" if on_gpu else "simulator", "rows": rows}


def _judged(checks) -> dict:
    """err_out, atol_out and passed of a variant from its checks (each raises AssertionError when it fails)."""
    try:
        found = checks()
    except AssertionError as failure:
        return dict(err_out=float("inf"), atol_out=float("nan"), passed=False, failure=str(failure)[:500])
    return dict(err_out=max(c.err_out for c in found), atol_out=min(c.atol_out for c in found), passed=True)


def _counted(s: Shape, q, k, v, layout, splits, scale):
    from fa_numba.kernels.counting import run_counted_decode

    group = s.heads // s.heads_kv
    packed = np.ascontiguousarray(q).reshape(s.batch, s.heads_kv, group * s.n_q, s.head_dim)
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    if not isinstance(layout, Layout) and packed.dtype == np.float16:  # the tensor-core kernel reads 16-bit bits
        packed, k, v = (x.view(np.uint16) for x in (packed, k, v))
    lohi = split_kv.row_intervals(np.full(s.batch, s.n_k), s.n_q, group, True)
    _, _, ledger = run_counted_decode(packed, k, v, [s.n_k] * s.batch,
                                      np.arange(s.batch)[:, None], lohi, scale, layout=layout,
                                      tiles_per_split=splits.tiles, splits=splits.count)
    return ledger


def all_passed(result: dict) -> bool:
    return all(r["passed"] and r.get("counted_equals_model", True) for r in result["rows"] if "skipped" not in r)


def render(result: dict) -> str:
    s = result["shape"]
    lines = [f"decode: B={s['batch']} H={s['heads']} H_kv={s['heads_kv']} N_q={s['n_q']} N_k={s['n_k']} "
             f"d={s['head_dim']} {s['dtype']}, causal ({result['device']})",
             f"{'variant':<11} {'splits':>6} {'err O':>9} {'atol O':>9} {'HBM KiB':>9} {'HBM bound us':>12} "
             f"{'median us':>9} {'HBM share':>9} {'counted=model':>13}"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"{r['variant']:<11} not run: {r['skipped']}")
            continue
        t = r.get("timing")
        median, share = (f"{t['median_ms'] * 1e3:.1f}", f"{r['hbm_share']:.0%}") if t else ("-", "-")
        lines.append(f"{r['variant']:<11} {r['splits'] or '-':>6} {r['err_out']:>9.2e} {r['atol_out']:>9.2e} "
                     f"{r['bytes'] / 1024:>9.1f} {r['hbm_bound_us']:>12.3f} {median:>9} {share:>9} "
                     f"{str(r.get('counted_equals_model', '-')):>13}")
    lines += [f"{r['variant']} FAILED its check: {r['failure']}" for r in result["rows"]
              if "skipped" not in r and not r["passed"]]
    lines.append("HBM bound: bytes / 4.8 TB/s (H200 HBM3e), the least time the call can take; not a speed."
                 + ("" if result["device"] == "gpu" else " No GPU: no timings (simulator)."))
    return "\n".join(lines)
