"""v1 vs v2 on the same inputs: the numbers behind `python -m fa_numba compare` and `sweep`.

For each registered kernel variant that takes the shape: its error against the float64 reference and the
verdict of the derived tolerance rule (a tensor-core variant's with the rounding of P to the input's 16-bit
type, tolerance's p_dtype term, or for float32 its 3xTF32 products' term); its tiles computed / skipped / masked;
its HBM bytes per tensor from `iomodel` and, in the
simulator, the bytes its element accesses actually counted; on a GPU, its time (CUDA events, median and
10th-90th percentiles after warm-up), TFLOP/s, GB/s and the v2/v1 speed-up. A variant that fails its check
is reported as failed and never timed. Shapes too large for the simulator get the analytic columns only.
A variant that cannot take the shape (the tensor-core v1-mma and v2-mma on float32 inputs, a block mask, tiles
that are not multiples of 16, d > 128: `Variant.refusal`) is left out with a note that says why.
Tiles not chosen are those `fa_numba.attention` would launch with (in the simulator, 16 x 16 for a shape it
runs); `Shape.tiles` and the rendered `tiles:` line say which were used and why.
A shape may carry a block mask (`Shape.mask`, the text `masks.parse` reads: "window:128,0",
"documents:100,300,50", ...): tiles, bytes, FLOPs and the check then follow the mask, and the kernels are
launched with it as `fa_numba.attention(mask=...)` launches them (`masking`).
"""

from __future__ import annotations

import datetime
import math
import platform
from dataclasses import asdict, dataclass, replace

import numpy as np

from fa_numba import backend, iomodel, masks, reference, shapes, tile_counts, tiling, tolerance, tolerance_backward
from fa_numba.kernels import VARIANTS, default_tiles, poisoned_outputs
from fa_numba.kernels.block_lists import kernel_mask
from fa_numba.kernels.common import INPUT_DTYPES, MAX_HEAD_DIM
from fa_numba.timing import attention_flops, time_call

SIM_MAX_BLOCKS = 64
SIM_MAX_THREADS = 64
NO_GPU_NOTE = "no GPU: kernels ran in the CUDA simulator, so there are no timings"
# Beyond B H N_q N_k this many, the naive baseline uses BLAS only: the loop, tree and FMA orders are slow, and
# a tensor this large already samples the rounding noise well (five orders cost ~2.7x three; 2**20 keeps the
# check about as fast as three orders up to 2**22 were).
EXACT_CHECK_MAX_SCORES = 2**20
FULL_CHECK_MAX_SCORES = 2**27  # B H N_q N_k beyond this: check the first heads only (float64 S would be > 1 GiB)


SIM_TILE = 16  # the simulator's tile when none was chosen: 16 threads per block keep a simulated run to seconds


@dataclass(frozen=True)
class Shape:
    """One compare problem. block_q / block_k None means not chosen: `resolved()` fills them with the tiles
    `fa_numba.attention` would launch with (`kernels.default_tiles(d)`), except that in the simulator a
    shape it can run with 16 x 16 tiles gets those (small blocks keep a simulated run to seconds); a shape
    too large for it keeps the launch defaults for its analytic columns. `tiles` records which tiles were
    used and why ("chosen", "default for d=64", ...). `mask` is a block mask as the text `masks.parse`
    reads (masks.SYNTAX), kept as text so that the shape stays JSON-ready; not with causal=True."""

    batch: int = 1
    heads: int = 2
    heads_kv: int | None = None
    n_q: int = 64
    n_k: int | None = None
    head_dim: int = 16
    causal: bool = False
    mask: str | None = None  # e.g. "window:128,0"; resolved() checks it and writes it as masks' spec()
    dtype: str = "float32"
    block_q: int | None = None
    block_k: int | None = None
    seed: int = 0
    tiles: str | None = None  # how block_q x block_k were picked; filled by resolved()

    def resolved(self, simulator_tiles: bool | None = None) -> "Shape":
        """Fill the defaults (n_k = n_q, heads_kv = heads, tiles as the class says) and validate.
        simulator_tiles=False keeps the launch defaults even for a shape the simulator could run with 16 x 16
        tiles (a sweep uses it to keep one tile size across its sizes); None: the simulator's rule."""
        for name in ("batch", "heads", "n_q", "head_dim"):
            shapes.check_block(name, getattr(self, name))
        if self.dtype != "bfloat16" and np.dtype(self.dtype) not in INPUT_DTYPES:
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {self.head_dim}")
        for name in ("block_q", "block_k"):
            if getattr(self, name) is not None:
                shapes.check_block(name, getattr(self, name))
        out = replace(self, n_k=self.n_k or self.n_q, heads_kv=self.heads_kv or self.heads)
        if out.heads % out.heads_kv:
            raise ValueError(f"heads_kv ({out.heads_kv}) must divide heads ({out.heads})")
        mask = check_mask(out.mask, out.causal, out.n_q, out.n_k)
        out = replace(out, mask=None if mask is None else mask.spec())  # one spelling: "window:inf,0" is "causal"
        if out.tiles is None or out.block_q is None or out.block_k is None:
            out = _pick_tiles(out, backend.name() == "simulator" and simulator_tiles is not False)
        causal, _, form = masking(out)
        for variant in VARIANTS.values():  # every CUDA-core kernel must take these tiles (a tensor-core one that
            if variant.unit == "simt":  # cannot is left out by `run`, with its reason)
                variant.config(out.block_q, out.block_k, out.head_dim, causal, form)
        return out


