"""v1 vs v2 on the same inputs: the numbers behind `python -m fa_numba compare` and `sweep`.

For each registered kernel variant: its error against the float64 reference and the verdict of the derived
tolerance rule; its tiles computed / skipped / masked; its HBM bytes per tensor from `iomodel` and, in the
simulator, the bytes its element accesses actually counted; on a GPU, its time (CUDA events, median and
10th-90th percentiles after warm-up), TFLOP/s, GB/s and the v2/v1 speed-up. A variant that fails its check
is reported as failed and never timed. Shapes too large for the simulator get the analytic columns only.
"""

from __future__ import annotations

import datetime
import math
import platform
from dataclasses import asdict, dataclass, replace

import numpy as np

from fa_numba import backend, iomodel, reference, shapes, tiling
from fa_numba.kernels import VARIANTS, default_tiles, poisoned_outputs
from fa_numba.kernels.common import INPUT_DTYPES, MAX_HEAD_DIM, Config
from fa_numba.timing import attention_flops, time_call

SIM_MAX_BLOCKS = 64
SIM_MAX_THREADS = 64
NO_GPU_NOTE = "no GPU: kernels ran in the CUDA simulator, so there are no timings"
# Beyond B H N_q N_k this many, the naive baseline uses BLAS only: the loop, tree and FMA orders are slow, and
# a tensor this large already samples the rounding noise well (five orders cost ~2.7x three; 2**20 keeps the
# check about as fast as three orders up to 2**22 were).
EXACT_CHECK_MAX_SCORES = 2**20
FULL_CHECK_MAX_SCORES = 2**27  # B H N_q N_k beyond this: check the first heads only (float64 S would be > 1 GiB)


@dataclass(frozen=True)
class Shape:
    batch: int = 1
    heads: int = 2
    heads_kv: int | None = None
    n_q: int = 64
    n_k: int | None = None
    head_dim: int = 16
    causal: bool = False
    dtype: str = "float32"
    block_q: int | None = None
    block_k: int | None = None
    seed: int = 0

    def resolved(self) -> "Shape":
        """Fill the defaults (n_k = n_q, heads_kv = heads, tiles by head dim) and validate."""
        for name in ("batch", "heads", "n_q", "head_dim"):
            shapes.check_block(name, getattr(self, name))
        if np.dtype(self.dtype) not in INPUT_DTYPES:
            raise ValueError(f"dtype must be float32 or float16, got {self.dtype!r}")
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {self.head_dim}")
        block_q, block_k = default_tiles(self.head_dim)
        out = replace(self, n_k=self.n_k or self.n_q, heads_kv=self.heads_kv or self.heads,
                      block_q=self.block_q or min(block_q, _pow2_at_least(self.n_q)),
                      block_k=self.block_k or min(block_k, _pow2_at_least(self.n_k or self.n_q)))
        if out.heads % out.heads_kv:
            raise ValueError(f"heads_kv ({out.heads_kv}) must divide heads ({out.heads})")
        Config("v2", out.block_q, out.block_k, out.head_dim, out.causal).check()
        return out


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def simulator_feasible(shape: Shape) -> tuple[bool, str]:
    """Whether the simulator runs this shape in about 20 s per variant, and if not, what would."""
    s = shape.resolved()
    work = s.batch * s.heads * s.n_q * s.n_k * s.head_dim
    blocks = math.ceil(s.n_q / s.block_q) * s.batch * s.heads
    if work <= backend.SIM_MAX_WORK and blocks <= SIM_MAX_BLOCKS and s.block_q <= SIM_MAX_THREADS:
        return True, ""
    n_max = min(int(math.sqrt(backend.SIM_MAX_WORK / (s.batch * s.heads * s.head_dim))),
                SIM_MAX_BLOCKS * s.block_q // (s.batch * s.heads))
    return False, (
        f"too large for the CUDA simulator: B*H*N_q*N_k*d = {work:,} (limit {backend.SIM_MAX_WORK:,}), "
        f"{blocks} blocks of {s.block_q} threads (limits {SIM_MAX_BLOCKS} and {SIM_MAX_THREADS}); feasible here: "
        f"N_q = N_k <= {n_max} at B={s.batch} H={s.heads} d={s.head_dim}, e.g. --n-q 64 --head-dim 16"
    )


def machine() -> dict:
    import numba

    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "backend": backend.name(),
            "python": platform.python_version(), "platform": platform.platform(), "numpy": np.__version__,
            "numba": numba.__version__}
    try:
        from importlib.metadata import version

        info["numba_cuda"] = version("numba-cuda")
    except Exception:  # noqa: BLE001 - metadata lookups fail in many harmless ways
        info["numba_cuda"] = "unknown"
    if info["backend"] == "gpu":
        from numba import cuda

        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        info["device"] = f"{name} (sm_{dev.compute_capability[0]}{dev.compute_capability[1]})"
    else:
        info["device"] = "CUDA simulator (no GPU)"
    return info


