"""The shard_map variants: same numbers as GSPMD and as one device, and the
f/g operators produce exactly the analytic gradients (a doubled or missing
all-reduce is caught)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import reference
from reference import host_params
from jaxtp.config import ModelConfig
from jaxtp.model.attention import Attention
from jaxtp.model.mlp import MLP
from jaxtp.parallel import Layout, f, g, make_mesh

RTOL, ATOL = 1e-5, 1e-6
CFGS = {
    "gpt2": ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16),
    # SwiGLU, RoPE and 2 kv heads (sharded at tp=2, replicated at 8), with biases
    "llama": ModelConfig(style="llama", vocab_size=64, n_layers=2, d_model=64, n_heads=8,
                         n_kv_heads=2, d_ff=64, seq_len=16),
}
MODULES = {"mlp": (MLP, reference.mlp), "attention": (Attention, reference.attention)}


def module_value_and_grads(cls, tp, impl, CFG):
    """Output, d(x), d(params) of a module at tp, with the loss mean(y * c)
    (mean-reduced like a training loss, so gradients have a training scale)."""
    mesh = make_mesh(1, tp)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, CFG.seq_len, CFG.d_model)).astype(np.float32)
    c = rng.normal(size=x.shape).astype(np.float32)
    layout = Layout.make(tp=tp, impl=impl, kv_sharded=CFG.kv_heads % tp == 0)

    def create():
        params = nnx.split(cls(CFG, layout, rngs=nnx.Rngs(3)))[1]
        # non-zero biases, so a row-parallel bias added before the reduction
        # (tp times) would show
        return jax.tree_util.tree_map_with_path(
            lambda path, v: v + 0.1 * (1 + jnp.arange(v.size).reshape(v.shape) % 7)
            if "bias" in jax.tree_util.keystr(path) else v, params)

    with jax.set_mesh(mesh):
        # one program lays each weight out by its spec (eagerly: a program per op)
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(CFG, layout,
                                                                  rngs=nnx.Rngs(3))))
        params = jax.jit(create, out_shardings=nnx.get_named_sharding(abstract, mesh))()

        def loss(params, x):
            y = nnx.merge(graphdef, params)(x)
            return jnp.mean(y * c), y

        (_, y), (dp, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params, x)
    return x, c, host_params(params), np.asarray(y), np.asarray(dx), host_params(dp)


@functools.cache
def reference_of(name, style):
    """The single-device reference's ((loss, y), (d params, dx)), one jit per module and
    style (compiled once, shared by every tp)."""
    ref_fn, CFG = MODULES[name][1], CFGS[style]

    def loss(params, x, c):
        y = ref_fn(params, x, CFG)
        return jnp.mean(y * c), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("style, tp", [("gpt2", 1)] + [(s, tp) for s in sorted(CFGS)
                                                        for tp in (2, 8)])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_matches_gspmd_and_reference(name, tp, style):
    cls, ref_fn = MODULES[name]
    CFG = CFGS[style]
    x, c, params, y_sm, dx_sm, dp_sm = module_value_and_grads(cls, tp, "shard_map", CFG)
    _, _, params_g, y_g, dx_g, dp_g = module_value_and_grads(cls, tp, "gspmd", CFG)
    (_, y_ref), ref_grads = reference_of(name, style)(params, x, c)
    for y, dx, dp in ((y_sm, dx_sm, dp_sm), (y_g, dx_g, dp_g)):
        np.testing.assert_allclose(y, y_ref, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(dx, ref_grads[1], rtol=RTOL, atol=ATOL)
        for got, want in zip(jax.tree.leaves(dp), jax.tree.leaves(ref_grads[0])):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(y_sm, y_g, rtol=RTOL, atol=ATOL)


test_module_matches_gspmd_and_reference.fast_cases = {'attention-llama-8', 'mlp-gpt2-8'}


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