def check_mask(spec, causal: bool, n_q: int, n_k: int) -> masks.Mask | None:
    """The mask of a spec (None: no mask) that fits N_q x N_k, or a ValueError that names it and says what
    was expected: the syntax (masks.SYNTAX), causal=True and a mask together, sizes the mask does not fit
    (documents need N_q = N_k = the sum of their lengths). A masks.Mask with a spec is taken as its spec."""
    if spec is None:
        return None
    if isinstance(spec, masks.Mask):
        if spec.spec() is None:  # from_function / from_dense: no text, so no JSON-ready shape
            raise TypeError(f"mask must be text as masks.parse reads it ({masks.SYNTAX}), or a mask that has one; "
                            f"{spec.describe()} has none: call fa_numba.attention(mask=...) directly")
        spec = spec.spec()
    mask = masks.parse(spec)
    shapes.check_mask(causal, mask)  # causal=True and a mask: refused by name
    try:
        mask.check(n_q, n_k)
    except ValueError as err:
        raise ValueError(f"mask {spec!r} does not fit N_q={n_q}, N_k={n_k}: {err}") from None
    return mask


def masking(s: Shape) -> tuple[bool, masks.Mask | None, str]:
    """(causal, block mask, mask_form) of a resolved shape, as fa_numba.attention resolves them: causal=True
    or a mask of kernel form "causal" run the closed forms (causal=True, no block mask), any other mask runs
    the block-mask path in its kernel form ("intervals" or "dense"); no mask is ("none")."""
    mask = None if s.mask is None else masks.parse(s.mask)
    if mask is None or mask.kernel_form() == "causal":
        causal = s.causal or mask is not None
        return causal, None, "causal" if causal else "none"
    return False, mask, mask.kernel_form()


def _pick_tiles(s: Shape, try_simulator: bool) -> Shape:
    """Fill the tiles not chosen: the simulator's if asked and the simulator runs the shape with them, else
    the launch defaults for d; `tiles` says which."""
    chosen = [name for name in ("block_q", "block_k") if getattr(s, name) is not None]
    if len(chosen) == 2:
        return replace(s, tiles="chosen")
    launch_q, launch_k = default_tiles(s.head_dim)
    launch = replace(s, block_q=s.block_q or launch_q, block_k=s.block_k or launch_k)
    small = replace(s, block_q=s.block_q or SIM_TILE, block_k=s.block_k or SIM_TILE)
    # one tile chosen: say which, and that the phrase after it is about the other one
    prefix = f"{chosen[0]} chosen, {'block_k' if chosen == ['block_q'] else 'block_q'} " if chosen else ""
    if try_simulator and _runs_in_simulator(small):
        if (small.block_q, small.block_k) == (launch.block_q, launch.block_k):
            return replace(small, tiles=f"{prefix}default for d={s.head_dim}")
        would = f"{launch.block_q}x{launch.block_k}" + ("" if chosen else f", the default for d={s.head_dim}")
        return replace(small, tiles=f"{prefix}simulator default; fa_numba.attention would use {would}")
    return replace(launch, tiles=f"{prefix}default for d={s.head_dim}")


