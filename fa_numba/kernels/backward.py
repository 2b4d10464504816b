"""The backward pass with recomputation (proofs/L7): dQ, dK, dV from Q, K, V, O, LSE and dO, never storing P.

    D_i = rowsum(dO_i o O_i),  P_ij = exp(S_ij - sigma(LSE_i)) (0 where masked),  dV_j = sum_i P_ij dO_i,
    dP_ij = dO_i . V_j,  dS_ij = P_ij (dP_ij - D_i),  dQ_i = scale sum_j dS_ij K_j,  dK_j = scale sum_i dS_ij Q_i

with sigma(LSE) = 0 on a row that sees no key (LSE = -inf), whose P is all zeros (it is masked everywhere):
its gradient is exactly zero. Non-finite inputs (NaN, +-inf) follow the forward's rule (proofs/L7.8, as
L2.6 and L3.5 for the forward): a pair is masked by the mask, never by a value, and a masked pair is never
multiplied. SKIP tiles are never loaded, FULL tiles hold no masked pair, rows and keys past N are loaded
as zeros, and a PARTIAL tile stores P = -0.0 at its masked pairs (exp never returns -0.0) and takes the
guarded products, which skip them: dQ_i depends only on Q_i, dO_i and the K, V rows row i sees, dK_j and
dV_j only on the rows that see key j. A NaN reaches exactly those gradients, every other entry is bit for
bit the one without it, and where the dense float64 gradients are NaN the kernels' are too. Cost of the
guard, PARTIAL tiles only: one more shared load (P beside dS) per reduction step and row of the
micro-tile and a predicated FMA; in dq-only mode those tiles also store P.

Kernels (each a `CompiledBackward`, HBM traffic in elements per (batch, head); tiled.attention_backward and
iomodel.traffic_backward give the same counts, and the simulator's counted accesses equal them):
- `preprocess`: D = rowsum(dO o O) per query row (reads O, dO: N_q d each; writes D: N_q), and with
  zero_dq dQ = 0 (writes N_q d), or with zero_kv dK = dV = 0 (writes N_k d each per K/V head).
- `kv` (K/V outer, FlashAttention-2's backward): one block per (key tile j, batch, K/V head). K_j, V_j are
  read once; dK_j, dV_j stay in registers while the block walks the query heads of its group and their
  query tiles that see j (the forward's I_j rule), reading Q_i, dO_i, LSE_i, D_i per visit; dK_j, dV_j
  are written once. dQ is either added into HBM per visit (atomic add: a read and a write of r_i d) or,
  deterministic, left to the `q` kernel in its dq-only mode.
- `q` (Q outer): one block per (query tile i, batch, query head); Q_i, dO_i, LSE_i, D_i read once, dQ_i in
  registers, K_j and V_j read per visible tile, dQ_i written once. In dq-only mode (the deterministic dQ
  of order "kv") that is all; as order "q" it also adds dK_j and dV_j into HBM per visit (atomic adds: a
  read and a write of c_j d each), after `preprocess` zeroed them.
The deterministic mode recomputes S, P and dP a second time in the dq-only pass: 3 more matrix products
per tile (7 in all, against 5) and K, V read once per query tile, for bitwise-repeatable dQ.

A value head dim of its own (d_v != d, `BackwardConfig.value_dim`): V, O, dO and dV have d_v columns (each count
of them above has d_v where it says d), Q, K, dQ and dK keep d; the tiles are staged D = max(d, d_v) wide (rounded
up to the threads' side), each operand zero past its own width, so the zero columns add 0 x 0 terms to S and
dP and give gradient columns that are never written. With value_dim = 0 the kernels compile the code of d_v = d.

Thread layout: square tiles B_r = B_c = B; T = side^2 threads, side = B / t; thread (ty, tx) owns a t x t
micro-tile of S and dP, interleaved (query rows ty + side a, key columns tx + side c), and TD = D / side
features of the B x D products (runs of `BackwardConfig.run`, the side threads' runs side by side): dV_j and
dK_j (key rows ty t..), dQ_i (query rows ty + side a, as S). Shared memory holds Q, dO, K, V row-major with
rows of D + 4 floats (16-byte aligned, an odd number of 16-byte units) and P, dS as B x PS
(`BackwardConfig.p_stride`); with these, at the shipped tiles, one warp's access meets each bank once
(tests/test_smem_costs.py counts it). Every matrix product is one `make_gemm` loop over its reduction index
with register micro-tiles, like the forward engine's.

Limits: FP32 CUDA cores; B = 32 up to d = 64, 16 up to 128, 8 up to 256 (static shared memory <= 48 KB);
block_q must equal block_k.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, uint64 as u64

from fa_numba import backend, banks, warp
from fa_numba.kernels import disk_cache, sinks
from fa_numba.kernels.block_lists import LIST_FORMS, PAIR_FORMS
from fa_numba.kernels.common import (NEG_INF, SHARED_BYTES_LIMIT, ZERO, CompiledKernel, ValueDim,
                                     check_grid, check_mask_form, check_sequence, mask_arrays, to_f32)
from fa_numba.tiling import PARTIAL
from fa_numba.kernels.engine import NEG_ZERO, ONE, UNROLL_BUDGET
from fa_numba.kernels.mask_mod import mask_slice, pair_visible
from fa_numba.kernels.score_mod import NO_CAPTURED, KernelMod, apply_fn, apply_grad, has_scores, tuple_type
from fa_numba.kernels.tile_loads import row_tile_loader, rows_from

PAD = 4  # floats added to every shared-memory row: keeps rows 16-byte aligned
FLOAT_BYTES = 4
# (largest head dim, (B, t)) : square tiles of B rows and keys, t x t micro-tiles of S per thread
DEFAULTS = ((64, (32, 4)), (128, (16, 2)), (256, (8, 1)))
PRE_THREADS = 128  # one query row per thread in `preprocess`
IN_FLIGHT = 8  # global loads a thread keeps in flight while loading a tile (registers held until stored)


def default_backward_tiles(head_dim: int) -> tuple[int, int]:
    """(B, t) of the first DEFAULTS row whose head dim bound holds d."""
    for bound, config in DEFAULTS:
        if head_dim <= bound:
            return config
    raise ValueError(f"head dim d must be <= {DEFAULTS[-1][0]}, got {head_dim}")


def micro_for(block: int, head_dim: int) -> int:
    """t: the shipped micro-tile for the default tile of d, else the largest of 4, 2, 1 dividing B."""
    if head_dim <= DEFAULTS[-1][0] and default_backward_tiles(head_dim)[0] == block:
        return default_backward_tiles(head_dim)[1]
    return next(t for t in (4, 2, 1) if block % t == 0)


@dataclass(frozen=True)
class BackwardConfig(ValueDim):
    """One compiled backward specialisation: its kind ("preprocess", "kv", "q"), tile, head dim, masking
    and flags (kv: deterministic; q: dq_only; preprocess: zero_dq, zero_kv)."""

    kind: str
    block: int
    head_dim: int
    causal: bool
    flag: bool = False
    mask_form: str = "none"  # "none" / "causal" (closed forms) or a block mask's "intervals" / "dense" / "function"
    mod: KernelMod | None = None  # a score mod compiled into kv and q (kernels.score_mod), with its grad
    value_dim: int = 0  # d_v, V's, O's, dO's and dV's head dim where it differs from d; 0: head_dim

    @property
    def lists(self) -> bool:
        return self.mask_form in LIST_FORMS

    @property
    def t(self) -> int:
        return micro_for(self.block, max(self.head_dim, self.d_v))

    @property
    def side(self) -> int:  # threads per side of the block: RY = CX = B / t
        return self.block // self.t

    @property
    def threads(self) -> int:
        return PRE_THREADS if self.kind == "preprocess" else self.side * self.side

    @property
    def d_pad(self) -> int:
        """D: max(d, d_v) rounded up to a multiple of the side; Q, dO, K and V are staged D wide, each zero
        past its own head dim (d_v != d: the zero columns add 0 x 0 terms to S and dP, and give dQ, dK, dV
        columns that are never written)."""
        return -(-max(self.head_dim, self.d_v) // self.side) * self.side

    @property
    def run(self) -> int:
        """The features a thread owns side by side in a B x D product (`feature_column`): 4 (one 16-byte
        load) where its TD = D / side features divide into fours, else 2 or 1."""
        td = self.d_pad // self.side
        return next(r for r in (4, 2, 1) if td % r == 0)

    def _store_p_wavefronts(self, stride: int) -> int:
        """Wavefronts (banks' rule) of `probabilities`' P / dS stores for the first warp, rows `stride` floats
        apart: lane (ty, tx) writes element (ty + side a, tx + side c), one store per (a, c)."""
        side = self.side
        lanes = [divmod(lane, side) for lane in range(min(banks.WARP, self.threads))]
        return sum(banks.wavefronts([4 * ((ty + side * a) * stride + tx + side * c) for ty, tx in lanes], 4, "store")
                   for a in range(self.t) for c in range(self.t))

    @functools.cached_property
    def p_stride(self) -> int:
        """PS, the row of P and dS in floats: B + PAD, or padded by fours to the stride whose stores cost the
        fewest wavefronts (the least padding of ties; as the forward's `Layout.p_stride`), if it still fits
        the shared-memory limit."""
        best = min((self.block + PAD + 4 * i for i in range(banks.WARP // 4)), key=self._store_p_wavefronts)
        fits = sum(self._sizes(best).values()) * FLOAT_BYTES <= SHARED_BYTES_LIMIT
        return best if fits else self.block + PAD

    def _sizes(self, ps: int) -> dict[str, int]:
        qs, b = self.d_pad + PAD, self.block
        return {"q": b * qs, "do": b * qs, "k": b * qs, "v": b * qs, "p": b * ps, "ds": b * ps, "lse": b, "dd": b}

    @property
    def offsets(self) -> dict[str, int]:
        sizes = self._sizes(self.p_stride)
        offsets, end = {}, 0
        for name, size in sizes.items():
            offsets[name] = end
            end += size
        return {**offsets, "_total": end}

    @property
    def shared_bytes(self) -> int:
        return 0 if self.kind == "preprocess" else self.offsets["_total"] * FLOAT_BYTES

    def check(self) -> "BackwardConfig":
        for name in ("block", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.value_dim, bool) or not isinstance(self.value_dim, int) or self.value_dim < 0:
            raise ValueError(f"value_dim must be an int >= 0 (0: head_dim), got {self.value_dim!r}")
        check_mask_form(self.mask_form, self.causal)
        if self.threads > 1024:
            raise ValueError(f"block_q = block_k = {self.block} gives {self.threads} threads per block, over 1024")
        if self.shared_bytes > SHARED_BYTES_LIMIT:
            raise ValueError(f"block_q = block_k = {self.block} with d = {self.head_dim} needs {self.shared_bytes} bytes "
                             f"of shared memory for Q, dO, K, V, P and dS, over the {SHARED_BYTES_LIMIT}-byte static "
                             f"limit: use block_q = block_k = {default_backward_tiles(self.head_dim)[0]}")
        return self


def make_gemm(MA, MB, KLEN, A_RS, A_KS, B_CS, B_KS, guarded=False, B_RUN=0, B_GS=0):
    """acc[a, e] += sum_{k < KLEN} A(k, a) B(k, e), A(k, a) = smem[a_base + a A_RS + k A_KS] and
    B(k, e) = smem[b_base + col(e) + k B_KS]: one register micro-tile of a product of two shared tiles.
    col(e) = e B_CS, or with B_RUN (> 0) the columns in runs of B_RUN, B_GS apart:
    col(e) = (e // B_RUN) B_GS + (e % B_RUN) B_CS (`feature_column`); compile-time offsets either way.

    guarded (PARTIAL tiles only): gemm(smem, acc, a_base, b_base, g_base) forms the products of (k, a) only
    where the guard G(k, a) = smem[g_base + a A_RS + k A_KS] (P of the same pair, laid out like A) is not
    the -0.0 that `probabilities` marks a masked pair with; exp never returns -0.0, so a visible weight
    (+0.0 by underflow, or NaN) is always multiplied. A masked pair's A is 0, but its B row (Q_i, dO_i or
    K_j) may be NaN, and 0 x NaN = NaN would reach a row or key that cannot see it (L7.8). The sum is
    taken in the same order as unguarded: on finite inputs the two differ at most in the sign of a zero.

    The reduction runs in chunks of STEP (an inner loop the compiler unrolls; see engine.make_engine)."""
    loads = MA * MB + (2 * MA if guarded else MA) + MB
    RUN = B_RUN if B_RUN > 0 else MB
    STEP = next((t for t in (8, 4, 2) if KLEN % t == 0 and t * loads <= UNROLL_BUDGET), 1)  # >= 1 step

    if guarded:
        @cuda.jit(device=True, inline=True)
        def gemm_guarded(smem, acc, a_base, b_base, g_base):
            af = cuda.local.array(MA, float32)
            bf = cuda.local.array(MB, float32)
            gf = cuda.local.array(MA, float32)
            av = smem[u64(a_base):]
            bv = smem[u64(b_base):]
            gv = smem[u64(g_base):]
            k0 = 0
            while k0 < KLEN:  # invariant: acc holds its start plus the terms of the visible pairs of k < k0 (L7.8)
                for ki in range(STEP):
                    k = k0 + ki
                    for a in range(MA):
                        af[a] = av[u64(a * A_RS + k * A_KS)]
                        gf[a] = gv[u64(a * A_RS + k * A_KS)]
                    for e in range(MB):
                        bf[e] = bv[u64((e // RUN) * B_GS + (e % RUN) * B_CS + k * B_KS)]
                    for a in range(MA):
                        if gf[a] != ZERO or math.copysign(ONE, gf[a]) > ZERO:  # not the -0.0 of a masked pair
                            for e in range(MB):
                                acc[a, e] += af[a] * bf[e]
                k0 += STEP

        return gemm_guarded

    @cuda.jit(device=True, inline=True)
    def gemm(smem, acc, a_base, b_base):
        af = cuda.local.array(MA, float32)
        bf = cuda.local.array(MB, float32)
        av = smem[u64(a_base):]
        bv = smem[u64(b_base):]
        k0 = 0
        while k0 < KLEN:  # invariant: acc holds its start plus the terms of k < k0 (L7: sums over any partition)
            for ki in range(STEP):
                k = k0 + ki
                for a in range(MA):
                    af[a] = av[u64(a * A_RS + k * A_KS)]
                for e in range(MB):
                    bf[e] = bv[u64((e // RUN) * B_GS + (e % RUN) * B_CS + k * B_KS)]
                for a in range(MA):
                    for e in range(MB):
                        acc[a, e] += af[a] * bf[e]
            k0 += STEP

    return gemm


def _kernel_parts(config: BackwardConfig):
    """The device functions and constants a kv or q kernel of this configuration is built from."""
    B, D, t, side = config.block, config.d_pad, config.t, config.side
    TD, T, QS, PS, RUN = D // side, config.threads, D + PAD, config.p_stride, config.run
    off = config.offsets
    Q, DO, K, V = off["q"], off["do"], off["k"], off["v"]  # closed over by the device functions below
    P, DS, LSE, DD = off["p"], off["ds"], off["lse"], off["dd"]
    parts = dict(B=B, D=D, t=t, side=side, TD=TD, T=T, QS=QS, PS=PS, RUN=RUN, SMEM=off["_total"], Q=off["q"],
                 DO=off["do"], K=off["k"], V=off["v"], P=off["p"], DS=off["ds"], LSE=off["lse"], DD=off["dd"])
    # Who owns what (a warp is 32 / side rows ty of side threads tx), for shared memory's banks:
    # - S, dP: thread (ty, tx) owns query rows ty + side a and keys tx + side c (a, c < t), interleaved: the side
    #   threads of a row ty read side consecutive rows of K or V, QS / 4 (odd) 16-byte units apart, so one load
    #   meets every bank once (with t consecutive rows a thread, tx t + c, 8 threads met 2 of a row's 8
    #   16-byte slots at t = 4: 4-way). dQ's rows are S's.
    # - dK, dV: key rows ty t + a (P^T, dS^T read t consecutive keys of one row of P, dS: one vector load).
    # - features of the B x D products: runs of RUN (one vector load), the side threads' runs side by side
    #   (`feature_column`): their loads of a row of Q, dO or K cover consecutive bytes.
    parts["gemm_rows"] = make_gemm(t, t, D, side * QS, 1, side * QS, 1)  # S, dP: Q / dO rows by K / V rows
    columns = dict(B_RUN=RUN, B_GS=side * RUN)
    # dV, dK (t x TD, key rows): P or dS [r][c] against dO or Q [r][x], reduced over the query rows
    parts["gemm_keys"] = make_gemm(t, TD, B, 1, PS, 1, QS, **columns)
    # dQ (t x TD, query rows ty + side a): dS [r][c] against K [c][x], reduced over the keys
    parts["gemm_queries"] = make_gemm(t, TD, B, side * PS, 1, 1, QS, **columns)
    # the same two in PARTIAL tiles, skipping the masked pairs (their guard: P, marked -0.0 there)
    parts["gemm_keys_guarded"] = make_gemm(t, TD, B, 1, PS, 1, QS, guarded=True, **columns)
    parts["gemm_queries_guarded"] = make_gemm(t, TD, B, side * PS, 1, 1, QS, guarded=True, **columns)

    GS = side * RUN

    @cuda.jit(device=True, inline=True)
    def feature_column(tx, e):
        """The feature of column e < TD of thread column tx in a B x D product: runs of RUN features a
        thread, the side threads' runs side by side (gemm's col(e) with B_RUN = RUN, B_GS = side RUN)."""
        return tx * RUN + (e // RUN) * GS + e % RUN

    def adder(ROW_STEP, HDX, SCALED):
        """add(dst, b, h, row0, first, rows, tx, part, scale): atomically dst[b, h, row0 + first + ROW_STEP a,
        feature_column(tx, e)] += part[a, e] (times scale if SCALED) for rows below `rows` and features below
        HDX, dst's head dim (compile-time: the kernel's d or d_v). Where dst is C-contiguous, through one line
        from the thread's first element (`rows_from`): each add is a compile-time offset along it, not a 4-d
        index with run-time strides (12-15 instructions an add at d = 64, 32 adds a visit)."""
        UNPADDED = D == HDX  # every feature a thread owns is below HDX: the check is compiled out

        @cuda.jit(device=True, inline=True)
        def add(dst, b, h, row0, first, rows, tx, part, scale):
            flat = not warp.strided(dst)  # a compile-time constant on the GPU
            # clamped so that the line starts inside dst; a thread whose first row or feature is past the
            # edge adds nothing (its other rows and features are further past it)
            line = rows_from(dst, b, h, u64(row0 + min(first, rows - 1)), u64(min(tx * RUN, HDX - 1)))
            for a in range(t):
                if first + ROW_STEP * a < rows:
                    for e in range(TD):
                        x = feature_column(tx, e)
                        if UNPADDED or x < HDX:
                            value = scale * part[a, e] if SCALED else part[a, e]
                            if flat:
                                cuda.atomic.add(line, u64(ROW_STEP * a * HDX + feature_column(0, e)), value)
                            else:
                                cuda.atomic.add(dst, (u64(b), u64(h), u64(row0 + first + ROW_STEP * a), u64(x)),
                                                value)

        return add

    # kv: dQ_i's rows of S (ty + side a); q: dK_j's and dV_j's key rows (ty t + a)
    add_dq = adder(side, config.head_dim, True)
    add_dk, add_dv = adder(1, config.head_dim, True), adder(1, config.d_v, False)

    # Q_i, K_j (d features) and V_j, dO_i (d_v), into rows of QS floats: kernels.tile_loads.row_tile_loader
    load_qk = row_tile_loader(B, D, QS, T, config.head_dim, IN_FLIGHT)
    load_vo = row_tile_loader(B, D, QS, T, config.d_v, IN_FLIGHT)

    STATS_STEPS = -(-B // T)

    @cuda.jit(device=True, inline=True)
    def load_stats(lse, dvec, b, h, row0, rows, smem, tid):
        """sigma(LSE_i) (0 where LSE = -inf: a row that sees no key) and D_i of the tile's rows, 0 past N_q.
        Row tid + step T at each of a compile-time number of steps (one at the shipped tiles: B <= T), not a
        run-time loop from tid (ptxas unrolled that four times, 180 instructions a visit at d = 64)."""
        for step in range(STATS_STEPS):
            r = tid + step * T
            if r < B:
                shift = ZERO
                dd = ZERO
                if r < rows:
                    value = lse[b, h, row0 + r]
                    shift = value if value != NEG_INF else ZERO
                    dd = dvec[b, h, row0 + r]
                smem[u64(LSE + r)] = shift
                smem[u64(DD + r)] = dd

    MOD = has_scores(config.mod)
    modded, slope = apply_fn(config.mod), apply_grad(config.mod)  # fn and d fn / d score (identity, 1 without)
    pair = pair_visible(config.mod)  # a PARTIAL tile's pair test: the dense byte mask or a mask_mod

    @cuda.jit(device=True, inline=True)
    def probabilities(smem, s, dp, ty, tx, r0, rows, c0, cols, delta, causal, partial_lists, lohi, use_dense, dense,
                      scale, marked, store_p, b, h, captured):
        """s := P = exp(scale S - sigma(LSE)) and dp := dS = P (dP - D) on the thread's micro-tile, both 0 at
        masked pairs (causal, or in a PARTIAL tile of a block mask the row's interval and, dense or mask_mod, `pair`)
        and past the tile's rows and keys; dS (and P if store_p or marked) go to shared memory [r][c].
        marked (a PARTIAL tile): P is stored as -0.0 at every pair that is not visible, the guard of the
        guarded products (exp never returns -0.0: a visible weight that underflowed is +0.0).
        With a score mod (proofs/L13): P = exp(mod(scale S) - sigma(LSE)) and dS = P (dP - D) mod'(scale S),
        the mod and its derivative called at the visible pairs only, at (b, h, r0 + r, c0 + col)."""
        for a in range(t):
            r = ty + side * a
            shift = smem[u64(LSE + r)]
            dd = smem[u64(DD + r)]
            for c in range(t):
                col = tx + side * c
                visible = r < rows and col < cols and (not causal or c0 + col <= r0 + r + delta)
                if visible and partial_lists:
                    key = c0 + col
                    visible = lohi[r0 + r, 0] <= key and key < lohi[r0 + r, 1]
                    if visible and use_dense:
                        visible = pair(dense, b, h, r0 + r, key, captured)
                p = ZERO
                ds = ZERO
                if visible:
                    x = scale * s[a, c]
                    if MOD:  # the forward's S' = mod(S), rounded to float32 as there; then the chain rule
                        p = math.exp(modded(x, b, h, r0 + r, c0 + col, captured) - shift)
                        ds = p * (dp[a, c] - dd) * slope(x, b, h, r0 + r, c0 + col, captured)
                    else:
                        p = math.exp(x - shift)  # <= 0 exponent: S <= LSE on a visible pair
                        ds = p * (dp[a, c] - dd)
                elif marked:
                    p = NEG_ZERO
                s[a, c] = p
                dp[a, c] = ds
                smem[u64(DS + r * PS + col)] = ds
                if store_p or marked:
                    smem[u64(P + r * PS + col)] = p

    gemm_rows = parts["gemm_rows"]

    @cuda.jit(device=True, inline=True)
    def recompute(smem, s, dp, ty, tx, r0, rows, c0, cols, delta, causal, partial_lists, lohi, use_dense, dense, scale,
                  marked, store_p, b, h, captured):
        """S and dP of the thread's micro-tile from the tiles in shared memory, then P and dS
        (`probabilities`): the tile's recomputation, the same in every backward kernel."""
        for a in range(t):
            for c in range(t):
                s[a, c] = ZERO
                dp[a, c] = ZERO
        gemm_rows(smem, s, Q + ty * QS, K + tx * QS)  # S / scale
        gemm_rows(smem, dp, DO + ty * QS, V + tx * QS)  # dP
        probabilities(smem, s, dp, ty, tx, r0, rows, c0, cols, delta, causal, partial_lists, lohi, use_dense, dense,
                      scale, marked, store_p, b, h, captured)

    parts.update(load_qk=load_qk, load_vo=load_vo, load_stats=load_stats, recompute=recompute,
                 feature_column=feature_column, add_dq=add_dq, add_dk=add_dk, add_dv=add_dv)
    return parts


def kv_source(config: BackwardConfig):
    """The K/V-outer backward kernel (FlashAttention-2's): dK_j, dV_j on chip, dQ added into HBM unless
    deterministic (config.flag), when the q kernel computes dQ instead."""
    p = _kernel_parts(config)
    B, t, side, TD, PS, RUN = p["B"], p["t"], p["side"], p["TD"], p["PS"], p["RUN"]
    SMEM, Q, DO, K, V, P, DS = p["SMEM"], p["Q"], p["DO"], p["K"], p["V"], p["P"], p["DS"]
    gemm_keys, gemm_queries = p["gemm_keys"], p["gemm_queries"]
    gemm_keys_guarded, gemm_queries_guarded = p["gemm_keys_guarded"], p["gemm_queries_guarded"]
    load_qk, load_vo, load_stats, recompute = p["load_qk"], p["load_vo"], p["load_stats"], p["recompute"]
    feature_column, add_dq = p["feature_column"], p["add_dq"]
    CAUSAL, DETERMINISTIC = config.causal, config.flag
    LISTS, DENSE, PARTIAL_KIND = config.lists, config.mask_form in PAIR_FORMS, int(PARTIAL)
    VALUE_DIM = config.value_dim != 0  # V's head dim its own (compile-time: else the code of d_v = d, unchanged)

    def flash_backward_kv(q, k, v, dout, lse, dvec, dq, dk, dv, scale, row_ptrs, col_idxs, col_kinds, col_ptrs,
                          row_idxs, row_kinds, lohis, denses, captured):
        j = cuda.blockIdx.x  # key tile
        bhk = cuda.blockIdx.y  # (batch, K/V head)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * side + tx
        heads, n_q, n_k, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
        d_v = v.shape[3] if VALUE_DIM else d
        heads_kv = k.shape[1]
        group = heads // heads_kv
        b = bhk // heads_kv
        h_kv = bhk - b * heads_kv
        delta = n_k - n_q
        t_r = (n_q + B - 1) // B
        c0 = j * B
        cols = min(B, n_k - c0)
        # The query tiles that visit key tile j, in increasing i; the rest are SKIP (L3): with causal masking
        # I_j .. T_r - 1 (iomodel's closed form), with a block mask the list row_idx[col_ptr[j]:col_ptr[j + 1]]
        # of each query head's own mask slice (kernels.mask_mod.mask_slice: the heads of a group may differ).
        start = 0
        stop = t_r
        if CAUSAL:
            start = min(max(-((-(c0 + 1 - delta)) // B) - 1, 0), t_r - 1)
        visited = stop > start
        col_ptr, row_idx, row_kind = (mask_slice(col_ptrs, b, h_kv * group), mask_slice(row_idxs, b, h_kv * group),
                                      mask_slice(row_kinds, b, h_kv * group))
        lohi, dense = mask_slice(lohis, b, h_kv * group), mask_slice(denses, b, h_kv * group)
        if LISTS:
            visited = False
            for hq in range(group):
                col_ptr = mask_slice(col_ptrs, b, h_kv * group + hq)
                visited = visited or col_ptr[j + 1] > col_ptr[j]

        smem = cuda.shared.array(SMEM, float32)  # Q | dO | K | V | P | dS | sigma(LSE) | D (offsets in config)
        s = cuda.local.array((t, t), float32)  # S, then P: registers
        dp = cuda.local.array((t, t), float32)  # dP, then dS: registers
        dk_acc = cuda.local.array((t, TD), float32)  # dK_j: registers for the whole block
        dv_acc = cuda.local.array((t, TD), float32)  # dV_j: registers for the whole block
        dq_part = cuda.local.array((t, TD), float32)
        for a in range(t):
            for e in range(TD):
                dk_acc[a, e] = ZERO
                dv_acc[a, e] = ZERO

        if visited:  # a key tile no query tile sees is never read
            load_qk(k, b, h_kv, c0, cols, smem, K, tid)  # K_j: read once
            load_vo(v, b, h_kv, c0, cols, smem, V, tid)  # V_j: read once
        for hq in range(group):  # the query heads that read K/V head h_kv
            h = h_kv * group + hq
            if LISTS:  # this query head's mask slice
                col_ptr, row_idx, row_kind = (mask_slice(col_ptrs, b, h), mask_slice(row_idxs, b, h),
                                              mask_slice(row_kinds, b, h))
                lohi, dense = mask_slice(lohis, b, h), mask_slice(denses, b, h)
                start = col_ptr[j]
                stop = col_ptr[j + 1]
            for idx in range(start, stop):  # invariant: dK_j, dV_j hold the terms of the visits so far (L7)
                i = row_idx[idx] if LISTS else idx
                partial_lists = LISTS and row_kind[idx] == PARTIAL_KIND
                r0 = i * B
                rows = min(B, n_q - r0)
                # every thread has finished the last visit's products (reads of Q, dO, P, dS) before they are
                # overwritten
                cuda.syncthreads()
                load_qk(q, b, h, r0, rows, smem, Q, tid)  # Q_i: read per visit
                load_vo(dout, b, h, r0, rows, smem, DO, tid)  # dO_i: read per visit
                load_stats(lse, dvec, b, h, r0, rows, smem, tid)  # LSE_i, D_i: read per visit
                # Q_i, dO_i, LSE_i, D_i (and on the first visit K_j, V_j) are complete before any thread reads them
                cuda.syncthreads()
                # a PARTIAL tile (a masked pair inside it; causal: its last key is past its first row's
                # horizon) takes the guarded products, a FULL tile the fast unguarded ones (L7.8)
                marked = partial_lists or (CAUSAL and c0 + cols - 1 > r0 + delta)
                recompute(smem, s, dp, ty, tx, r0, rows, c0, cols, delta, CAUSAL, partial_lists, lohi,
                          DENSE and partial_lists, dense, scale, marked, True, b, h, captured)
                # P and dS are complete in shared memory before the products read them
                cuda.syncthreads()
                if marked:
                    gemm_keys_guarded(smem, dv_acc, P + ty * t, DO + tx * RUN, P + ty * t)  # dV_j += P^T dO_i
                    gemm_keys_guarded(smem, dk_acc, DS + ty * t, Q + tx * RUN, P + ty * t)  # dK_j += dS^T Q_i
                else:
                    gemm_keys(smem, dv_acc, P + ty * t, DO + tx * RUN)  # dV_j += P^T dO_i
                    gemm_keys(smem, dk_acc, DS + ty * t, Q + tx * RUN)  # dK_j += dS^T Q_i (scale at the end)
                if not DETERMINISTIC:
                    for a in range(t):
                        for e in range(TD):
                            dq_part[a, e] = ZERO
                    if marked:
                        gemm_queries_guarded(smem, dq_part, DS + ty * PS, K + tx * RUN, P + ty * PS)
                    else:
                        gemm_queries(smem, dq_part, DS + ty * PS, K + tx * RUN)  # dS K_j
                    add_dq(dq, b, h, r0, ty, rows, tx, dq_part, scale)  # dQ_i += scale dS K_j
        for a in range(t):  # dK_j, dV_j written once
            c = ty * t + a
            if c < cols:
                for e in range(TD):
                    x = feature_column(tx, e)
                    if x < d:
                        dk[b, h_kv, c0 + c, x] = scale * dk_acc[a, e]
                    if x < d_v:
                        dv[b, h_kv, c0 + c, x] = dv_acc[a, e]

    return flash_backward_kv


def q_source(config: BackwardConfig):
    """The Q-outer backward kernel: dQ_i on chip and written once; with config.flag (dq_only) that is all
    (the deterministic dQ of order kv), else dK, dV are added into HBM per visit (order q)."""
    p = _kernel_parts(config)
    B, t, side, TD, PS, RUN = p["B"], p["t"], p["side"], p["TD"], p["PS"], p["RUN"]
    SMEM, Q, DO, K, V, P, DS = p["SMEM"], p["Q"], p["DO"], p["K"], p["V"], p["P"], p["DS"]
    gemm_keys, gemm_queries = p["gemm_keys"], p["gemm_queries"]
    gemm_keys_guarded, gemm_queries_guarded = p["gemm_keys_guarded"], p["gemm_queries_guarded"]
    load_qk, load_vo, load_stats, recompute = p["load_qk"], p["load_vo"], p["load_stats"], p["recompute"]
    feature_column, add_dk, add_dv = p["feature_column"], p["add_dk"], p["add_dv"]
    CAUSAL, DQ_ONLY = config.causal, config.flag
    LISTS, DENSE, PARTIAL_KIND = config.lists, config.mask_form in PAIR_FORMS, int(PARTIAL)

    def flash_backward_q(q, k, v, dout, lse, dvec, dq, dk, dv, scale, row_ptrs, col_idxs, col_kinds, col_ptrs,
                         row_idxs, row_kinds, lohis, denses, captured):
        i = cuda.blockIdx.x  # query tile
        bh = cuda.blockIdx.y  # (batch, query head)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * side + tx
        heads, n_q, n_k, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
        b = bh // heads
        h = bh - b * heads
        h_kv = h // (heads // k.shape[1])
        row_ptr, col_idx, col_kind = mask_slice(row_ptrs, b, h), mask_slice(col_idxs, b, h), mask_slice(col_kinds, b, h)
        lohi, dense = mask_slice(lohis, b, h), mask_slice(denses, b, h)  # this (batch, head)'s mask
        delta = n_k - n_q
        r0 = i * B
        rows = min(B, n_q - r0)
        # The key tiles this query tile visits, in increasing j; the rest are SKIP (L3): with causal masking
        # 0 .. j_end - 1, with a block mask the list col_idx[row_ptr[i]:row_ptr[i + 1]].
        start = 0
        stop = (n_k + B - 1) // B
        if CAUSAL:
            last_key = r0 + rows - 1 + delta
            stop = min(stop, last_key // B + 1) if last_key >= 0 else 0
        if LISTS:
            start = row_ptr[i]
            stop = row_ptr[i + 1]

        smem = cuda.shared.array(SMEM, float32)
        s = cuda.local.array((t, t), float32)
        dp = cuda.local.array((t, t), float32)
        dq_acc = cuda.local.array((t, TD), float32)  # dQ_i: registers for the whole block
        part = cuda.local.array((t, TD), float32)
        for a in range(t):
            for e in range(TD):
                dq_acc[a, e] = ZERO
        if stop > start:  # a query tile that sees no key reads nothing and writes dQ_i = 0
            load_qk(q, b, h, r0, rows, smem, Q, tid)  # Q_i: read once
            load_vo(dout, b, h, r0, rows, smem, DO, tid)  # dO_i: read once
            load_stats(lse, dvec, b, h, r0, rows, smem, tid)  # LSE_i, D_i: read once
        for idx in range(start, stop):  # invariant: dQ_i holds the terms of the visited key tiles so far (L7)
            j = col_idx[idx] if LISTS else idx
            partial_lists = LISTS and col_kind[idx] == PARTIAL_KIND
            c0 = j * B
            cols = min(B, n_k - c0)
            # every thread has finished the last tile's products (reads of K, V, P, dS) before they are overwritten
            cuda.syncthreads()
            load_qk(k, b, h_kv, c0, cols, smem, K, tid)  # K_j: read per visit
            load_vo(v, b, h_kv, c0, cols, smem, V, tid)  # V_j: read per visit
            # K_j, V_j (and Q_i, dO_i, LSE_i, D_i) are complete before any thread reads them
            cuda.syncthreads()
            # a PARTIAL tile takes the guarded products (P is stored there even in dq-only mode: their
            # guard), a FULL tile the unguarded ones (L7.8)
            marked = partial_lists or (CAUSAL and c0 + cols - 1 > r0 + delta)
            recompute(smem, s, dp, ty, tx, r0, rows, c0, cols, delta, CAUSAL, partial_lists, lohi,
                      DENSE and partial_lists, dense, scale, marked, not DQ_ONLY, b, h, captured)
            # dS (and P) are complete in shared memory before the products read them
            cuda.syncthreads()
            if marked:
                gemm_queries_guarded(smem, dq_acc, DS + ty * PS, K + tx * RUN, P + ty * PS)
            else:
                gemm_queries(smem, dq_acc, DS + ty * PS, K + tx * RUN)  # dQ_i += dS K_j (scale at the end)
            if not DQ_ONLY:
                for a in range(t):
                    for e in range(TD):
                        part[a, e] = ZERO
                if marked:
                    gemm_keys_guarded(smem, part, DS + ty * t, Q + tx * RUN, P + ty * t)
                else:
                    gemm_keys(smem, part, DS + ty * t, Q + tx * RUN)  # dS^T Q_i
                add_dk(dk, b, h_kv, c0, ty * t, cols, tx, part, scale)  # dK_j += scale dS^T Q_i
                for a in range(t):
                    for e in range(TD):
                        part[a, e] = ZERO
                if marked:
                    gemm_keys_guarded(smem, part, P + ty * t, DO + tx * RUN, P + ty * t)
                else:
                    gemm_keys(smem, part, P + ty * t, DO + tx * RUN)  # P^T dO_i
                add_dv(dv, b, h_kv, c0, ty * t, cols, tx, part, scale)  # dV_j += P^T dO_i (unscaled)
        for a in range(t):  # dQ_i written once
            r = ty + side * a
            if r < rows:
                for e in range(TD):
                    x = feature_column(tx, e)
                    if x < d:
                        dq[b, h, r0 + r, x] = scale * dq_acc[a, e]

    return flash_backward_q


def preprocess_source(config: BackwardConfig):
    """D = rowsum(dO o O), one query row per thread; with zero_dq (flag, kind preprocess) dQ = 0 too. The
    zeroing of dK, dV for order q is `zero_source`."""
    ZERO_DQ = config.flag
    VALUE_DIM = config.value_dim != 0  # O's head dim d_v its own: dQ is zeroed over its own d

    def flash_backward_preprocess(out, dout, dvec, dq):
        r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        bh = cuda.blockIdx.y
        heads, n_q, d = out.shape[1], out.shape[2], out.shape[3]
        b = bh // heads
        h = bh - b * heads
        if r < n_q:
            total = ZERO
            for x in range(d):
                total += to_f32(dout[b, h, r, x]) * to_f32(out[b, h, r, x])
            dvec[b, h, r] = total
            if ZERO_DQ:
                for x in range(dq.shape[3] if VALUE_DIM else d):
                    dq[b, h, r, x] = ZERO

    return flash_backward_preprocess


def zero_source(config: BackwardConfig):
    """dK = dV = 0 before order q adds into them (writes N_k d and N_k d_v per K/V head)."""
    VALUE_DIM = config.value_dim != 0

    def flash_backward_zero(dk, dv):
        r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        bh = cuda.blockIdx.y
        heads_kv, n_k, d = dk.shape[1], dk.shape[2], dk.shape[3]
        b = bh // heads_kv
        h = bh - b * heads_kv
        if r < n_k:
            if VALUE_DIM:
                for x in range(d):
                    dk[b, h, r, x] = ZERO
                for x in range(dv.shape[3]):
                    dv[b, h, r, x] = ZERO
            else:
                for x in range(d):
                    dk[b, h, r, x] = ZERO
                    dv[b, h, r, x] = ZERO

    return flash_backward_zero


SOURCES = {"kv": kv_source, "q": q_source, "preprocess": preprocess_source, "zero": zero_source}

# The backward kernels `compare --backward` and `profile` list: name -> (kind, flag, one-line verdict).
VARIANTS = {
    "bwd-kv": ("kv", False, "K/V outer (FlashAttention-2): dK, dV on chip, dQ by atomic adds into HBM"),
    "bwd-kv-det": ("kv", True, "K/V outer without dQ, for deterministic=True (dQ by bwd-q-dq)"),
    "bwd-q-dq": ("q", True, "Q outer, dQ only: the second pass of deterministic=True, no atomics"),
    "bwd-q": ("q", False, "Q outer: dQ on chip, dK, dV by atomic adds into HBM"),
}


class CompiledBackward(CompiledKernel):
    """One compiled backward kernel; `launch_shape` and `argtypes` as the forward's (for fa_numba.profile)."""

    def __init__(self, config: BackwardConfig):
        self.config = config
        self.source = SOURCES[config.kind](config)
        self.kernel = disk_cache.jit(self.source)

    def launch_shape(self, batch, heads, n_rows):
        """Grid and block for `heads` heads (query heads for preprocess and q, K/V heads for kv and zero)
        of n_rows rows (N_q for preprocess and q, N_k for kv and zero)."""
        if self.config.kind in ("preprocess", "zero"):
            return ((n_rows + PRE_THREADS - 1) // PRE_THREADS, batch * heads), (PRE_THREADS,)
        side = self.config.side
        return ((n_rows + self.config.block - 1) // self.config.block, batch * heads), (side, side)

    def check_grid(self, batch, heads, n_rows):
        """As the forward's: the grid (ceil(n_rows / rows per block), batch * heads) fits CUDA's limits."""
        grid, _ = self.launch_shape(batch, heads, n_rows)
        rows = "N_q" if self.config.kind in ("preprocess", "q") else "N_k"
        per_block = PRE_THREADS if self.config.kind in ("preprocess", "zero") else "block"
        heads_name = "heads" if self.config.kind in ("preprocess", "q") else "heads_kv"
        check_grid(grid, (f"ceil({rows} / {per_block})", f"batch * {heads_name}"), f"backward {self.config.kind}")

    def argtypes(self, dtype):
        from numba import types

        inp, out, stat = self.array_types(dtype)
        if self.config.kind == "preprocess":
            return (out, inp, stat, out)
        if self.config.kind == "zero":
            return (out, out)
        return ((inp, inp, inp, inp, stat, stat, out, out, out, types.float32) + self.mask_types()
                + (tuple_type(self.config.mod),))

    def launch(self, *args, **kwargs):
        raise TypeError("call a backward kernel through kernels.backward.run, not as a forward kernel")


@functools.lru_cache(maxsize=None)
def make(kind: str, block: int, head_dim: int, causal: bool, flag: bool = False, mask_form: str = "none",
         mod: KernelMod | None = None, value_dim: int = 0) -> CompiledBackward:
    """Build (once per configuration) one backward kernel (mod: a score mod with its grad, kv and q only;
    value_dim: V's head dim d_v where it differs from d)."""
    return CompiledBackward(BackwardConfig(kind, block, head_dim, bool(causal), bool(flag), mask_form, mod,
                                           value_dim).check())


def run(q, k, v, out, lse, dout, dq, dk, dv, dvec, scale, *, causal, order="kv", deterministic=False, block=None,
        stream=0, mask=None, mod: KernelMod | None = None, captured=NO_CAPTURED, dlse=None):
    """Launch the backward of one call on (B, H, N, d) device arrays (v, out and dout d_v wide, d_v may differ
    from d): dq (B, H, N_q, d), dk (B, H_kv, N_k, d), dv (B, H_kv, N_k, d_v) float32 outputs, dvec (B, H, N_q) float32 workspace for D. order "kv" (deterministic or not) or "q";
    mask: the KernelMask of a block mask (its tiles must be block x block), None for none or causal; mod and
    captured: a score mod's KernelMod and its device arrays (`score_mod.device_arrays`), the forward's; dlse: LSE's
    cotangent (B, H, N_q) float32 or None, taken from D after the preprocess (kernels.sinks.shift)."""
    batch, heads, n_q, d = q.shape
    heads_kv, n_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    block = block or default_backward_tiles(max(d, d_v))[0]
    scale = float32(scale)

    form = mask.form if mask is not None else "none"
    check_launches(batch, heads, heads_kv, n_q, n_k, block=block, head_dim=d, causal=causal, order=order,
                   deterministic=deterministic, mask_form=form, mod=mod, value_dim=d_v)
    wanted = 0 if mod is None else len(mod.captured) + len(mod.mask_captured)
    if len(captured) != wanted:
        raise ValueError(f"captured must hold the score mod's and the mask_mod's device arrays, {wanted}, got "
                         f"{len(captured)}")
    grads = (q, k, v, dout, lse, dvec, dq, dk, dv, scale, *mask_arrays(mask), tuple(captured))
    arguments = {"preprocess": (out, dout, dvec, dq), "zero": (dk, dv), "kv": grads, "q": grads}
    for kernel, side in _launches(block, d, causal, order, deterministic, form, mod, d_v):
        heads_, rows = (heads, n_q) if side == "q" else (heads_kv, n_k)
        grid, threads = kernel.launch_shape(batch, heads_, rows)
        with backend.serialised(math.prod(threads)):  # the simulator runs one launch at a time
            kernel.kernel[grid, threads, stream](*arguments[kernel.config.kind])
        if kernel.config.kind == "preprocess" and dlse is not None:
            sinks.shift(dvec, dlse, stream=stream)


def _launches(block, d, causal, order, deterministic, form, mod=None, d_v=0) -> list:
    """The kernels one backward call launches, in order, each with the side its grid spans ("q": heads and
    N_q rows, "kv": K/V heads and N_k rows); d_v: V's head dim (0: d)."""
    dv = {"value_dim": d_v} if d_v and d_v != d else {}  # the configurations (and caches) of d_v = d unchanged
    plan = [(make("preprocess", block, d, False, order == "kv" and not deterministic, **dv), "q")]
    if order == "q":
        return plan + [(make("zero", block, d, False, **dv), "kv"),
                       (make("q", block, d, causal, False, form, mod, **dv), "q")]
    plan.append((make("kv", block, d, causal, deterministic, form, mod, **dv), "kv"))
    if deterministic:
        plan.append((make("q", block, d, causal, True, form, mod, **dv), "q"))
    return plan


def check_launches(batch, heads, heads_kv, n_q, n_k, *, block, head_dim, causal, order="kv", deterministic=False,
                   mask_form="none", mod=None, value_dim=0) -> None:
    """Every launch of one backward call fits CUDA's grid and the kernels' sizes, else a ValueError before
    any of them runs (api calls it before copying anything to the device)."""
    check_sequence(n_q, n_k)
    for kernel, side in _launches(block, head_dim, causal, order, deterministic, mask_form, mod, value_dim):
        kernel.check_grid(batch, *((heads, n_q) if side == "q" else (heads_kv, n_k)))
