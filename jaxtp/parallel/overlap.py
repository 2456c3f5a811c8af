"""Collective matmuls: hiding sequence parallelism's communication behind the
matmuls it feeds (`parallel.overlap="collective_matmul"`).

Under SP a region starts with an all-gather of x along T and a column-
parallel matmul, and ends with a row-parallel matmul and a reduce-scatter
along T. Each pair is decomposed into tp ring steps of `lax.ppermute`, so
that the matmul of one sequence chunk can run while the next chunk travels
(Wang et al. 2023, "Overlap communication with dependent computation via
decomposition in large deep learning models"; the JAX shard_map tutorial's
collective matmul):

- `allgather_matmul`: tp - 1 hops of x's chunk, [B, T/tp, D] each;
- `matmul_reducescatter`: tp - 1 hops of a partial-sum chunk, [B, T/tp, D].

The bytes are those of the one all-gather / reduce-scatter they replace
((tp - 1)/tp of the full tensor per rank), none of it on the critical path
once the hardware runs a permute beside a matmul. The backward pass follows
from autodiff: the transpose of a ppermute is the permute the other way, so
dX is reduce-scattered by the reverse ring and the output gradient
all-gathered by one (`jaxtp.analysis.budget` counts them). The rings are
one-directional: a bidirectional ring would halve the hops on links that
carry both directions at once, at twice the number of (half-size) matmuls.

For GSPMD and explicit the same intent is XLA's: its partitioner can
decompose an all-gather or reduce-scatter beside a dot into a loop of
collective-permutes itself ("windowed einsum"), when the dot is written so
(`jaxtp.parallel.GSPMD.project`) and the backend's rules allow
(`jaxtp.parallel.xla_overlap`); `reread` keeps a gathered input to one dot
per pass, which that needs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .layout import TP_AXIS

def reread(mm: Callable) -> Callable:
    """`mm` rematerialised (nothing saved but its inputs): its backward pass
    reads the input it was given again, through an optimization barrier,
    instead of the value XLA gathered for the forward matmul. Under SP's
    overlap the input is x's sequence shard, so the weight gradient gathers
    x again (Megatron-SP keeps the shard and gathers it twice, Korthikanti
    et al. 2022, Sec. 4.2.3), and each gather has one dot consumer: XLA's
    partitioner declines a windowed loop for an operand whose other users
    need the same gathered value (dot_handler.cc, check_users_sharding) and
    shares one plain all-gather instead."""
    return jax.checkpoint(mm)


def _ring(tp: int, step: int = 1) -> list[tuple[int, int]]:
    """Each rank sends to rank + step (1: up the ring, -1: down)."""
    return [(j, (j + step) % tp) for j in range(tp)]


def allgather_matmul(x_BtD, mm: Callable, axis: str = TP_AXIS):
    """mm(all_gather(x along T)) as a ring, for `mm` that maps each position
    on its own (a column-parallel matmul): x [B, T/tp, D] -> mm's outputs
    (any pytree) with T whole, [B, T, ...].

    Step i: rank r holds the chunk of rank r - i, sends it on to rank r + 1
    and multiplies it into its rows of the output (tp - 1 hops)."""
    tp, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    t = x_BtD.shape[1]
    whole = lambda p: jnp.zeros((p.shape[0], t * tp, *p.shape[2:]), p.dtype)
    y, x = None, x_BtD
    for i in range(tp):
        nxt = jax.lax.ppermute(x, axis, _ring(tp)) if i < tp - 1 else None
        part = mm(x)
        y = jax.tree.map(whole, part) if y is None else y
        at = (r - i) % tp * t
        y = jax.tree.map(lambda y, p: jax.lax.dynamic_update_slice_in_dim(y, p, at, 1),
                         y, part)
        x = nxt
    return y


def matmul_reducescatter(h_BT, mm: Callable, axis: str = TP_AXIS):
    """reduce_scatter(mm(h) along T) as a ring, for `mm` that maps each
    position on its own (a row-parallel matmul's partial sum): h (any pytree
    of [B, T, ...]) -> [B, T/tp, D], this rank's chunk of the sum over tp.

    The partial sums travel: the accumulator that ends on rank e starts on
    rank e + 1, and each rank it passes adds its own product for chunk e, so
    step i on rank r adds chunk r - 1 - i (tp - 1 hops)."""
    tp, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    t = jax.tree.leaves(h_BT)[0].shape[1] // tp
    part = lambda c: mm(jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, c * t, t, 1),
                                     h_BT))
    acc = part((r - 1) % tp)
    for i in range(1, tp):
        acc = jax.lax.ppermute(acc, axis, _ring(tp)) + part((r - 1 - i) % tp)
    return acc


def allgather_matmul_bidi(x_BtD, mm: Callable, axis: str = TP_AXIS):
    """`allgather_matmul` with each chunk's two halves going opposite ways
    round the ring (the JAX shard_map tutorial's bidirectional collective
    matmul): at step i rank r holds the first half of rank r - i's chunk
    (sent up) and the second half of rank r + i's (sent down) and multiplies
    both in one matmul. tp - 1 steps of two half-chunk permutes: the one-way
    ring's bytes, half of them on each direction of every link. The chunk
    length T/tp must be even."""
    tp, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    t = x_BtD.shape[1]
    h = t // 2
    whole = lambda p: jnp.zeros((p.shape[0], t * tp, *p.shape[2:]), p.dtype)
    y, lo, hi = None, x_BtD[:, :h], x_BtD[:, h:]
    for i in range(tp):
        # the next step's halves travel while this step's multiply
        nxt = (jax.lax.ppermute(lo, axis, _ring(tp, 1)),
               jax.lax.ppermute(hi, axis, _ring(tp, -1))) if i < tp - 1 else None
        part = mm(jnp.concatenate([lo, hi], 1))
        y = jax.tree.map(whole, part) if y is None else y
        put = lambda y, p: jax.lax.dynamic_update_slice_in_dim(
            jax.lax.dynamic_update_slice_in_dim(y, p[:, :h], (r - i) % tp * t, 1),
            p[:, h:], (r + i) % tp * t + h, 1)
        y = jax.tree.map(put, y, part)
        lo, hi = nxt if nxt else (None, None)
    return y


def matmul_reducescatter_bidi(h_BT, mm: Callable, axis: str = TP_AXIS):
    """`matmul_reducescatter` with the partial sums of each chunk's two
    halves going opposite ways: the first half's accumulator for chunk e
    starts on rank e + 1 and travels up, the second half's starts on rank
    e - 1 and travels down; each step multiplies the two halves a rank adds
    in one matmul. tp - 1 steps of two half-chunk permutes."""
    tp, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    t = jax.tree.leaves(h_BT)[0].shape[1] // tp
    h = t // 2
    rows = lambda a, lo, hi: jnp.concatenate([jax.lax.dynamic_slice_in_dim(a, lo * t, h, 1),
                                              jax.lax.dynamic_slice_in_dim(a, hi * t + h, h, 1)],
                                             1)
    part = lambda lo, hi: mm(jax.tree.map(lambda a: rows(a, lo, hi), h_BT))
    both = part((r - 1) % tp, (r + 1) % tp)
    up, down = both[:, :h], both[:, h:]
    for i in range(1, tp):
        both = part((r - 1 - i) % tp, (r + 1 + i) % tp)
        up = jax.lax.ppermute(up, axis, _ring(tp, 1)) + both[:, :h]
        down = jax.lax.ppermute(down, axis, _ring(tp, -1)) + both[:, h:]
    return jnp.concatenate([up, down], 1)
