"""`fa_numba.attention_with_kvcache`: attention of a few new queries over a key/value cache, split across the
keys (flash-decoding) and merged by the online-softmax monoid (proofs/L11_split_kv.md).

flash-attn's `flash_attn_with_kvcache` in this project's conventions: (B, H, N, d) layout, bottom-right
causal alignment, O and LSE in float32. The kernels are fa_numba/kernels/decode.py; the split rule and the
tolerance of a split result are fa_numba/split_kv.py.

Everything is checked before anything is written or launched. The lengths and the page table are read on the
host for that (for device tensors, a small copy and a synchronisation per call).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fa_numba import arrays, backend, engines, machine, masks, packed, shapes, split_kv
from fa_numba import sinks as sink_arrays
from fa_numba.kernels import decode as kernels
from fa_numba.kernels import sinks as kernel_sinks
from fa_numba.kernels.mma import decode as mma_decode
from fa_numba.kernels.mma.staging import aligned16
from fa_numba.kernels.common import BF16_BITS, INPUT_DTYPES, MAX_HEAD_DIM, MAX_SEQUENCE, check_grid


def _host_ints(name: str, x, shape_text: str) -> np.ndarray:
    """An integer array on the host (int64), from a NumPy array, a sequence, or a CPU or CUDA tensor."""
    if type(x).__module__.partition(".")[0] == "torch":
        x = x.detach().cpu().numpy()
    elif hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    elif hasattr(x, "get") and type(x).__module__.partition(".")[0] == "cupy":
        x = x.get()
    value = np.asarray(x)
    if value.size == 0 and not hasattr(x, "dtype"):
        value = value.astype(np.int64)  # an empty sequence (B = 0): NumPy reads it as float64, but it holds no float
    if value.dtype == np.bool_ or not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array {shape_text}, got dtype {value.dtype}")
    return value.astype(np.int64)


def _check_4d(name: str, x, what: str) -> tuple[int, int, int, int]:
    if len(x.shape) != 4:
        raise ValueError(f"{name} must be 4-D {what}, got shape {tuple(x.shape)}")
    return tuple(int(n) for n in x.shape)


def block_slots(layout) -> int:
    """Blocks of the split kernel the GPU holds at once: SMs (the current GPU's, or the H200's 132 in the
    simulator) x resident blocks per SM by its threads and shared memory (`profile.occupancy`; registers are
    not known before compiling for the device, and the decode layouts are limited by shared memory)."""
    from fa_numba.profile import occupancy

    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT if backend.name() == "gpu" else machine.H200.sms
    return sms * occupancy(layout.threads, 1, layout.shared_bytes)["blocks_per_sm"]


def _resolve_splits(num_splits, split_size, blocks: int, key_tiles: int, layout) -> split_kv.Splits:
    """The split of this call: from split_size (fixed keys per split: batch-invariant), num_splits (an upper
    bound on the splits of the longest request), or the wave-efficiency heuristic (split_kv.heuristic_splits
    over `block_slots`)."""
    block_k = layout.block_k
    if num_splits is not None and split_size is not None:
        raise ValueError("give num_splits or split_size, not both")
    tiles_needed = max(key_tiles, 1)
    if split_size is not None:
        if isinstance(split_size, bool) or not isinstance(split_size, (int, np.integer)) or split_size <= 0 \
                or split_size % block_k:
            raise ValueError(f"split_size must be a positive multiple of block_k = {block_k}, got {split_size!r}")
        tiles = int(split_size) // block_k
    else:
        if num_splits is None:
            num_splits = split_kv.heuristic_splits(blocks, tiles_needed, block_slots(layout), kernels.MAX_SPLITS)
        if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) \
                or not 1 <= num_splits <= kernels.MAX_SPLITS:
            raise ValueError(f"num_splits must be an int in 1..{kernels.MAX_SPLITS}, got {num_splits!r}")
        tiles = -(-tiles_needed // int(num_splits))
    count = -(-tiles_needed // tiles)
    if count > kernels.MAX_SPLITS:
        raise ValueError(f"split_size = {tiles * block_k} gives {count} splits for {tiles_needed * block_k} keys, "
                         f"over the {kernels.MAX_SPLITS} the combine takes: use split_size >= "
                         f"{-(-tiles_needed // kernels.MAX_SPLITS) * block_k}")
    return split_kv.Splits(count, tiles, block_k)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, *, k=None, v=None, block_table=None,
                           causal: bool = True, scale: float | None = None, num_splits: int | None = None,
                           split_size: int | None = None, return_lse: bool = False, engine: str = "auto",
                           block_k: int | None = None, sinks=None, mask=None):
    """Attention of q over the first cache_seqlens[b] keys of each request's cache (plus k, v if given).

    Args:
        q: (B, H, N_q, d), N_q small (1 for a token at a time); float32, float16 or bfloat16, the caches' dtype.
        k_cache, v_cache: (B, H_kv, N_max, d) and (B, H_kv, N_max, d_v), H_kv dividing H (GQA: query head h
            reads K/V head h // (H / H_kv)); with block_table a paged cache, (num_pages, H_kv, page_size, d) and
            (num_pages, H_kv, page_size, d_v), page_size a multiple of block_k. d_v may differ from d.
        cache_seqlens: (B,) ints, one int for all, or None (a full cache); 0 is a dead row (O = 0, LSE = -inf).
        k, v: (B, H_kv, N_new, d) and (B, H_kv, N_new, d_v) new keys and values, written into the caches in place
            at positions cache_seqlens[b] .. cache_seqlens[b] + N_new - 1 before attending (cache_seqlens itself
            is not changed: advance it yourself, as with flash-attn).
        block_table: (B, max_pages) int32; table[b, p] holds request b's positions p page_size ..
            (p + 1) page_size - 1.
        causal: query i sees the keys up to n_b - N_q + i, n_b = cache_seqlens[b] + N_new (bottom-right;
            default True, as a decoding step wants); False: all n_b keys.
        scale: default 1 / sqrt(d).
        num_splits: at most this many splits of the longest request (the split size then depends on the batch).
        split_size: keys a split holds, a multiple of block_k: a request's result is then bitwise the same
            whatever else is in its batch. Neither: `split_kv.heuristic_splits` (splits until the grid fills the
            GPU's SMs), which depends on the batch too.
        return_lse: also return LSE.
        engine: "auto", "simt" (the CUDA-core split kernel) or "mma" (the tensor-core one: float16 and bfloat16,
            d and d_v multiples of 8 up to 128; P rounded to the input type before P V); `engines.decode`.
        block_k: the key tile (default: the largest that fits; mma: a multiple of 16).
        mask: a `fa_numba.masks` mask with row intervals (sliding_window, prefix_lm), over each request's own
            positions: query i is at n_b - N_q + i, so window(left, 0) keeps the last left + 1 keys up to it;
            intersected with causal (pass causal=False for a window that looks ahead). Read by both split kernels
            as each row's key interval: tiles outside it are never read.
        sinks: learnable sinks, (H,) one logit per query head (`fa_numba.attention`'s): merged once into every
            row after the combine (proofs/L14), never per split; a row that sees no key gets O = 0, LSE = s_h.

    Returns:
        O (B, H, N_q, d_v) float32, or (O, LSE (B, H, N_q)) with return_lse=True, in q's array library. B = 0
        gives empty results.

    Raises:
        ValueError, TypeError: checked before anything is written or launched, each naming the argument: shapes
            and dtypes, the lengths (0 <= cache_seqlens[b], cache_seqlens[b] + N_new <= the request's capacity),
            every page-table entry a request uses, device arrays C-contiguous, host caches writable when k, v
            are given, the grids within CUDA's limits. A refused call leaves the caches as they were.

    >>> import numpy as np, fa_numba
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    >>> cache = rng.standard_normal((1, 1, 32, 8)).astype(np.float32)
    >>> out = fa_numba.attention_with_kvcache(q, cache, cache, [20], split_size=8, block_k=8)
    >>> out.shape
    (1, 2, 1, 8)
    """
    engines.decode(engine)  # the name, before anything else is looked at
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError("give both k and v (the new keys and values), or neither")
    if k is not None:
        named.update(k=k, v=v)
    call = arrays.adopt(named, allowed=INPUT_DTYPES, bfloat16=True)
    q_, kc, vc = call.arrays[:3]
    new_k, new_v = call.arrays[3:] if k is not None else (None, None)
    allowed = BF16_BITS if call.bfloat16 else INPUT_DTYPES
    for name, x in zip(named, call.arrays):
        shapes._check_dtype(name, x, allowed, arrays.accepted(INPUT_DTYPES, bfloat16=True))
    if len({np.dtype(x.dtype) for x in call.arrays}) > 1:
        raise TypeError("q, k_cache, v_cache (and k, v) must share one dtype, got "
                        + ", ".join(f"{n} {x.dtype}" for n, x in named.items()))
    batch, heads, n_q, d = _check_4d("q", q_, "(B, H, N_q, d)")
    paged = block_table is not None
    cache_text = "(num_pages, H_kv, page_size, d) with block_table" if paged else "(B, H_kv, N_max, d)"
    pages, heads_kv, page, d_k = _check_4d("k_cache", kc, cache_text)
    d_v = _check_4d("v_cache", vc, cache_text.replace(", d)", ", d_v)"))[3]
    if tuple(vc.shape[:3]) != tuple(kc.shape[:3]):
        raise ValueError(f"v_cache must have k_cache's first three axes {tuple(kc.shape[:3])} (its own head dim d_v "
                         f"may differ), got {tuple(vc.shape)}")
    if d_k != d:
        raise ValueError(f"k_cache must have head dim d = {d} (q's last axis), got {d_k}")
    if d == 0 or d > MAX_HEAD_DIM:
        raise ValueError(f"q must have head dim 1 <= d <= {MAX_HEAD_DIM}, got {d}")
    if d_v == 0 or d_v > MAX_HEAD_DIM:
        raise ValueError(f"v_cache must have head dim 1 <= d_v <= {MAX_HEAD_DIM}, got {d_v}")
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"k_cache's heads ({heads_kv}) must divide q's heads ({heads}) for GQA/MQA")
    if not paged and pages != batch:
        raise ValueError(f"k_cache must have batch {batch} (as q), got {pages}; a paged cache needs block_table")
    n_new = 0
    if new_k is not None:
        n_new = _check_4d("k", new_k, "(B, H_kv, N_new, d)")[2]
        for name, x, width, source in (("k", new_k, d, "d of q"), ("v", new_v, d_v, "d_v of v_cache")):
            want = (batch, heads_kv, n_new, width)
            if tuple(x.shape) != want:
                raise ValueError(f"{name} must have shape {want} (B of q, H_kv of the cache, {source}), got "
                                 f"{tuple(x.shape)}")
    _check_in_place(call, named, n_new)
    if paged:
        table = _host_ints("block_table", block_table, "(B, max_pages)")
        if table.ndim != 2 or table.shape[0] != batch or table.shape[1] == 0:
            raise ValueError(f"block_table must have shape (B, max_pages) = ({batch}, >= 1), got {table.shape}")
        capacity = table.shape[1] * page
    else:
        table = np.arange(batch, dtype=np.int64)[:, None]
        capacity = page
    if cache_seqlens is None:
        starts = np.full(batch, capacity - n_new, np.int64)
    else:
        starts = _host_ints("cache_seqlens", cache_seqlens, f"of shape ({batch},)")
        if starts.ndim == 0:
            starts = np.full(batch, int(starts), np.int64)
        if starts.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape ({batch},) (one length per request), got {starts.shape}")
    lengths = starts + n_new
    if (starts < 0).any():
        bad = int(np.argmax(starts < 0))
        raise ValueError(f"cache_seqlens must be >= 0, got cache_seqlens[{bad}] = {starts[bad]}")
    if (lengths > capacity).any():
        bad = int(np.argmax(lengths > capacity))
        raise ValueError(f"cache_seqlens[{bad}] + N_new = {starts[bad]} + {n_new} = {lengths[bad]} is over the "
                         f"cache's capacity of {capacity} keys per request"
                         + (f" ({table.shape[1]} pages of {page})" if paged else " (N_max)"))
    if lengths.max(initial=0) > MAX_SEQUENCE:
        raise ValueError(f"a request's length must be at most {MAX_SEQUENCE} keys")
    group = heads // heads_kv
    rows = n_q * group  # packed rows per (request, K/V head): r = t N_q + i
    block_k = None if block_k is None else shapes.check_block("block_k", block_k)
    kind = call.kind_of(q_)
    aligned = not call.on_device or all(aligned16(x) for x in (q_, kc, vc))  # host inputs: fresh device copies
    if engines.decode(engine, kind=kind, head_dim=d, block_k=block_k, aligned=aligned, value_dim=d_v) == "mma":
        layout = mma_decode.decode_split(kind, rows, d, block_k, d_v)  # a DecodeSplit: q and the caches as bits
    else:
        layout = kernels.decode_layout(rows, d, block_k, d_v)
    block_q, block_k = layout.block_q, layout.block_k
    if paged:
        if page % block_k:
            raise ValueError(f"k_cache's page_size ({page}) must be a multiple of block_k = {block_k} (a key tile "
                             f"never straddles two pages): use block_k dividing {page}")
        used = -(-lengths // page)  # pages each request's positions occupy
        for b in range(batch):
            entries = table[b, :used[b]]
            if ((entries < 0) | (entries >= pages)).any():
                p = int(np.argmax((entries < 0) | (entries >= pages)))
                raise ValueError(f"block_table[{b}, {p}] = {entries[p]} is not a page of the cache (0 .. "
                                 f"{pages - 1}); request {b} uses pages 0 .. {used[b] - 1} of its row")
    scale = shapes.resolve_scale(scale, d)
    causal = shapes.check_causal(causal)
    key_tiles = -(-int(lengths.max(initial=0)) // block_k)
    # at least one block: an empty batch (B = 0) still checks num_splits and split_size, by the rule of one request
    blocks = max(batch, 1) * heads_kv * -(-max(rows, 1) // block_q)
    splits = _resolve_splits(num_splits, split_size, blocks, key_tiles, layout)
    if batch == 0 or (n_q == 0 and not n_new):
        return _empty_results(call, batch, heads, n_q, d_v, return_lse)
    if n_q:
        backend.check_simulator_work(batch, heads, n_q, int(lengths.max()), max(d, d_v))
    _check_launches(batch, heads_kv, rows, n_new, block_q, splits.count)
    lohi = split_kv.row_intervals(lengths, n_q, group, causal, _interval_mask(mask))  # before anything is written
    sinks_ = None if sinks is None else sink_arrays.device_sinks(call, sinks, heads)
    # every check is above: from here on the caches are written
    with backend.explain_driver_errors(), backend.serialised(), call.context():
        table_dev = cuda.to_device(np.ascontiguousarray(table, dtype=np.int32), stream=call.stream)
        if n_new:
            _append(call, kc, vc, new_k, new_v, starts, table, table_dev, page)
        if n_q == 0:  # no query: appending the new keys and values was the whole call
            return _empty_results(call, batch, heads, n_q, d_v, return_lse)
        if call.on_device:
            q_dev, k_dev, v_dev = q_.reshape(batch, heads_kv, rows, d), kc, vc
        else:
            q_dev = cuda.to_device(np.ascontiguousarray(q_).reshape(batch, heads_kv, rows, d), stream=call.stream)
            k_dev, v_dev = (cuda.to_device(np.ascontiguousarray(x), stream=call.stream) for x in (kc, vc))
        if isinstance(layout, mma_decode.DecodeSplit) and not call.bfloat16:  # float16: the same 16 bits
            q_dev, k_dev, v_dev = (x.view(np.uint16) for x in (q_dev, k_dev, v_dev))
        o_split = cuda.device_array((batch, heads_kv * splits.count, rows, d_v), np.float32, stream=call.stream)
        lse_split = cuda.device_array((batch, heads_kv * splits.count, rows), np.float32, stream=call.stream)
        out = call.empty((batch, heads_kv, rows, d_v))
        lse = call.empty((batch, heads_kv, rows))
        kernels.run(q_dev, k_dev, v_dev, o_split, lse_split, out, lse, scale,
                    cuda.to_device(lengths.astype(np.int32), stream=call.stream), table_dev,
                    cuda.to_device(lohi, stream=call.stream), layout=layout,
                    tiles_per_split=splits.tiles, stream=call.stream)
        if sinks_ is not None:  # packed rows: row r of K/V head h_kv is query head h_kv g + r // N_q
            kernel_sinks.merge(out, lse, sinks_, rows_per_head=n_q, stream=call.stream)
        out = call.output(out, (batch, heads, n_q, d_v))
        return (out, call.output(lse, (batch, heads, n_q))) if return_lse else out


def _interval_mask(mask):
    """mask checked for decoding: None, or a masks mask whose rows see one interval each (its `row_intervals`
    at any size); a mask fixed to one size (documents, packed, a dense array) or per batch and head is refused
    by name."""
    _, mask = shapes.check_mask(False, mask)
    if mask is None:
        return None
    if (getattr(mask, "sliced", False) or mask.kernel_form() not in ("causal", "intervals")
            or isinstance(mask, (masks.Documents, packed.Varlen))):
        raise ValueError(f"mask must be one whose rows each see one interval of the cache at any length "
                         f"(masks.sliding_window, masks.prefix_lm, masks.causal), got {mask!r}")
    return mask


def _check_in_place(call, named: dict, n_new: int) -> None:
    """The arrays the call reads or writes in place can take it: on the device q and the caches C-contiguous
    (the kernels take C-layout arrays); with new keys, host caches writable (the append assigns into k_cache
    first, so NumPy would find a read-only v_cache only after k_cache was written)."""
    for name, x in zip(named, call.arrays):
        if name in ("k", "v"):
            continue
        if call.on_device and not x.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous on the device (make it .contiguous() first)")
        if n_new and name != "q" and not call.on_device and not np.asarray(x).flags.writeable:
            raise ValueError(f"{name} must be writable: the new keys and values k, v are written into the caches "
                             "in place")
    if n_new and _overlap(call.arrays[1], call.arrays[2]):
        raise ValueError("k_cache and v_cache must not share memory when k, v are given: the new keys and the "
                         "new values are written into them in place, and one would overwrite the other")


def _overlap(a, b) -> bool:
    """Whether two arrays share memory: host arrays by NumPy's bound, device ones by their byte ranges."""
    face_a, face_b = (getattr(x, "__cuda_array_interface__", None) for x in (a, b))
    if face_a is None or face_b is None:
        return face_a is None and face_b is None and np.may_share_memory(np.asarray(a), np.asarray(b))

    def span(x, face):
        start = face["data"][0]
        return start, start + x.size * np.dtype(x.dtype).itemsize  # C-contiguous (checked above)

    (a0, a1), (b0, b1) = span(a, face_a), span(b, face_b)
    return a.size > 0 and b.size > 0 and a0 < b1 and b0 < a1


def _check_launches(batch: int, heads_kv: int, rows: int, n_new: int, block_q: int, splits: int) -> None:
    """The grids of the append, split and combine launches (kernels.decode.append, run) fit CUDA's limits,
    checked before the append writes into the caches."""
    if n_new:
        check_grid((batch * heads_kv, n_new), ("batch * heads_kv", "new keys"), "cache append")
    check_grid((-(-rows // block_q) * splits, batch * heads_kv), ("ceil(R / block_q) * num_splits", "batch * heads_kv"),
               "decode split")
    check_grid((batch * heads_kv * rows,), ("batch * heads_kv * rows",), "decode combine")


def _append(call, kc, vc, new_k, new_v, starts, table, table_dev, page) -> None:
    """Write the new keys and values into the caches in place: on the host by NumPy assignment into the
    caller's own arrays (a CPU tensor's memory), on the device by a kernel (kernels.decode.append)."""
    if not call.on_device:
        n_new = new_k.shape[2]
        for b in range(len(starts)):
            positions = starts[b] + np.arange(n_new)
            slots = table[b, positions // page]
            for cache, new in ((kc, new_k), (vc, new_v)):
                cache[slots, :, positions % page, :] = np.swapaxes(np.asarray(new[b]), 0, 1)
        return
    starts_dev = cuda.to_device(starts.astype(np.int32), stream=call.stream)
    for cache, new in ((kc, new_k), (vc, new_v)):
        kernels.append(cache, new, starts_dev, table_dev, stream=call.stream)


def _empty_results(call, batch, heads, n_q, d_v, return_lse):
    """O (and LSE) of a problem with no query or no request: empty, float32, in the caller's library."""
    out = _empty(call, (batch, heads, n_q, d_v))
    return (out, _empty(call, (batch, heads, n_q))) if return_lse else out


def _empty(call, shape):
    """A float32 result with no element (B = 0 or N_q = 0), in the caller's library, without a launch."""
    host = np.zeros(tuple(shape), np.float32)
    if not call.on_device:
        return call.output_host(host)
    with call.context():
        return call.output(cuda.to_device(host, stream=call.stream), shape)