def analytic(s: Shape, order: str) -> dict:
    """Tiles and HBM bytes of one order from the closed forms (no kernel run)."""
    sched = tiling.schedule(order, s.n_q, s.n_k, s.block_q, s.block_k, s.causal)
    per = s.batch * s.heads
    model = iomodel.traffic(order, s.n_q, s.n_k, s.head_dim, s.block_q, s.block_k, s.causal,
                            batch=s.batch, heads=s.heads, heads_kv=s.heads_kv)
    itemsize = np.dtype(s.dtype).itemsize
    return {
        "tiles_computed": sched.computed * per,
        "tiles_skipped": sched.skipped * per,
        "tiles_masked": sched.masked * per,
        "bytes_model": iomodel.to_bytes(model, itemsize),
        "bytes_total": iomodel.total_bytes(model, itemsize),
        "flops": attention_flops(s.batch, s.heads, s.n_q, s.n_k, s.head_dim, s.causal),
    }


def inputs(s: Shape):
    rng = np.random.default_rng(s.seed)
    dt = np.dtype(s.dtype)
    q = rng.standard_normal((s.batch, s.heads, s.n_q, s.head_dim)).astype(dt)
    k = rng.standard_normal((s.batch, s.heads_kv, s.n_k, s.head_dim)).astype(dt)
    v = rng.standard_normal((s.batch, s.heads_kv, s.n_k, s.head_dim)).astype(dt)
    return q, k, v