def _runs_in_simulator(s: Shape) -> bool:
    """Whether the simulator runs this shape (tiles filled) in about 20 s per variant."""
    work = s.batch * s.heads * s.n_q * s.n_k * s.head_dim
    blocks = math.ceil(s.n_q / s.block_q) * s.batch * s.heads
    return work <= backend.SIM_MAX_WORK and blocks <= SIM_MAX_BLOCKS and s.block_q <= SIM_MAX_THREADS


def simulator_feasible(shape: Shape) -> tuple[bool, str]:
    """Whether the simulator runs this shape in about 20 s per variant, and if not, what would."""
    s = shape.resolved()
    work = s.batch * s.heads * s.n_q * s.n_k * s.head_dim
    blocks = math.ceil(s.n_q / s.block_q) * s.batch * s.heads
    if _runs_in_simulator(s):
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
    """Tiles and HBM bytes of one order from the closed forms (the mask's block-mask lists; no kernel run)."""
    causal, mask, _ = masking(s)
    # counted from the closed forms, not from tiling.schedule's one Python object per tile (N = 10^6 has 5e8);
    # the counts are those of either order's schedule (tests/test_analytic_scale.py)
    sched = tile_counts.count(s.n_q, s.n_k, s.block_q, s.block_k, causal, mask=mask)
    per = s.batch * s.heads
    model = iomodel.traffic(order, s.n_q, s.n_k, s.head_dim, s.block_q, s.block_k, causal,
                            batch=s.batch, heads=s.heads, heads_kv=s.heads_kv, mask=mask)
    itemsize = input_dtype(s.dtype).itemsize
    return {
        "tiles_computed": sched.computed * per,
        "tiles_skipped": sched.skipped * per,
        "tiles_masked": sched.masked * per,
        "bytes_model": iomodel.to_bytes(model, itemsize),
        "bytes_total": iomodel.total_bytes(model, itemsize),
        "flops": attention_flops(s.batch, s.heads, s.n_q, s.n_k, s.head_dim, causal, mask=mask),
    }


