"""Learnable sinks: the argument as the entry points read it, and the rule a result with sinks is judged by.

A sink is one logit s_h per query head, a column every row of head h sees and that has no value (gpt-oss's
learnable sinks; flash-attn's `learnable_sink`). Its definition is `reference.dense(..., sinks=)`; the device
side, one merge of the sink into each finished row and the sink's gradient, is `kernels.sinks`; the proof that
merging it once, after any kernel, split or ring, is exact is proofs/L14.

- `device_sinks(call, sinks, heads)`: the sinks of one call as a float32 (H,) Numba device array, read where
  they are for a device call (a CUDA tensor, a CuPy or Numba array), copied for a host one.
- `baseline(q, k, v, sinks, ...)`: the float64 reference with sinks and its tolerances. The kernel's own
  result (without the sink) is judged by `tolerance.baseline`'s rule for its order; the merge is the combine
  of two parts, so the whole is judged as split_kv judges a combined row (proofs/L11 part 8): each part's
  tolerance reaches the row through its share pi, and the merge adds `split_kv.combine_terms`. The sink part
  is exact (O = 0, LSE = s_h: an input).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from fa_numba import arrays, reference, shapes, split_kv, tolerance


def device_sinks(call: arrays.Call, sinks, heads: int):
    """sinks as a float32 (H,) device array for a call adopted from q, k, v: a device call takes them from the
    same library and device, float32, contiguous (read where they are, never copied to the host); a host call
    takes any real (H,) array (`shapes.check_sinks`) and copies it to the device."""
    if not call.on_device:
        if arrays.kind(sinks) in ("numba", "cupy", "cuda") or (arrays.kind(sinks) == "torch"
                                                               and sinks.device.type != "cpu"):
            raise TypeError("sinks must be a host array when q, k, v are (a NumPy array or a CPU tensor), got an "
                            "array in GPU memory")
        if arrays.kind(sinks) == "torch":
            sinks = sinks.detach().numpy()
        return cuda.to_device(shapes.check_sinks(sinks, heads), stream=call.stream)
    try:
        one = arrays.adopt({"sinks": sinks}, allowed=(np.dtype(np.float32),))
    except TypeError as error:
        raise TypeError(f"sinks must be a float32 array of {heads} logits on q's device ({error})") from None
    if (one.kind, one.on_device) != (call.kind, True):
        raise TypeError(f"sinks must be a device array of the same kind as q, k, v ({call.kind}), got {one.kind}, "
                        f"{'device' if one.on_device else 'host'}")
    (view,) = one.arrays
    if np.dtype(view.dtype) != np.float32 or tuple(view.shape) != (heads,) or not view.is_c_contiguous():
        raise ValueError(f"sinks must be a contiguous float32 array of shape ({heads},) (one logit per query head), "
                         f"got {np.dtype(view.dtype)} {tuple(view.shape)}")
    return view


def host_values(sinks_dev) -> np.ndarray:
    """The sinks back on the host (float32 (H,)): what a call without a launch (N_k = 0) needs of them."""
    return sinks_dev.copy_to_host()


@dataclass(frozen=True)
class SinkBaseline:
    """The float64 reference of a problem with sinks (out, lse) and, per order, the tolerances of a kernel's
    result merged with its sinks; `tolerance.judge` takes it as it takes a `tolerance.Baseline`."""

    out: np.ndarray
    lse: np.ndarray
    attention: tolerance.Baseline  # the same problem without sinks, judged by the kernel's own rule
    sink: split_kv.ExactPart

    def tolerances(self, order: str | None = None) -> tuple[float, float]:
        return split_kv.combined_tolerances(self.out, self.lse, [self.attention, self.sink], order=order)


def baseline(q, k, v, sinks, **options) -> SinkBaseline:
    """The reference with sinks and the rule's pieces: options as `tolerance.baseline`'s (causal, scale, mask,
    tiles, p_dtype, products, score_mod, contractions). Judge a result by `tolerance.judge(out, lse, base,
    order=...)`: the order names the kernel's own rule, as without sinks."""
    sinks = shapes.check_sinks(sinks, shapes.as_4d(np.asarray(q)).shape[1])
    attention = tolerance.baseline(q, k, v, **options)
    keep = {name: options[name] for name in ("causal", "scale", "mask", "score_mod") if name in options}
    out, lse = reference.attention(q, k, v, sinks=sinks, **keep)
    rows = shapes.batch_shape(np.shape(q))[:3]  # (B, H, N_q): the sink's LSE is s_h on every row of head h
    sink_lse = np.broadcast_to(sinks.astype(np.float64)[None, :, None], rows).reshape(np.shape(lse))
    sink = split_kv.ExactPart(np.zeros(np.shape(out)), sink_lse)
    return SinkBaseline(out, lse, attention, sink)
