"""Megatron's f and g (jaxtp.parallel.collectives) give exactly the analytic
gradients; a doubled or missing all-reduce is caught. (The modules built on
them: tests/model/test_mlp.py, test_attention.py.)"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtp.parallel import f, g, make_mesh, wide

# --- f and g against hand-derived gradients ---------------------------------
# y = (x A) B with A: [D, F] column-parallel and B: [F, D] row-parallel;
# L = sum(y * C). Then dL/dx = C B^T A^T, dL/dA = x^T C B^T, dL/dB = (x A)^T C.

D, F, TP = 8, 16, 4


def _pair(x, a, b, *, body, check_vma=True):
    return jax.shard_map(body, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P(),
                         axis_names={"tp"}, check_vma=check_vma)(x, a, b)


def megatron(x, a, b):
    return g(f(x) @ a @ b)


def doubled_g(x, a, b):  # the bug: reduce the partial output twice
    return g(g(f(x) @ a @ b) / 1.0)


def _grads(body, **kw):
    rng = np.random.default_rng(1)
    x, c = rng.normal(size=(3, D)).astype(np.float32), rng.normal(size=(3, D)).astype(np.float32)
    a, b = rng.normal(size=(D, F)).astype(np.float32), rng.normal(size=(F, D)).astype(np.float32)
    with jax.set_mesh(make_mesh(1, TP)):
        loss = lambda x, a, b: jnp.sum(_pair(x, a, b, body=body, **kw) * c)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, a, b)
    analytic = (c @ b.T @ a.T, x.T @ (c @ b.T), (x @ a).T @ c)
    return [np.asarray(v) for v in grads], analytic


def test_f_and_g_give_the_analytic_gradients():
    got, want = _grads(megatron)
    for gv, wv in zip(got, want):
        np.testing.assert_allclose(gv, wv, rtol=1e-5, atol=1e-5)


def test_a_doubled_all_reduce_is_caught():
    """psum of an already-reduced value: the output, and every gradient upstream,
    comes out tp times too large, and the analytic comparison sees it."""
    got, want = _grads(doubled_g, check_vma=False)
    assert not np.allclose(got[0], want[0], rtol=1e-3)
    np.testing.assert_allclose(got[0], TP * want[0], rtol=1e-5, atol=1e-5)


def test_a_missing_g_is_caught():
    """Without g each rank's output is only its partial sum x A_i B_i."""
    got, want = _grads(lambda x, a, b: f(x) @ a @ b, check_vma=False)
    assert not np.allclose(got[0], want[0], rtol=1e-3)
    assert not np.allclose(got[1], want[1], rtol=1e-3)


def test_check_vma_supplies_f_when_it_is_left_out():
    """Under check_vma=True a replicated x meeting a tp-varying weight is cast
    to varying automatically, so leaving out f cannot drop the dX all-reduce."""
    got, want = _grads(lambda x, a, b: g(x @ a @ b))
    for gv, wv in zip(got, want):
        np.testing.assert_allclose(gv, wv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("given", [np.float32, np.float16, "bfloat16", "float32", jnp.bfloat16,
                                   np.dtype("float16"), jnp.ones(2, jnp.bfloat16)],
                         ids=["np.float32", "np.float16", "'bfloat16'", "'float32'",
                              "jnp.bfloat16", "dtype-f16", "bf16-array"])
def test_wide_is_float32_for_every_dtype_up_to_32_bits(given):
    """jaxtp.parallel.wide: softmaxes, norms and sums in float32 for fp32 and
    16-bit inputs, given as a dtype, a scalar type or an array (np.float32
    has a class attribute `dtype`: it was once taken for an array's)."""
    assert wide(given) == jnp.float32


def test_wide_keeps_float64_under_x64():
    with jax.enable_x64(True):
        assert wide(np.float64) == wide("float64") == wide(jnp.ones(2, jnp.float64)) == jnp.float64
