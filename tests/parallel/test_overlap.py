"""Collective matmul rings against the collective they replace (and its gradient),
and the HLO they compile to: tp - 1 collective-permutes, no all-gather."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtp import hlo
from jaxtp.parallel import IMPL_AXIS, make_mesh
from jaxtp.parallel.overlap import allgather_matmul, matmul_reducescatter

B, T, D, F = 2, 16, 8, 12


def sharded(fn, in_specs, out_specs, tp):
    mesh = make_mesh(1, tp)
    return mesh, jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                       axis_names={IMPL_AXIS}, check_vma=False))


@pytest.mark.parametrize("tp", [2, 8])
def test_allgather_matmul_equals_gather_then_matmul(tp):
    x = jax.random.normal(jax.random.PRNGKey(0), (B, T, D))
    w = jax.random.normal(jax.random.PRNGKey(1), (D, F))
    # w replicated: every rank computes the whole [B, T, F]
    mesh, ring = sharded(allgather_matmul, (P(None, IMPL_AXIS), P()), P(), tp)
    with jax.set_mesh(mesh):
        got = ring(x, w)
        np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
        # the gradient through the ring (its transpose: the reverse ring)
        loss = lambda x, w: (ring(x, w) ** 2).sum()
        gx, gw = jax.grad(loss, (0, 1))(x, w)
        rx, rw = jax.grad(lambda x, w: ((x @ w) ** 2).sum(), (0, 1))(x, w)
        np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gw, rw, rtol=1e-4, atol=1e-4)
        text = ring.lower(x, w).compile().as_text()
        grad_text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile().as_text()
    kinds = [c.kind for c in hlo.collectives(text)]
    assert kinds.count("collective-permute") == tp - 1 and "all-gather" not in kinds
    # the backward pass is a ring too (the reverse one), not a gather
    grad_kinds = [c.kind for c in hlo.collectives(grad_text)]
    assert grad_kinds.count("collective-permute") == 2 * (tp - 1)
    assert "all-gather" not in grad_kinds and "reduce-scatter" not in grad_kinds


@pytest.mark.parametrize("tp", [2, 8])
def test_matmul_reducescatter_equals_matmul_then_reduce_scatter(tp):
    # each rank holds a different [B, T, F] partial input (F split over tp)
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, F * tp))
    w = jax.random.normal(jax.random.PRNGKey(3), (F * tp, D))
    mesh, ring = sharded(matmul_reducescatter, (P(None, None, IMPL_AXIS), P(IMPL_AXIS)),
                         P(None, IMPL_AXIS), tp)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(ring(x, w), x @ w, rtol=1e-4, atol=1e-4)
        loss = lambda x, w: (ring(x, w) ** 2).sum()
        gx, gw = jax.grad(loss, (0, 1))(x, w)
        rx, rw = jax.grad(lambda x, w: ((x @ w) ** 2).sum(), (0, 1))(x, w)
        np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gw, rw, rtol=1e-4, atol=1e-4)
        text = ring.lower(x, w).compile().as_text()
        grad_text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile().as_text()
    kinds = [c.kind for c in hlo.collectives(text)]
    assert kinds.count("collective-permute") == tp - 1 and "reduce-scatter" not in kinds
    grad_kinds = [c.kind for c in hlo.collectives(grad_text)]
    assert grad_kinds.count("collective-permute") == 2 * (tp - 1)
    assert "all-gather" not in grad_kinds and "reduce-scatter" not in grad_kinds


test_allgather_matmul_equals_gather_then_matmul.fast_cases = {"8"}
test_matmul_reducescatter_equals_matmul_then_reduce_scatter.fast_cases = {"8"}
