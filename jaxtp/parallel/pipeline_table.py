"""1F1B's and interleaved 1F1B's static table (`jaxtp.parallel.pipeline_1f1b`
runs it): which op each stage runs forward and backward in each tick, the
loops of one kind the ticks fall into, and the stash slots; numpy only, so
that it is checked, and drawn (`jaxtp.analysis.pp.picture`), without JAX."""

from __future__ import annotations

import numpy as np


def table(p: int, M: int, v: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(forward [T, p], backward [T, p]): the op each stage runs forward and
    backward in each tick, as its forward index n (`decode`), -1 for none;
    T = v*M + (v+1)p - 2 (M + 2p - 2 at v = 1).

    A stage's forwards run in the order n = g*v*p + i*p + j: microbatch
    g*p + j's chunk i (of v; at v = 1 simply microbatch n), op n on stage r
    at tick n + r, the tick after the stage before ran it (under v > 1 stage
    0 takes chunk i > 0 from the last stage's chunk i - 1 a tick after it,
    round the ring: Megatron's interleaved order, microbatches in groups of
    p; Narayanan et al. 2021, Sec. 2.2.2). The backwards run the chunks in
    reverse, the k-th (the same order with chunk v-1-i) at tick
    v*p - 1 + k + p - 1 - r: the tick after the stage after ran it, on the
    last stage the tick of its chunk v-1's forward, whose head gradient it
    takes. So the steady ticks carry a forward and a backward on every stage
    (1F1B's order: PipeDream-flush, Narayanan et al. 2021, Sec. 2.2.1), the
    first v*p - 1 forwards only, the last v*p - 1 backwards only (`phases`).
    Stage r holds an op from its forward to its backward (`in_flight`):
    stage 0 at most 2p - 1 microbatches at v = 1, v*p + p - 1 chunks (a
    stage's p + (p-1)/v) under v (GPipe, circular: all of them)."""
    if v > 1 and M % p:
        raise ValueError(f"the interleaved order takes microbatches in groups of p={p}: "
                         f"M={M} is not a multiple")
    T = v * M + (v + 1) * p - 2
    fwd, bwd = np.full((T, p), -1, np.int32), np.full((T, p), -1, np.int32)
    n = np.arange(v * M)
    back = (n // (v * p)) * v * p + (v - 1 - n % (v * p) // p) * p + n % p  # k-th: chunk v-1-i
    for r in range(p):
        fwd[n + r, r] = n
        bwd[v * p - 1 + n + p - 1 - r, r] = back
    return fwd, bwd


def decode(n, p: int, v: int = 1):
    """A forward index's (microbatch, chunk): n = g*v*p + i*p + j is
    microbatch g*p + j's chunk i (numpy or jax integers)."""
    return (n // (v * p)) * p + n % p, n % (v * p) // p


def phases(p: int, M: int, v: int = 1) -> list[tuple[int, int, bool, bool]]:
    """The table's ticks as loops of one kind: (first tick, end, runs
    forwards, runs backwards): v*p - 1 ticks of forwards (no backward has a
    gradient yet), then both until the last forward, then v*p - 1 ticks of
    backwards. Each loop's tick computes only its kinds, so a stage's block
    FLOPs are v*M + p - 1 chunk forwards and as many chunk backwards:
    GPipe's (v = 1) and circular's. (The last tick runs apart, without the
    backward shift: stage 0's gradient is the last, and it stays there.)"""
    edges = [(0, v * p - 1, True, False), (v * p - 1, v * M + p - 1, True, True),
             (v * M + p - 1, v * M + (v + 1) * p - 2, False, True)]
    return [e for e in edges if e[1] > e[0]]


def slots(fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(the stash slot each forward writes [T, p], the slot each backward
    reads [T, p], the slots): each forward takes the lowest slot its stage
    has free, its backward frees it (after reading it, in the tick). So the
    slots are the most ops a stage holds at once (`in_flight` of stage 0):
    2p - 1 at v = 1, v*p + p - 1 chunks under v (a stage's p + (p-1)/v)."""
    T, p = fwd.shape
    fslot, bslot = np.zeros((T, p), np.int32), np.zeros((T, p), np.int32)
    for r in range(p):
        free, at = [], {}
        for t in range(T):
            if fwd[t, r] >= 0:
                at[fwd[t, r]] = fslot[t, r] = free.pop(0) if free else len(at) + len(free)
            if bwd[t, r] >= 0:
                bslot[t, r] = at.pop(bwd[t, r])
                free = sorted(free + [bslot[t, r]])
    return fslot, bslot, max(in_flight(fwd, bwd, r) for r in range(p))


def in_flight(fwd: np.ndarray, bwd: np.ndarray, stage: int = 0) -> int:
    """The most ops (microbatches, or chunks of them) `stage` holds at once
    (forwarded, not yet backwarded; a backward in the tick of its forward:
    held that tick)."""
    held = np.cumsum(fwd[:, stage] >= 0) - np.concatenate(
        [[0], np.cumsum(bwd[:, stage] >= 0)[:-1]])
    return int(held.max())