def input_dtype(name: str) -> np.dtype:
    """Shape.dtype as a NumPy dtype: bfloat16 is ml_dtypes' (NumPy has none; ml_dtypes is the test extra)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def kernel_view(x: np.ndarray) -> np.ndarray:
    """What a kernel reads: bfloat16 as its 16 bits, as fa_numba.attention passes it (arrays.adopt), else x."""
    return x.view(np.uint16) if x.dtype.name == "bfloat16" else x


def reference_view(x: np.ndarray) -> np.ndarray:
    """What the reference reads: bfloat16 widened to float32 (exact, as reference widens float16 itself)."""
    return x.astype(np.float32) if x.dtype.name == "bfloat16" else x


def inputs(s: Shape):
    rng = np.random.default_rng(s.seed)
    dt = input_dtype(s.dtype)
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
    causal, mask, form = masking(s)
    refused = {name: VARIANTS[name].refusal(s.block_q, s.block_k, s.head_dim, causal, form, s.dtype)
               for name in variants}
    if all(refused.values()):
        raise ValueError("no variant asked for takes this shape: " + "; ".join(refused.values()))
    variants = [name for name in variants if not refused[name]]
    on_gpu = backend.name() == "gpu"
    count = (not on_gpu) if count is None else count
    feasible, why = (True, "") if on_gpu else simulator_feasible(s)
    rows = [{"variant": name, "order": VARIANTS[name].order, "description": VARIANTS[name].description,
             **analytic(s, VARIANTS[name].order)} for name in variants]
    result = {"machine": machine(), "shape": asdict(s), "rows": rows, "ran": feasible,
              "notes": [f"{name} left out: {why_not}" for name, why_not in refused.items() if why_not]}
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
    qc, kc, vc = (reference_view(x) for x in (q[part], k[part_kv], v[part_kv]))
    q, k, v = (kernel_view(x) for x in (q, k, v))
    n_scores = qc.shape[0] * qc.shape[1] * s.n_q * s.n_k
    contractions = reference.CONTRACTIONS if n_scores <= EXACT_CHECK_MAX_SCORES else ("matmul",)
    tensor_cores = any(VARIANTS[name].unit == "mma" for name in variants)
    # one baseline: the tensor-core kernels' rule adds the rounding of P to the 16-bit input type (p_out), or for
    # float32 the 3xTF32 products' term (split_*), and the ex2 weights' (exp2_*), which the CUDA-core kernels are
    # judged without (Terms.cuda_cores)
    sixteen = s.dtype in ("float16", "bfloat16")
    base_mma = tolerance.baseline(qc, kc, vc, causal=causal, contractions=contractions, block_q=s.block_q,
                                  block_k=s.block_k, mask=mask, p_dtype=s.dtype if tensor_cores and sixteen else None,
                                  products="3xtf32" if tensor_cores and not sixteen else None)
    bases = {"mma": base_mma, "simt": replace(base_mma, terms=base_mma.terms.cuda_cores())}
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    blocks = None if mask is None else kernel_mask(mask, s.n_q, s.n_k, s.block_q, s.block_k)
    for row in rows:
        variant = VARIANTS[row["variant"]]
        kernel, base = variant.build(s.block_q, s.block_k, s.head_dim, causal, form, s.dtype), bases[variant.unit]
        if count and variant.not_counted:
            row["not_counted"] = variant.not_counted
            result["notes"].append(f"{variant.name}: HBM traffic not counted: {variant.not_counted}")
        if count and not variant.not_counted:
            from fa_numba.kernels.counting import run_counted

            out, lse, ledger = run_counted(kernel, q, k, v, scale, mask=blocks)
            row["bytes_counted"] = iomodel.to_bytes(ledger, input_dtype(s.dtype).itemsize)
        else:
            d_out, d_lse, workspace = poisoned_outputs(q.shape)
            kernel(dq, dk, dv, d_out, d_lse, scale, workspace, mask=blocks)
            out, lse = d_out.copy_to_host(), d_lse.copy_to_host()
        out, lse = out[part], lse[part]
        atol_out, atol_lse = base.tolerances(row["order"])
        row.update(atol_out=atol_out, atol_lse=atol_lse,
                   err_out=tolerance.max_error(out, base.out), err_lse=tolerance.max_error(lse, base.lse))
        try:
            tolerance.judge(out, lse, base, name=row["variant"], order=row["order"])
            row["passed"] = True
        except AssertionError as failure:
            row["passed"], row["failure"] = False, str(failure)
            continue  # a variant that fails its check is never timed
        if on_gpu and repeats > 0:
            timing = time_call(lambda: kernel(dq, dk, dv, d_out, d_lse, scale, workspace, mask=blocks),
                               warmup=warmup, repeats=repeats, slow_ms=slow_ms, slow_repeats=slow_repeats)
            row["time"] = timing.as_dict()
            seconds = timing.median_ms * 1e-3
            row["tflops"] = row["flops"] / seconds / 1e12
            row["gbps"] = row["bytes_total"] / seconds / 1e9
    timed = {r["variant"]: r["time"]["median_ms"] for r in rows if "time" in r}
    for v1, v2, key in (("v1", "v2", "speedup_v2_over_v1"), ("v1-rowwise", "v2-rowwise", "speedup_rowwise_v2_over_v1"),
                        ("v1-mma", "v2-mma", "speedup_mma_v2_over_v1")):
        if {v1, v2} <= set(timed):  # the same kernel family in both loop orders
            result[key] = timed[v1] / timed[v2]
    if not on_gpu:
        result["notes"].append(NO_GPU_NOTE)
    return result


# The backward's variants `compare --backward` lists: name -> (order, deterministic, one-line verdict).
BACKWARD_VARIANTS = {
    "kv": ("kv", False, "K/V outer (FlashAttention-2): dK, dV on chip, dQ by atomic adds into HBM"),
    "kv-deterministic": ("kv", True, "K/V outer for dK, dV, then a Q-outer pass for dQ: no atomics, bitwise repeatable"),
    "q": ("q", False, "Q outer: dQ on chip, dK, dV by atomic adds into HBM"),
}
BACKWARD_MATMULS = {False: 5, True: 8}  # matrix products per tile: S, dP, dV, dK, dQ; + S, dP, dQ again


def backward_block(s: Shape) -> tuple[int, str]:
    """The backward's square tile for a resolved shape: the chosen one (block_q must equal block_k), the
    simulator's when the forward took it, else kernels.backward's default for d; and why."""
    from fa_numba.kernels import backward

    if s.tiles == "chosen":
        if s.block_q != s.block_k:
            raise ValueError(f"the backward kernels need square tiles: --block-q {s.block_q} and --block-k "
                             f"{s.block_k} must be equal")
        return s.block_q, "chosen"
    if "simulator default" in (s.tiles or "") and s.block_q == s.block_k == SIM_TILE:
        return SIM_TILE, "simulator default"
    return backward.default_backward_tiles(s.head_dim)[0], f"backward default for d={s.head_dim}"


def run_backward(shape: Shape, variants=None, *, repeats: int = 20, warmup: int = 3, count: bool | None = None,
                 slow_ms: float | None = None, slow_repeats: int = 5) -> dict:
    """Compare the backward variants on one shape: the gradients of sum(dO * attention(q, k, v)) from the
    forward kernel's O and LSE. Per variant: errors against the float64 gradients by the 3x rule, tiles
    visited, HBM bytes from iomodel.traffic_backward (and counted in the simulator), time on a GPU."""
    from numba import cuda

    from fa_numba.kernels import backward

    s = shape.resolved()
    block, why = backward_block(s)
    variants = list(variants or BACKWARD_VARIANTS)
    unknown = [v for v in variants if v not in BACKWARD_VARIANTS]
    if unknown:
        raise ValueError(f"backward variants must be among {sorted(BACKWARD_VARIANTS)}, got {unknown}")
    causal, mask, form = masking(s)
    for kind in ("kv", "q"):
        backward.BackwardConfig(kind, block, s.head_dim, causal, mask_form=form).check()
    on_gpu = backend.name() == "gpu"
    count = (not on_gpu) if count is None else count
    itemsize = input_dtype(s.dtype).itemsize
    rows = []
    for name in variants:
        order, deterministic, description = BACKWARD_VARIANTS[name]
        sched = tile_counts.count(s.n_q, s.n_k, block, block, causal, mask=mask)  # as tiling.schedule counts them
        model = iomodel.traffic_backward(order, s.n_q, s.n_k, s.head_dim, block, block, causal, batch=s.batch,
                                         heads=s.heads, heads_kv=s.heads_kv, deterministic=deterministic, mask=mask)
        rows.append({"variant": name, "order": order, "deterministic": deterministic, "description": description,
                     "tiles_computed": sched.computed * s.batch * s.heads,
                     "tiles_skipped": sched.skipped * s.batch * s.heads,
                     "tiles_masked": sched.masked * s.batch * s.heads,
                     "bytes_model": iomodel.to_bytes(model, itemsize), "bytes_total": iomodel.total_bytes(model, itemsize),
                     "flops": attention_flops(s.batch, s.heads, s.n_q, s.n_k, s.head_dim, causal, mask=mask)
                     * BACKWARD_MATMULS[deterministic] / 2})
    feasible, why_not = (True, "") if on_gpu else simulator_feasible(s)
    shape_dict = {**asdict(s), "block_q": block, "block_k": block, "tiles": why}
    result = {"machine": machine(), "shape": shape_dict, "rows": rows, "ran": feasible, "notes": [], "backward": True}
    if not feasible:
        result["notes"].append(why_not)
        return result

    q, k, v = inputs(s)
    dout = np.random.default_rng((s.seed, 1)).standard_normal(q.shape).astype(q.dtype)
    scale = 1 / math.sqrt(s.head_dim)
    out, lse = attention_forward(q, k, v, causal, block, mask=mask)
    contractions = reference.CONTRACTIONS if s.batch * s.heads * s.n_q * s.n_k <= EXACT_CHECK_MAX_SCORES else ("matmul",)
    base = tolerance_backward.baseline_backward(*(reference_view(x) for x in (q, k, v, dout)), causal=causal,
                                                contractions=contractions, mask=mask)
    q, k, v, dout = (kernel_view(x) for x in (q, k, v, dout))
    device = [cuda.to_device(x) for x in (q, k, v, out, lse, dout)]
    blocks = None if mask is None else kernel_mask(mask, s.n_q, s.n_k, block, block)  # the backward's square tiles
    for row in rows:
        order, deterministic = row["order"], row["deterministic"]
        grads_dev = (cuda.device_array(q.shape, np.float32), cuda.device_array(k.shape, np.float32),
                     cuda.device_array(k.shape, np.float32), cuda.device_array(q.shape[:-1], np.float32))

        def launch():
            backward.run(*device, *grads_dev, scale, causal=causal, order=order, deterministic=deterministic,
                         block=block, mask=blocks)

        if count:
            from fa_numba.kernels.counting import run_counted_backward

            *grads, ledger = run_counted_backward(q, k, v, out, lse, dout, scale, causal=causal, order=order,
                                                  deterministic=deterministic, block=block, mask=blocks)
            row["bytes_counted"] = iomodel.to_bytes(ledger, itemsize)
        else:
            launch()
            grads = [g.copy_to_host() for g in grads_dev[:3]]
        for key, g, ref in zip(("dq", "dk", "dv"), grads, (base.dq, base.dk, base.dv)):
            row[f"err_{key}"] = tolerance.max_error(g, ref)
        row.update(atol_dq=base.atol_dq, atol_dk=base.atol_dk, atol_dv=base.atol_dv)
        try:
            tolerance_backward.judge_backward(*grads, base, name=row["variant"])
            row["passed"] = True
        except AssertionError as failure:
            row["passed"], row["failure"] = False, str(failure)
            continue  # a variant that fails its check is never timed
        if on_gpu and repeats > 0:
            timing = time_call(launch, warmup=warmup, repeats=repeats, slow_ms=slow_ms, slow_repeats=slow_repeats)
            row["time"] = timing.as_dict()
            seconds = timing.median_ms * 1e-3
            row["tflops"] = row["flops"] / seconds / 1e12
            row["gbps"] = row["bytes_total"] / seconds / 1e9
    if not on_gpu:
        result["notes"].append(NO_GPU_NOTE)
    return result


def attention_forward(q, k, v, causal, block, mask=None):
    """O and LSE of the v2 kernel with the same masking (what a training step hands the backward), as host
    arrays."""
    from fa_numba import api

    return api.attention(q, k, v, causal=causal, return_lse=True, block_q=block, block_k=block, mask=mask)


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


def _render(result: dict, title: str, header, cells) -> str:
    """The table a user reads: machine, shape, tiles, one row per variant (header(unit) and cells(row, size)
    give the columns of the kind of run), the counted==model and GPU time columns, failures and notes."""
    m = result["machine"]
    lines = [f"machine: {m['device']} | numba {m['numba']}, numba-cuda {m['numba_cuda']}, numpy {m['numpy']} | "
             f"{m['date']}", title,
             f"tiles: {result['shape']['block_q']}x{result['shape']['block_k']} ({result['shape']['tiles']})"]
    unit, size = _unit(max(r["bytes_total"] for r in result["rows"]))
    counted = any("bytes_counted" in r for r in result["rows"])
    timed = any("time" in r for r in result["rows"])
    table = [header(unit) + (["counted==model"] if counted else []) +
             (["median ms", "p10-p90 ms", "TFLOP/s", "GB/s"] if timed else [])]
    for r in result["rows"]:
        row = [r["variant"], "-" if "passed" not in r else ("pass" if r["passed"] else "FAIL")] + cells(r, size)
        if counted:
            row.append(str(r.get("bytes_counted") == r["bytes_model"]) if "bytes_counted" in r
                       else "not counted" if r.get("not_counted") else "-")
        if timed:
            t = r.get("time")
            row += ([f"{t['median_ms']:.3f}", f"{t['p10_ms']:.3f}-{t['p90_ms']:.3f}", f"{r['tflops']:.2f}",
                     f"{r['gbps']:.0f}"] if t else ["not timed", "", "", ""])
        table.append(row)
    lines += align(table, left=1)
    if "speedup_v2_over_v1" in result:
        lines.append(f"v2/v1 speed-up (tile engine): {result['speedup_v2_over_v1']:.2f}x")
    if "speedup_rowwise_v2_over_v1" in result:
        lines.append(f"v2/v1 speed-up (one thread per row): {result['speedup_rowwise_v2_over_v1']:.2f}x")
    if "speedup_mma_v2_over_v1" in result:
        lines.append(f"v2/v1 speed-up (tensor cores): {result['speedup_mma_v2_over_v1']:.2f}x")
    for r in result["rows"]:
        if r.get("passed") is False:
            lines.append(f"{r['variant']} FAILED its check and was not timed: {r['failure'][:300]}")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def _bytes(r: dict, size: int, *names: str) -> str:
    """Modelled bytes read and written of the named tensors, in the table's unit."""
    return f"{sum(r['bytes_model'][rw][t] for rw in ('read', 'write') for t in names) / size:.2f}"