def run(shape: Shape, variants=None, *, repeats: int = 20, warmup: int = 3, count: bool | None = None,
        slow_ms: float | None = None, slow_repeats: int = 5) -> dict:
    """Compare the variants on one shape. Returns a JSON-ready dict: machine, shape, rows, notes.

    Timing (GPU only) follows timing.time_call, slow_ms and slow_repeats included."""
    from numba import cuda

    s = shape.resolved()
    variants = list(variants or VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants must be among {sorted(VARIANTS)}, got {unknown}")
    on_gpu = backend.name() == "gpu"
    count = (not on_gpu) if count is None else count
    feasible, why = (True, "") if on_gpu else simulator_feasible(s)
    rows = [{"variant": name, "order": VARIANTS[name].order, "description": VARIANTS[name].description,
             **analytic(s, VARIANTS[name].order)} for name in variants]
    result = {"machine": machine(), "shape": asdict(s), "rows": rows, "ran": feasible, "notes": []}
    if not feasible:
        result["notes"].append(why)
        return result

    q, k, v = inputs(s)
    scale = 1 / math.sqrt(s.head_dim)
    # The float64 reference of a huge call does not fit in memory: check batch 0 and the first heads
    # (whole K/V groups), which the kernels compute exactly like every other (batch, head).
    part = part_kv = (slice(None), slice(None))
    if s.batch * s.heads * s.n_q * s.n_k > FULL_CHECK_MAX_SCORES:
        group = s.heads // s.heads_kv
        checked = max(group, FULL_CHECK_MAX_SCORES // (s.n_q * s.n_k) // group * group)
        part, part_kv = (slice(0, 1), slice(0, checked)), (slice(0, 1), slice(0, checked // group))
        result["notes"].append(f"checked against the reference on batch 0, heads 0..{checked - 1} "
                               f"(the float64 reference of the whole call is too large)")
    qc, kc, vc = q[part], k[part_kv], v[part_kv]
    n_scores = qc.shape[0] * qc.shape[1] * s.n_q * s.n_k
    contractions = reference.CONTRACTIONS if n_scores <= EXACT_CHECK_MAX_SCORES else ("matmul",)
    base = reference.baseline(qc, kc, vc, causal=s.causal, contractions=contractions, block_q=s.block_q,
                              block_k=s.block_k)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    for row in rows:
        kernel = VARIANTS[row["variant"]].make(s.block_q, s.block_k, s.head_dim, s.causal)
        if count:
            from fa_numba.kernels.counting import run_counted

            out, lse, ledger = run_counted(kernel, q, k, v, scale)
            row["bytes_counted"] = iomodel.to_bytes(ledger, np.dtype(s.dtype).itemsize)
        else:
            d_out, d_lse, workspace = poisoned_outputs(q.shape)
            kernel(dq, dk, dv, d_out, d_lse, scale, workspace)
            out, lse = d_out.copy_to_host(), d_lse.copy_to_host()
        out, lse = out[part], lse[part]
        atol_out, atol_lse = base.tolerances(row["order"])
        row.update(atol_out=atol_out, atol_lse=atol_lse,
                   err_out=reference.max_error(out, base.out), err_lse=reference.max_error(lse, base.lse))
        try:
            reference.judge(out, lse, base, name=row["variant"], order=row["order"])
            row["passed"] = True
        except AssertionError as failure:
            row["passed"], row["failure"] = False, str(failure)
            continue  # a variant that fails its check is never timed
        if on_gpu and repeats > 0:
            timing = time_call(lambda: kernel(dq, dk, dv, d_out, d_lse, scale, workspace), warmup=warmup,
                               repeats=repeats, slow_ms=slow_ms, slow_repeats=slow_repeats)
            row["time"] = timing.as_dict()
            seconds = timing.median_ms * 1e-3
            row["tflops"] = row["flops"] / seconds / 1e12
            row["gbps"] = row["bytes_total"] / seconds / 1e9
    timed = {r["order"]: r["time"]["median_ms"] for r in rows if "time" in r}
    if {"v1", "v2"} <= set(timed):
        result["speedup_v2_over_v1"] = timed["v1"] / timed["v2"]
    if not on_gpu:
        result["notes"].append(NO_GPU_NOTE)
    return result


def all_passed(result: dict) -> bool:
    return all(r.get("passed", True) for r in result["rows"])


def _unit(largest: int) -> tuple[str, int]:
    """KiB, MiB or GiB, whichever shows the largest byte count of a table with a few digits."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20)):
        if largest >= size:
            return name, size
    return "KiB", 2**10


def align(table: list[list[str]], left: int = 0) -> list[str]:
    """Rows of cells as aligned lines: the first `left` columns left-aligned, the others right-aligned."""
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in table]


def render(result: dict) -> str:
    """The aligned text table a user reads."""
    s = result["shape"]
    m = result["machine"]
    lines = [
        f"machine: {m['device']} | numba {m['numba']}, numba-cuda {m['numba_cuda']}, numpy {m['numpy']} | {m['date']}",
        f"shape: B={s['batch']} H={s['heads']} H_kv={s['heads_kv']} N_q={s['n_q']} N_k={s['n_k']} d={s['head_dim']} "
        f"causal={s['causal']} dtype={s['dtype']} tiles {s['block_q']}x{s['block_k']} seed={s['seed']}",
    ]
    unit, size = _unit(max(r["bytes_total"] for r in result["rows"]))
    header = ["variant", "check", "err O", "err LSE", "tiles", "skipped", "masked", f"Q+O {unit}", f"K+V {unit}",
              f"l+m {unit}", f"total {unit}"]
    counted = any("bytes_counted" in r for r in result["rows"])
    timed = any("time" in r for r in result["rows"])
    if counted:
        header.append("counted==model")
    if timed:
        header += ["median ms", "p10-p90 ms", "TFLOP/s", "GB/s"]
    table = [header]
    for r in result["rows"]:
        b = r["bytes_model"]
        check = "-" if "passed" not in r else ("pass" if r["passed"] else "FAIL")
        cells = [r["variant"], check,
                 f"{r['err_out']:.2e}" if "err_out" in r else "-", f"{r['err_lse']:.2e}" if "err_lse" in r else "-",
                 str(r["tiles_computed"]), str(r["tiles_skipped"]), str(r["tiles_masked"]),
                 f"{(b['read']['Q'] + b['read']['O'] + b['write']['O']) / size:.2f}",
                 f"{(b['read']['K'] + b['read']['V']) / size:.2f}",
                 f"{sum(b[rw][t] for rw in ('read', 'write') for t in ('l', 'm')) / size:.2f}",
                 f"{r['bytes_total'] / size:.2f}"]
        if counted:
            cells.append(str(r.get("bytes_counted") == b) if "bytes_counted" in r else "-")
        if timed:
            t = r.get("time")
            cells += ([f"{t['median_ms']:.3f}", f"{t['p10_ms']:.3f}-{t['p90_ms']:.3f}", f"{r['tflops']:.2f}",
                       f"{r['gbps']:.0f}"] if t else ["not timed", "", "", ""])
        table.append(cells)
    lines += align(table, left=1)
    if "speedup_v2_over_v1" in result:
        lines.append(f"v2/v1 speed-up: {result['speedup_v2_over_v1']:.2f}x")
    for r in result["rows"]:
        if r.get("passed") is False:
            lines.append(f"{r['variant']} FAILED its check and was not timed: {r['failure'][:300]}")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)
