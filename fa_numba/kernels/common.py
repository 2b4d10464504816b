"""Pieces shared by every kernel: constants, the input conversion, the configuration, the launch wrapper,
the finalisation rules, and the device functions of the one-thread-per-row kernels.

Two families use them. The tile engine (engine.py, engine_v1.py, engine_v2.py: registered as v1 and v2)
gives each thread register micro-tiles of S and O. The one-thread-per-row kernels (rowwise_v1.py,
rowwise_v2.py: v1-rowwise and v2-rowwise) mirror the papers line by line: a thread keeps its row of Q, its
scores and its accumulator in per-thread local arrays and the block shares K_j and V_j in shared memory.
Their loop trip counts come from the arrays' runtime shapes (d = q.shape[3], the tile's column count):
that stops LLVM from fully unrolling the d loops, which at d = 128 ran out of registers and spilled.
Tile sizes and d are Python ints closed over by the factories, so Numba compiles them as constants.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32

from fa_numba import backend
from fa_numba.kernels import disk_cache
from fa_numba.kernels.block_lists import LIST_FORMS, MASK_FORMS, mask_arrays, mask_types
from fa_numba.kernels.score_mod import NO_CAPTURED, KernelMod, tuple_type

NEG_INF = float32(-math.inf)
NAN = float32(math.nan)
ZERO = float32(0.0)
SHARED_BYTES_LIMIT = 48 * 1024  # static shared memory per block
MAX_HEAD_DIM = 256
MAX_BLOCK_THREADS = 1024
#: CUDA's grid limits for every compute capability since 3.0 (CUDA C++ Programming Guide, "Features and
#: Technical Specifications"): at most 2^31 - 1 blocks along x and 65535 along y and z. A launch past them
#: fails in the driver with an unspecific error, so `check_grid` refuses it first, naming the sizes.
GRID_LIMITS = (2**31 - 1, 65535, 65535)
#: The longest sequence (N_q, N_k) a kernel takes. The kernels' index arithmetic is 64-bit (proved of the
#: typed IR: tests/test_index_width.py), but a block mask reaches them as int32 positions and int32 CSR
#: offsets (KernelMask), and masks.INDEX_MAX bounds mask parameters alike, so N is bounded there too.
MAX_SEQUENCE = 2**31 - 1
INPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
BF16_BITS = (np.dtype(np.uint16), np.dtype(np.int16))  # how bfloat16 inputs reach the kernels (to_f32)


def check_mask_form(mask_form, causal: bool) -> None:
    """mask_form is one of MASK_FORMS and agrees with causal: "causal" exactly when causal=True ("none" is also
    accepted with it), a block-mask form only without it. A "causal" form with causal=False would compile an
    unmasked kernel, so it is refused here rather than trusted."""
    if mask_form not in MASK_FORMS:
        raise ValueError(f"mask_form must be one of {MASK_FORMS}, got {mask_form!r}")
    if causal and mask_form not in ("none", "causal"):
        raise ValueError(f"mask_form {mask_form!r} is a block mask's form and causal=True is not: pass one of them")
    if mask_form == "causal" and not causal:
        raise ValueError("mask_form 'causal' needs causal=True (the causal kernels are compiled from the flag)")


class ValueDim:
    """For a frozen configuration dataclass with fields head_dim and value_dim (d_v where V's head dim differs
    from d; 0: d): d_v, and one spelling of "V has q's head dim" (d_v == d is stored as 0, so equal
    configurations compare and hash equal wherever they are built)."""

    def __post_init__(self):
        if self.value_dim == self.head_dim:
            object.__setattr__(self, "value_dim", 0)

    @property
    def d_v(self) -> int:
        return self.value_dim or self.head_dim


@dataclass(frozen=True)
class Config(ValueDim):
    """One compiled specialisation: tile sizes, head dim and masking are compile-time constants.

    engine=False: a one-thread-per-row kernel (B_r threads, K_j and V_j in shared memory); engine=True: a
    register-tiled kernel of the tile engine, whose thread layout and shared memory are in `layout`.
    """

    order: str
    block_q: int
    block_k: int
    head_dim: int
    causal: bool
    engine: bool = False
    smem_budget: int = SHARED_BYTES_LIMIT  # the engine's static shared-memory budget (tests lower it)
    mask_form: str = "none"  # "none", "causal", or a block mask's "intervals" / "dense" (KernelMask)
    micro: tuple | None = None  # the engine's (TM, TN); None: layout.micro_for's (v2 at a decode layout sets it)
    mod: KernelMod | None = None  # a score mod compiled in (kernels.score_mod); its arrays come at the launch
    value_dim: int = 0  # d_v, V's and O's head dim where it differs from d (engine kernels only); 0: head_dim

    @property
    def form(self) -> str:
        """How the kernel masks: "causal" (closed forms), "none", or the block-mask path ("intervals",
        "dense"), whose tiles come from the lists of a KernelMask."""
        return "causal" if self.causal else self.mask_form

    @property
    def lists(self) -> bool:
        return self.form in LIST_FORMS

    @property
    def layout(self):
        """The engine's compile-time layout (micro-tiles, threads, shared-memory regions); engine kernels only."""
        from fa_numba.kernels.layout import Layout, micro_for

        micro = self.micro or micro_for(self.block_q, self.block_k, self.head_dim, self.order)
        return Layout(self.order, self.block_q, self.block_k, self.head_dim, *micro, budget=self.smem_budget,
                      value_dim=self.value_dim)

    @property
    def threads(self) -> int:
        return self.layout.threads if self.engine else self.block_q

    @property
    def shared_bytes(self) -> int:
        """Static shared memory: the engine's regions, or the rowwise K_j and V_j tiles (2 B_c d 4 bytes)."""
        return self.layout.shared_bytes if self.engine else 2 * self.block_k * self.head_dim * 4

    def check(self) -> "Config":
        for name in ("block_q", "block_k", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head dim d must be <= {MAX_HEAD_DIM}, got {self.head_dim}")
        if self.value_dim:
            if isinstance(self.value_dim, bool) or not isinstance(self.value_dim, (int, np.integer)) \
                    or not 0 < self.value_dim <= MAX_HEAD_DIM:
                raise ValueError(f"value head dim d_v must be an int in 1..{MAX_HEAD_DIM}, got {self.value_dim!r}")
            if not self.engine:
                raise ValueError("a value head dim of its own is taken natively by the tile engine's kernels only "
                                 "(the one-thread-per-row kernels run at max(d, d_v): fa_numba.value_dims)")
        check_mask_form(self.mask_form, self.causal)
        if self.engine:
            self.layout.check()
            return self
        if self.block_q > MAX_BLOCK_THREADS:
            raise ValueError(f"block_q is the threads per block and must be <= {MAX_BLOCK_THREADS}, got {self.block_q}")
        if self.shared_bytes > SHARED_BYTES_LIMIT:
            raise ValueError(
                f"block_k = {self.block_k} with d = {self.head_dim} needs {self.shared_bytes} bytes of shared memory "
                f"for K_j and V_j (2 * block_k * d * 4), over the {SHARED_BYTES_LIMIT}-byte static limit; "
                f"use block_k <= {SHARED_BYTES_LIMIT // (8 * self.head_dim)}"
            )
        return self


def check_sequence(n_q: int, n_k: int) -> None:
    """N_q and N_k are at most MAX_SEQUENCE (the int32 positions of a block mask)."""
    for name, n in (("N_q", n_q), ("N_k", n_k)):
        if n > MAX_SEQUENCE:
            raise ValueError(f"{name} = {n} is over the {MAX_SEQUENCE} positions the kernels take (a block mask "
                             f"holds positions and tile offsets in int32): split the sequence")


def check_grid(grid: tuple, axes: tuple, kernel: str) -> None:
    """Every axis of `grid` is within GRID_LIMITS; `axes` says what each axis counts, for the message."""
    for axis, blocks, limit, what in zip("xyz", grid, GRID_LIMITS, axes):
        if blocks > limit:
            raise ValueError(f"{what} = {blocks} is more blocks than CUDA's grid {axis} allows ({limit}) for the "
                             f"{kernel} launch: split the call into parts of at most {limit}")


class CompiledKernel:
    """One compiled specialisation of a loop order.

    Subclasses give `launch_shape(batch, heads, n_q)` (grid and block), `GRID_AXES` (what each grid axis
    counts), `argtypes(dtype)` (the Numba types of the kernel's arguments, which `fa_numba.profile` compiles
    for sm_90 without a GPU) and `launch(...)`.
    """

    GRID_AXES: tuple = ()

    def __init__(self, config: Config, kernel_source):
        self.config = config
        self.source = kernel_source(config)  # the Python function, compiled again by fa_numba.profile
        self.kernel = disk_cache.jit(self.source)

    def __call__(self, q, k, v, o, lse, scale, workspace=None, stream=0, mask=None, captured=NO_CAPTURED):
        """Launch on device arrays q, k, v (B, H, N, d), o (B, H, N_q, d) and lse (B, H, N_q), float32 outputs,
        queued on `stream` (a Numba stream; 0: the default stream). mask: the KernelMask of a block-mask
        configuration (mask_form "intervals" or "dense"), None otherwise. captured: the score mod's arrays on
        the device (`score_mod.device_arrays`) for a kernel compiled with one (config.mod), () otherwise."""
        if q.shape[3] != self.config.head_dim:
            raise ValueError(f"q must have head dim {self.config.head_dim} for this kernel, got {q.shape[3]}")
        if v.shape[3] != self.config.d_v or o.shape[3] != self.config.d_v:
            raise ValueError(f"v and o must have head dim d_v = {self.config.d_v} for this kernel, got "
                             f"{v.shape[3]} and {o.shape[3]}")
        if self.config.lists != (mask is not None):
            raise ValueError(f"mask must be a KernelMask for mask_form {self.config.form!r}" if self.config.lists
                             else f"this kernel (mask_form {self.config.form!r}) takes no mask")
        mod = getattr(self.config, "mod", None)
        wanted = 0 if mod is None else len(mod.captured) + len(mod.mask_captured)
        if len(captured) != wanted:
            raise ValueError(f"captured must hold the score mod's and the mask_mod's {wanted} device arrays for "
                             f"this kernel, got {len(captured)}")
        check_sequence(q.shape[2], k.shape[2])
        self.check_grid(q.shape[0], q.shape[1], q.shape[2])
        grid, block = self.launch_shape(q.shape[0], q.shape[1], q.shape[2])
        with backend.serialised(math.prod(block)):  # the simulator runs one launch at a time
            self.launch(self.kernel[grid, block, stream], q, k, v, o, lse, float32(scale), workspace,
                        mask_arrays(mask) + (tuple(captured),))

    def check_grid(self, batch: int, heads: int, n_rows: int) -> None:
        """The launch for (batch, heads, n_rows) fits CUDA's grid (check_grid), else a ValueError."""
        grid, _ = self.launch_shape(batch, heads, n_rows)
        check_grid(grid, self.GRID_AXES, self.config.order)

    @staticmethod
    def array_types(dtype: str):
        """Numba types of the (B, H, N, d) inputs, the float32 output and the float32 (B, H, N) statistics."""
        from numba import types

        return (types.Array(getattr(types, dtype), 4, "C"), types.Array(types.float32, 4, "C"),
                types.Array(types.float32, 3, "C"))

    @staticmethod
    def mask_types():
        """Numba types of the KernelMask arrays, in `mask_arrays` order."""
        return mask_types()


class V1Kernel(CompiledKernel):
    """A v1 (K/V outer) kernel's arguments: q, k, v, o, lse, the l and m workspaces, scale, the mask arrays,
    the score mod's captured arrays (a tuple, empty without a mod); the l, m workspace is allocated unless
    given. Grid (B H,): one block per (batch, head)."""

    GRID_AXES = ("batch * heads",)

    def argtypes(self, dtype):
        inp, out, stat = self.array_types(dtype)
        return (inp, inp, inp, out, stat, stat, stat, float32) + self.mask_types() + (tuple_type(self.config.mod),)

    def launch(self, kernel, q, k, v, o, lse, scale, workspace, trailing):
        """trailing: the mask arrays and the captured-array tuple (CompiledKernel.__call__)."""
        if workspace is None:
            workspace = (cuda.device_array(lse.shape, dtype="float32"), cuda.device_array(lse.shape, dtype="float32"))
        l_hbm, m_hbm = workspace
        kernel(q, k, v, o, lse, l_hbm, m_hbm, scale, *trailing)


class V2Kernel(CompiledKernel):
    """A v2 (Q outer) kernel's arguments: q, k, v, o, lse, scale, the mask arrays, the score mod's captured
    arrays (a tuple, empty without a mod; no workspace). Grid (T_r, B H): one block per (query tile, batch,
    head)."""

    GRID_AXES = ("ceil(N_q / block_q)", "batch * heads")

    def argtypes(self, dtype):
        inp, out, stat = self.array_types(dtype)
        return (inp, inp, inp, out, stat, float32) + self.mask_types() + (tuple_type(self.config.mod),)

    def launch(self, kernel, q, k, v, o, lse, scale, workspace, trailing):
        """trailing: the mask arrays and the captured-array tuple (CompiledKernel.__call__)."""
        kernel(q, k, v, o, lse, scale, *trailing)


def _to_f32_python(x):
    """to_f32 as the CUDA simulator runs it (plain Python on NumPy scalars)."""
    if isinstance(x, (np.uint16, np.int16)):
        return np.uint32(np.uint16(x)).__lshift__(np.uint32(16)).view(np.float32)
    return np.float32(x)


def _to_f32_intrinsic():
    """to_f32 for the CUDA compiler: an intrinsic lowers in the calling kernel, with no separate device
    compilation (which would ask for a GPU and break fa_numba.profile on a CPU)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def to_f32(typingctx, x):
        if x in (types.uint16, types.int16):
            def from_bits(context, builder, sig, args):
                wide = builder.zext(args[0], ir.IntType(32))
                return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

            return types.float32(x), from_bits
        if isinstance(x, types.Float):
            return types.float32(x), lambda context, builder, sig, args: context.cast(builder, args[0], x,
                                                                                     types.float32)
        return None

    return to_f32


#: An input element as float32: float32 and float16 convert; bfloat16 arrives as its 16 bits (uint16 or
#: int16, since NumPy and Numba have no bfloat16 array) and becomes the float32 with those high bits, exactly.
to_f32 = _to_f32_python if backend.name() == "simulator" else _to_f32_intrinsic()



@cuda.jit(device=True, inline=True)
def load_kv_tile(k, v, b, h_kv, c0, cols, d, k_tile, v_tile, tid, n_threads):
    """Cooperative load of K_j, V_j rows [c0, c0 + cols) into shared memory; rows past N_k are not read."""
    for idx in range(tid, cols * d, n_threads):
        c = idx // d
        x = idx - c * d
        k_tile[c, x] = to_f32(k[b, h_kv, c0 + c, x])
        v_tile[c, x] = to_f32(v[b, h_kv, c0 + c, x])


@cuda.jit(device=True, inline=True)
def visible_range(row, c0, cols, delta, causal_partial, lists_partial, lohi):
    """The keys [c_lo, c_hi) of the tile [c0, c0 + cols) that query `row` may see: all of them; on a causal
    PARTIAL tile the prefix c0 + c <= row + delta; on a PARTIAL tile of a block mask the row's interval
    lohi[row] (for a dense mask or a mask_mod a superset, checked key by key: `row_steps`). Masked keys are never
    touched, so a NaN in a masked value cannot leak in."""
    if causal_partial:
        return 0, max(0, min(cols, row + delta - c0 + 1))
    if lists_partial:
        return min(max(lohi[row, 0] - c0, 0), cols), max(min(lohi[row, 1] - c0, cols), 0)
    return 0, cols


@functools.lru_cache(maxsize=None)
def row_steps(kmod=None) -> SimpleNamespace:
    """The one-thread-per-row kernels' steps for one row of one key tile, with the PARTIAL tiles' pair test of
    `kmod` (kernels.mask_mod.pair_visible: the dense byte mask, or a mask_mod's fn):

        score_row(q_row, k_tile, c_lo, c_hi, d, scale, s, row, c0, use_dense, dense, b, h, captured)
        online_update(m, l, acc, s, c_lo, c_hi, d, v_tile, row, c0, use_dense, dense, b, h, captured)

    use_dense: a PARTIAL tile of a mask whose pairs are tested one by one (dense or mask_mod)."""
    from fa_numba.kernels.mask_mod import pair_visible

    pair = pair_visible(kmod)

    @cuda.jit(device=True, inline=True)
    def score_row(q_row, k_tile, c_lo, c_hi, d, scale, s, row, c0, use_dense, dense, b, h, captured):
        """s[c] = scale * <q_row, K_j[c]> for the visible keys c in [c_lo, c_hi), -inf where the mask hides one."""
        for c in range(c_lo, c_hi):
            if not use_dense or pair(dense, b, h, row, c0 + c, captured):
                dot = ZERO
                for x in range(d):
                    dot += q_row[x] * k_tile[c, x]
                s[c] = scale * dot
            else:
                s[c] = NEG_INF

    @cuda.jit(device=True, inline=True)
    def online_update(m, l, acc, s, c_lo, c_hi, d, v_tile, row, c0, use_dense, dense, b, h, captured):
        """Fold the visible keys c in [c_lo, c_hi) of one tile into (m, l, acc); the twin of online_softmax.update.

        Returns (m_new, l_new); acc is updated in place and s is overwritten with the weights p.
        Every finite exp argument is <= 0 (proofs/L2_online_softmax.md); shift = 0 while nothing is visible.
        The max may drop a NaN score (fmaxf does), but its weight exp(NaN - shift) = NaN still reaches l and
        acc, so the row ends NaN as the dense formula says (proofs/L2.6). A key the mask hides inside the
        tile has weight 0 and its value is never multiplied.
        """
        m_tile = NEG_INF
        for c in range(c_lo, c_hi):
            m_tile = max(m_tile, s[c])
        m_new = max(m, m_tile)
        shift = m_new if m_new != NEG_INF else ZERO
        alpha = math.exp(m - shift)  # rescales the old state to the new max
        l_tile = ZERO
        for c in range(c_lo, c_hi):
            p = math.exp(s[c] - shift)
            s[c] = p
            l_tile += p
        l_new = alpha * l + l_tile
        for x in range(d):
            pv = ZERO
            for c in range(c_lo, c_hi):
                # a masked key's weight is exp(-inf) = 0, so the pair test runs for zero weights only
                if not use_dense or s[c] != ZERO or pair(dense, b, h, row, c0 + c, captured):
                    pv += s[c] * v_tile[c, x]
            acc[x] = alpha * acc[x] + pv
        return m_new, l_new

    return SimpleNamespace(score_row=score_row, online_update=online_update)


@cuda.jit(device=True, inline=True)
def log_sum_exp(m, l, alive):
    """LSE = m + log l on a row that sees a key (-inf if l = 0: every visible score was -inf; NaN if l is),
    and -inf on a row that sees none (`alive` comes from the mask, not from l)."""
    if not alive:
        return NEG_INF
    if l > ZERO:
        return m + math.log(l)
    if l == ZERO:
        return NEG_INF
    return NAN


@cuda.jit(device=True, inline=True)
def output(acc_x, l, alive):
    """O = acc / l on a row that sees a key (0/0 = NaN when l = 0 or NaN), 0 on a row that sees none."""
    if not alive:
        return ZERO
    if l > ZERO:
        return acc_x / l
    return NAN
