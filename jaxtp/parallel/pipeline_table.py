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


def weights(bwd: np.ndarray) -> np.ndarray:
    """The zero-bubble schedule's weight-gradient table (`jaxtp.checks.SPLIT`)
    [T, p]: the op whose W each stage runs in each tick, -1 for none: on
    every stage the op stage 0 runs B (its input gradient) on in that tick,
    which stage r ran B on r ticks before. So W runs on real data on every
    stage in each of its v*M ticks, none on dropped data (the W of the
    zero-bubble schedules, Qi et al. 2024, Sec. 3, moved into the ticks where
    stage 0 alone ends its backward)."""
    return np.repeat(bwd[:, :1], bwd.shape[1], axis=1)


def phases(p: int, M: int, v: int = 1, split: bool = False
           ) -> list[tuple[int, int, bool, bool, bool]]:
    """The table's ticks as loops of one kind: (first tick, end, runs
    forwards, backwards, weight gradients), read from the tables: v*p - 1
    ticks of forwards (no backward has a gradient yet), then both until the
    last forward, then v*p - 1 ticks of backwards; with `split` (B apart
    from W, `weights`), W in the ticks from stage 0's first B on. Each loop's
    tick computes only its kinds, so a stage's block FLOPs are v*M + p - 1
    chunk forwards and as many chunk backwards (under `split`: input
    gradients; and v*M weight gradients): GPipe's (v = 1) and circular's.
    (The last tick runs apart, without the backward shift: stage 0's
    gradient is the last, and it stays there.)"""
    fwd, bwd = table(p, M, v)
    wgt = weights(bwd) if split else np.full_like(bwd, -1)
    kinds = [tuple(bool((a[t] >= 0).any()) for a in (fwd, bwd, wgt)) for t in range(len(fwd))]
    out = []
    for t, kind in enumerate(kinds):
        if out and out[-1][2:] == kind:
            out[-1] = (out[-1][0], t + 1, *kind)
        else:
            out.append((t, t + 1, *kind))
    return out


def slots(fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(the stash slot each write (`fwd`'s op) takes [T, p], the slot each
    freeing read (`bwd`'s) frees [T, p], the slots): each write takes the
    lowest slot its stage has free, its freeing read frees it (after reading
    it, in the tick; a tick's write first). So the slots are the most ops a
    stage holds at once (`in_flight` of stage 0): 2p - 1 at v = 1, v*p + p - 1
    chunks under v (a stage's p + (p-1)/v)."""
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


def reading(fwd: np.ndarray, fslot: np.ndarray, reads: np.ndarray) -> np.ndarray:
    """The slot each of `reads`' ops [T, p] is read from: the one its write
    (`fwd`, `fslot`) took (the zero-bubble B reads what W frees)."""
    out = np.zeros_like(reads)
    for r in range(fwd.shape[1]):
        at = {n: j for n, j in zip(fwd[:, r], fslot[:, r]) if n >= 0}
        out[:, r] = [at.get(n, 0) for n in reads[:, r]]
    return out


def in_flight(fwd: np.ndarray, bwd: np.ndarray, stage: int = 0) -> int:
    """The most ops (microbatches, or chunks of them) `stage` holds at once
    (forwarded, not yet backwarded; a backward in the tick of its forward:
    held that tick)."""
    held = np.cumsum(fwd[:, stage] >= 0) - np.concatenate(
        [[0], np.cumsum(bwd[:, stage] >= 0)[:-1]])
    return int(held.max())
