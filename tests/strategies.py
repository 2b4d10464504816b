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
        return q.astype(dtype), k.astype(dtype), v.astype(dtype)


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


def with_hard_cases(test=None, **fixed):
    """Decorate a @given(case=...) test with one @example per hard case (other arguments from `fixed`)."""
    if test is None:
        return lambda t: with_hard_cases(t, **fixed)
    for case in HARD_CASES:
        test = example(case=case, **fixed)(test)
    return test


@st.composite
def cases(draw, max_n: int = 20, max_d: int = 8, max_block: int = 9, multihead: bool = True) -> Case:
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
        logit=draw(st.sampled_from([1.0, 1.0, 30.0, 1e4])),
        seed=draw(st.integers(0, 2**32 - 1)),
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
