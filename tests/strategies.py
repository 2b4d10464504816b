"""Shared Hypothesis strategies and the known-hard cases pinned with @example."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import example
from hypothesis import strategies as st


@dataclass(frozen=True)
class Case:
    """One attention problem: sizes, tiles, mask and how the inputs are drawn."""

    n_q: int
    n_k: int
    d: int
    block_q: int
    block_k: int
    causal: bool
    batch: int = 1
    heads_kv: int = 1
    group: int = 1
    logit: float = 1.0  # typical |S_ij|: 1e4 exercises the max shift
    seed: int = 0
    amplitude: float = 1.0  # q, k, v (and dO) all scaled by it: 5 makes |S_ij| ~ 25 logit and |V| ~ 5

    @property
    def heads(self) -> int:
        return self.heads_kv * self.group

    def inputs(self, dtype=np.float64):
        """(q, k, v) of shape (B, H, N, d); q is scaled so that |S_ij| is about `logit`."""
        rng = np.random.default_rng(self.seed)
        q = rng.standard_normal((self.batch, self.heads, self.n_q, self.d))
        k = rng.standard_normal((self.batch, self.heads_kv, self.n_k, self.d))
        v = rng.standard_normal((self.batch, self.heads_kv, self.n_k, self.d))
        q *= self.logit  # scale 1/sqrt(d) and the sqrt(d)-sized dot product cancel
        if self.amplitude != 1.0:
            q, k, v = (x * self.amplitude for x in (q, k, v))
        return q.astype(dtype), k.astype(dtype), v.astype(dtype)

    def grad_output(self, dtype=np.float64):
        """dO of shape (B, H, N_q, d), the upstream gradient, from its own stream of the case's seed."""
        rng = np.random.default_rng((self.seed, 1))
        dout = rng.standard_normal((self.batch, self.heads, self.n_q, self.d)) * self.amplitude
        return dout.astype(dtype)


# The cases DESIGN.md asks every property to pin: N = 1, N < B_c, N = k B_c + 1, odd d,
# N_q > N_k causal (fully masked rows), logits around 1e4.
HARD_CASES = (
    Case(n_q=1, n_k=1, d=1, block_q=1, block_k=1, causal=True),
    Case(n_q=1, n_k=5, d=4, block_q=4, block_k=8, causal=True),
    Case(n_q=3, n_k=5, d=3, block_q=4, block_k=8, causal=False),
    Case(n_q=9, n_k=9, d=4, block_q=4, block_k=4, causal=True),
    Case(n_q=17, n_k=17, d=5, block_q=8, block_k=8, causal=False, heads_kv=2, group=2),
    Case(n_q=12, n_k=5, d=3, block_q=4, block_k=2, causal=True, seed=1),
    Case(n_q=10, n_k=3, d=2, block_q=3, block_k=3, causal=True, batch=2, seed=2),
    Case(n_q=8, n_k=8, d=4, block_q=4, block_k=4, causal=True, logit=1e4, seed=3),
    Case(n_q=6, n_k=11, d=7, block_q=4, block_k=3, causal=False, logit=1e4, seed=4),
)


# The backward adds: inputs scaled x5 (q, k, v and dO), and GQA with N_q > N_k causal (dead rows whose
# K/V head is shared by several query heads).
BACKWARD_HARD_CASES = HARD_CASES + (
    Case(n_q=7, n_k=9, d=5, block_q=4, block_k=4, causal=True, amplitude=5.0, seed=5),
    Case(n_q=10, n_k=10, d=3, block_q=3, block_k=4, causal=False, heads_kv=2, group=2, amplitude=5.0, seed=6),
    Case(n_q=11, n_k=4, d=3, block_q=4, block_k=3, causal=True, heads_kv=2, group=3, seed=7),
)


def _pin_each(hard: tuple[Case, ...], test, fixed):
    for case in hard:
        test = example(case=case, **fixed)(test)
    return test


def with_hard_cases(test=None, **fixed):
    """Decorate a @given(case=...) test with one @example per hard case (other arguments from `fixed`)."""
    if test is None:
        return lambda t: with_hard_cases(t, **fixed)
    return _pin_each(HARD_CASES, test, fixed)


def with_backward_hard_cases(test=None, **fixed):
    """`with_hard_cases` for the backward: one @example per case of BACKWARD_HARD_CASES."""
    if test is None:
        return lambda t: with_backward_hard_cases(t, **fixed)
    return _pin_each(BACKWARD_HARD_CASES, test, fixed)


@st.composite
def cases(draw, max_n: int = 20, max_d: int = 8, max_block: int = 9, multihead: bool = True,
          amplitudes: tuple[float, ...] = (1.0,), logits: tuple[float, ...] = (1.0, 1.0, 30.0, 1e4)) -> Case:
    return Case(
        n_q=draw(st.integers(1, max_n)),
        n_k=draw(st.integers(1, max_n)),
        d=draw(st.integers(1, max_d)),
        block_q=draw(st.integers(1, max_block)),
        block_k=draw(st.integers(1, max_block)),
        causal=draw(st.booleans()),
        batch=draw(st.integers(1, 2)) if multihead else 1,
        heads_kv=draw(st.integers(1, 2)) if multihead else 1,
        group=draw(st.integers(1, 3)) if multihead else 1,
        logit=draw(st.sampled_from(logits)),
        seed=draw(st.integers(0, 2**32 - 1)),
        amplitude=draw(st.sampled_from(amplitudes)) if len(amplitudes) > 1 else amplitudes[0],
    )


SIM_MAX_BLOCKS = 16  # simulator budget per launch (DESIGN.md): <= 16 blocks of <= 64 threads


def launch_blocks(case: Case) -> int:
    """Blocks of the larger of the two launches: v2 runs T_r x B H blocks, v1 runs B H."""
    t_r = -(-case.n_q // case.block_q)
    return t_r * case.batch * case.heads


@st.composite
def kernel_cases(draw) -> Case:
    """Cases small enough for the simulator: <= 16 blocks of <= 8 threads."""
    case = draw(cases(max_n=12, max_d=6, max_block=8))
    return case if launch_blocks(case) <= SIM_MAX_BLOCKS else Case(
        case.n_q, case.n_k, case.d, max(case.block_q, -(-case.n_q // 4)), case.block_k, case.causal,
        batch=1, heads_kv=case.heads_kv, group=min(case.group, 2), logit=case.logit, seed=case.seed)
