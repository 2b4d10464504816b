"""The device session's table: each job's check and time beside torch SDPA and the whole-kernel model's estimate
(each configuration's newest committed benchmarks/results/estimate_sm90_*.json: a model, never a measurement)."""

from __future__ import annotations

import functools

from device_jobs import A_B_FLAGS, CHECK_N, SHAPE, name_of


@functools.lru_cache(maxsize=1)  # read once: the table is rendered again after every finished job
def model_seconds(upto: str | None = None) -> dict:
    """{(profile variant, dtype, d, causal): (seconds, TFLOP/s, limiter)} at the timing shape, from the newest
    committed whole-kernel estimate of each (compare_gpu.model_estimates, its files up to `upto`: a model of
    the H200, never a measurement)."""
    from compare_gpu import model_estimates

    b, h, n = SHAPE
    return {(variant, dtype, d, causal): (est["seconds"], est.get("tflops"), est.get("limiter"))
            for (variant, d, causal, dtype, size), est in model_estimates(b, h, upto).items()
            if size == n and est.get("seconds")}


def model_for(j: dict, models: dict):
    """(seconds, limiter) of the job's kernel in the model: the deterministic tensor-core backward is its two
    passes' sum; None where the model has no estimate."""
    key = lambda v: (v, j["dtype"], j.get("d"), j.get("causal"))  # noqa: E731
    if any(j.get(flag) for flag in A_B_FLAGS):  # a kernel as it was before a change: the estimates are of today's
        return None
    if j["job"] == "mma-fwd":
        parts = [f"{j['order']}-mma"]
    elif j["job"] == "mma-bwd":
        parts = ["bwd-kv-mma-det", "bwd-dq-mma"] if j["deterministic"] else ["bwd-kv-mma"]
    elif j["job"] == "simt":  # the deterministic CUDA-core backward: its kv pass and its dQ-only pass
        parts = ["bwd-kv-det", "bwd-q-dq"] if j["variant"] == "bwd-kv-det" else [j["variant"]]
    else:
        return None
    found = [models.get(key(p)) for p in parts]
    if not all(found):
        return None
    return sum(f[0] for f in found), "+".join(f[2] or "?" for f in found)


def flops(j: dict) -> float | None:
    b, h, n = SHAPE
    if j["job"] in ("mma-fwd", "simt", "sdpa", "mma-bwd"):
        f = 4.0 * b * h * n * n * j["d"] / (2 if j["causal"] else 1)
        backward = j["job"] == "mma-bwd" or j.get("backward") or j.get("variant", "").startswith("bwd-")
        return f * (2.5 if backward else 1)
    if j["job"] == "wide":
        return 2.0 * b * h * n * n * (j["d"] + j["d_v"]) / (2 if j["causal"] else 1)
    return None


def render(rows: list[dict], header: dict, tests: str | None, model_upto: str | None = None) -> str:
    """The session's markdown table; model_upto: the last estimate file to read (compare_gpu.model_estimates)."""
    models = model_seconds(model_upto)
    sdpa = {(r["dtype"], r["d"], r["causal"], r["backward"]): r for r in rows if r["job"] == "sdpa" and r.get("ms")}
    lines = [f"# device session: {header.get('device')}, {header.get('date')}", "",
             ", ".join(f"{k} {v}" for k, v in header.items()), "",
             f"Timing shape B, H, N = {SHAPE}; check shape B=1, H=2, N={CHECK_N}. TFLOP/s: forward 4 B H N^2 d, "
             "backward 2.5 x that, halved for causal. model: the whole-kernel estimate (committed "
             "estimate_sm90_*.json), a model, not a measurement; meas/model: measured ms over the model's.", ""]
    if tests:
        lines += [f"Primitive and tensor-core tests, simulator off: `{tests}`", ""]
    lines += ["| kernel | dtype | d | causal | tiles | check | err / atol | ms | TFLOP/s | SDPA ms (backend) | "
              "SDPA / ours | model TFLOP/s (limiter) | meas/model |", "|" + "---|" * 13]
    for r in sorted(rows, key=lambda r: r["id"]):
        if r["job"] in ("sdpa", "decode"):
            continue
        ms, f = r.get("ms"), flops(r)
        err = r.get("err_out", r.get("err"))
        atol = r.get("atol_out", r.get("atol"))
        ratio = lambda e, a: max(x / y for x, y in zip(e, a)) if isinstance(e, list) else e / a  # noqa: E731
        check = ("pass" if r.get("passed") else "FAIL" if r.get("passed") is False else "-") + (
            f" ({r['error'][:60]})" if r.get("error") else "")
        if r.get("suspect"):  # a timing taken while something else may have held the GPU: not calibration data
            check += " (time suspect)"
        ref = sdpa.get((r["dtype"] if r["dtype"] != "tf32" else "float32", r.get("d"), r.get("causal"),
                        r["job"] == "mma-bwd" or r.get("variant") == "bwd-kv"))
        model = model_for(r, models)
        lines.append(
            f"| {name_of(r)} | {r['dtype']} | {r.get('d')} | {r.get('causal')} | "
            f"{'-' if r.get('block_q') is None else str(r['block_q']) + 'x' + str(r['block_k'])}"
            f" | {check} | {'-' if err is None or atol is None else format(ratio(err, atol), '.2f')} | "
            f"{'-' if ms is None else format(ms, '.3f')} | {'-' if not (ms and f) else format(f / ms / 1e9, '.1f')} | "
            f"{'-' if not ref else format(ref['ms'], '.3f') + ' (' + ref['backend'] + ')'} | "
            f"{'-' if not (ref and ms) else format(ref['ms'] / ms, '.2f')} | "
            f"{'-' if not model else format(f / model[0] / 1e12, '.1f') + ' (' + model[1] + ')'} | "
            f"{'-' if not (model and ms) or r.get('suspect') else format(ms * 1e-3 / model[0], '.2f')} |")
    lines += ["", "| SDPA | dtype | d | causal | ms | TFLOP/s | backend |", "|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["job"] == "sdpa"), key=lambda r: r["id"]):
        ms, f = r.get("ms"), flops(r)
        lines.append(f"| {name_of(r)} | {r['dtype']} | {r['d']} | {r['causal']} | "
                     f"{'-' if ms is None else format(ms, '.3f')} | {'-' if not ms else format(f / ms / 1e9, '.1f')} | "
                     f"{r.get('backend', r.get('error', '-'))} |")
    for r in rows:
        if r["job"] == "decode":
            lines += ["", f"## {name_of(r)}: {'pass' if r.get('passed') else 'FAIL'}", "```",
                      r.get("table", r.get("error", "")), "```"]
    return "\n".join(lines) + "\n"

