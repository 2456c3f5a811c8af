"""Collective matmul rings against the collective they replace (and its gradient),
and the HLO they compile to: tp - 1 collective-permutes, no all-gather."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtp import hlo
from jaxtp.parallel import TP_AXIS, make_mesh
from jaxtp.parallel.overlap import (allgather_matmul, allgather_matmul_bidi,
                                   matmul_reducescatter, matmul_reducescatter_bidi)

B, T, D, F = 2, 16, 8, 12


def sharded(fn, in_specs, out_specs, tp):
    mesh = make_mesh(1, tp)
    return mesh, jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                       axis_names={TP_AXIS}, check_vma=False))


def check_ring(ring, mesh, x, w, tp: int, replaces: str, tol: float, grad_tol: float,
               bidi: bool = False):
    """The ring equals x @ w in value (to `tol`) and gradient (`grad_tol`),
    and compiles to tp - 1 collective-permutes forward, 2(tp - 1) with its
    gradient (the reverse ring), and no `replaces` (nor the other SP
    collective) anywhere; `bidi`: twice as many, of half a chunk each, half
    of them sent each way."""
    loss = lambda x, w: (ring(x, w) ** 2).sum()
    with jax.set_mesh(mesh):  # each program compiled once: run, then read
        forward = ring.lower(x, w).compile()
        backward = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile()
        np.testing.assert_allclose(forward(x, w), x @ w, rtol=tol, atol=tol)
        want = jax.grad(lambda x, w: ((x @ w) ** 2).sum(), (0, 1))(x, w)
        for g, r in zip(backward(x, w), want):
            np.testing.assert_allclose(g, r, rtol=grad_tol, atol=grad_tol)
        text, grad_text = forward.as_text(), backward.as_text()
    permutes = [c for c in hlo.collectives(text) if c.kind == "collective-permute"]
    kinds = [c.kind for c in hlo.collectives(text)]
    assert len(permutes) == (tp - 1) * (1 + bidi) and replaces not in kinds
    # one sequence chunk (bidi: half of one) of the [B, T, .] array a permute carries
    assert {c.shape[1] for c in permutes} == {T // tp // (1 + bidi)}
    grad_kinds = [c.kind for c in hlo.collectives(grad_text)]
    assert grad_kinds.count("collective-permute") == 2 * (tp - 1) * (1 + bidi)
    assert "all-gather" not in grad_kinds and "reduce-scatter" not in grad_kinds


@pytest.mark.parametrize("tp, bidi", [(2, False), (8, False), (2, True), (4, True), (8, True)],
                         ids=["2", "8", "bidi-2", "bidi-4", "bidi-8"])
def test_allgather_matmul_equals_gather_then_matmul(tp, bidi):
    x = jax.random.normal(jax.random.PRNGKey(0), (B, T, D))
    w = jax.random.normal(jax.random.PRNGKey(1), (D, F))
    # w replicated: every rank computes the whole [B, T, F]
    ring_fn = allgather_matmul_bidi if bidi else allgather_matmul
    mesh, ring = sharded(lambda x, w: ring_fn(x, lambda c: c @ w),
                         (P(None, TP_AXIS), P()), P(), tp)
    # forward: the same products, measured equal; backward: dw sums the chunks'
    # products in ring order (measured 1.5e-6 at tp 2 as |a-b| / (1 + |b|))
    check_ring(ring, mesh, x, w, tp, "all-gather", tol=1e-6, grad_tol=1e-5, bidi=bidi)


@pytest.mark.parametrize("tp, bidi", [(2, False), (8, False), (2, True), (4, True), (8, True)],
                         ids=["2", "8", "bidi-2", "bidi-4", "bidi-8"])
def test_matmul_reducescatter_equals_matmul_then_reduce_scatter(tp, bidi):
    # each rank holds a different [B, T, F] partial input (F split over tp)
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, F * tp))
    w = jax.random.normal(jax.random.PRNGKey(3), (F * tp, D))
    ring_fn = matmul_reducescatter_bidi if bidi else matmul_reducescatter
    mesh, ring = sharded(lambda x, w: ring_fn(x, lambda c: c @ w),
                         (P(None, None, TP_AXIS), P(TP_AXIS)), P(None, TP_AXIS), tp)
    # forward: tp partial products summed in ring order (measured 1.9e-6 at tp
    # 8); backward: dx and dw of those sums, reassociated (measured 2.0e-5)
    check_ring(ring, mesh, x, w, tp, "reduce-scatter", tol=1e-5, grad_tol=1e-4, bidi=bidi)


test_allgather_matmul_equals_gather_then_matmul.fast_cases = {"8", "bidi-8"}
test_matmul_reducescatter_equals_matmul_then_reduce_scatter.fast_cases = {"8", "bidi-8"}


def test_the_bidirectional_rings_send_half_of_each_step_each_way():
    """Each step of a bidirectional ring is two permutes: one to rank + 1,
    one to rank - 1 (at tp = 2 both go to the other rank)."""
    tp = 4
    x = jax.random.normal(jax.random.PRNGKey(7), (B, T, D))
    w = jax.random.normal(jax.random.PRNGKey(8), (D, F))
    _, ring = sharded(lambda x, w: allgather_matmul_bidi(x, lambda c: c @ w),
                      (P(None, TP_AXIS), P()), P(), tp)
    pairs = {tuple(sorted(c.groups)) for c in hlo.collectives(ring.lower(x, w).compile()
                                                             .as_text())}
    up = tuple(sorted((j, (j + 1) % tp) for j in range(tp)))
    down = tuple(sorted((j, (j - 1) % tp) for j in range(tp)))
    assert pairs == {up, down}


def test_an_entry_ring_carries_several_outputs():
    """`mm` may return a pytree (the replicated-kv attention's q and kv from
    one gathered x): every output is whole along T, each rank's own chunk in
    place, from one ring of tp - 1 permutes."""
    tp = 4
    x = jax.random.normal(jax.random.PRNGKey(4), (B, T, D))
    w1, w2 = (jax.random.normal(jax.random.PRNGKey(k), (D, n)) for k, n in ((5, F), (6, 3)))
    mesh, ring = sharded(lambda x: allgather_matmul(x, lambda c: (c @ w1, c @ w2)),
                         (P(None, TP_AXIS),), (P(), P()), tp)
    with jax.set_mesh(mesh):
        a, b = ring(x)
        kinds = [c.kind for c in hlo.collectives(ring.lower(x).compile().as_text())]
    np.testing.assert_allclose(a, x @ w1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b, x @ w2, rtol=1e-5, atol=1e-5)
    assert kinds == ["collective-permute"] * (tp - 1)