def _error(r: dict, key: str) -> str:
    return f"{r[key]:.2e}" if key in r else "-"


def masking_text(shape: dict) -> str:
    """How a table names the masking of a shape dict: "mask=window(8, 0)" (masks' describe(), which
    shortens a long list of documents; the JSON keeps the full spec), or "causal=..." without a mask."""
    spec = shape.get("mask")  # .get: results written before shapes had masks
    return f"causal={shape['causal']}" if spec is None else f"mask={masks.parse(spec).describe()}"


def render(result: dict) -> str:
    """The aligned text table of `run`."""
    s = result["shape"]
    title = (f"shape: B={s['batch']} H={s['heads']} H_kv={s['heads_kv']} N_q={s['n_q']} N_k={s['n_k']} "
             f"d={s['head_dim']} {masking_text(s)} dtype={s['dtype']} seed={s['seed']}")
    return _render(result, title,
                   lambda unit: ["variant", "check", "err O", "err LSE", "tiles", "skipped", "masked", f"Q+O {unit}",
                                 f"K+V {unit}", f"l+m {unit}", f"total {unit}"],
                   lambda r, size: [_error(r, "err_out"), _error(r, "err_lse"), str(r["tiles_computed"]),
                                    str(r["tiles_skipped"]), str(r["tiles_masked"]), _bytes(r, size, "Q", "O"),
                                    _bytes(r, size, "K", "V"), _bytes(r, size, "l", "m"),
                                    f"{r['bytes_total'] / size:.2f}"])


def render_backward(result: dict) -> str:
    """The aligned text table of `run_backward`."""
    s = result["shape"]
    title = (f"backward of: B={s['batch']} H={s['heads']} H_kv={s['heads_kv']} N_q={s['n_q']} N_k={s['n_k']} "
             f"d={s['head_dim']} {masking_text(s)} dtype={s['dtype']} seed={s['seed']}")
    return _render(result, title,
                   lambda unit: ["variant", "check", "err dQ", "err dK", "err dV", "tiles", "skipped", f"Q+dO {unit}",
                                 f"K+V {unit}", f"dQ+dK+dV {unit}", f"total {unit}"],
                   lambda r, size: [_error(r, "err_dq"), _error(r, "err_dk"), _error(r, "err_dv"),
                                    str(r["tiles_computed"]), str(r["tiles_skipped"]), _bytes(r, size, "Q", "dO"),
                                    _bytes(r, size, "K", "V"), _bytes(r, size, "dQ", "dK", "dV"),
                                    f"{r['bytes_total'] / size:.2f}"])


def varlen_rows(lengths, head_dim: int, block_q: int, block_k: int, *, causal: bool, heads: int = 1,
                itemsize: int = 4) -> list[dict]:
    """A packed batch of sequences of these lengths (self-attention, `packed.varlen`) beside the same sequences
    padded to the longest (B = len(lengths) problems of L_max x L_max, causal or not), as the v2 forward takes
    them: tiles computed and skipped, visible pairs, HBM bytes (iomodel, inputs of `itemsize` bytes, O and LSE
    float32). The model only: no kernel runs."""
    from fa_numba import packed

    lengths = [int(n) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total, longest = int(offsets[-1]), max(lengths)
    mask = packed.varlen(offsets, offsets, causal=causal)
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lengths) * heads
    rows = []
    for name, kinds, ledger, batch in (
            ("packed (cu_seqlens)", tiling.classify(total, total, block_q, block_k, mask=mask),
             iomodel.traffic("v2", total, total, head_dim, block_q, block_k, mask=mask, heads=heads), 1),
            (f"padded to {longest}", tiling.classify(longest, longest, block_q, block_k, causal=causal),
             iomodel.traffic("v2", longest, longest, head_dim, block_q, block_k, causal=causal, batch=len(lengths),
                             heads=heads), len(lengths))):
        computed = int((kinds != tiling.SKIP).sum()) * batch * heads
        rows.append(dict(layout=name, tiles_computed=computed,
                         tiles_skipped=int(kinds.size) * batch * heads - computed, visible_pairs=pairs,
                         hbm_bytes=iomodel.total_bytes(ledger, itemsize)))
    return rows


def render_varlen(rows: list[dict], title: str) -> str:
    """The table of `varlen_rows`."""
    table = [["layout", "tiles computed", "tiles skipped", "visible pairs", "HBM MiB"]]
    table += [[r["layout"], str(r["tiles_computed"]), str(r["tiles_skipped"]), str(r["visible_pairs"]),
               f"{r['hbm_bytes'] / 2**20:.2f}"] for r in rows]
    return "\n".join([title, *align(table, left=1),
                      "the model only (tiling and iomodel): no kernel ran; a padded batch also computes its padding"])
