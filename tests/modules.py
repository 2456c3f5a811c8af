"""A module (MLP, attention) at tp under shard_map and gspmd against the
single-device reference of tests/reference.py: its output, dX and every
parameter gradient. The tests are tests/model/test_mlp.py and test_attention.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import reference
from jaxtp.config import ModelConfig
from jaxtp.model.attention import Attention
from jaxtp.model.mlp import MLP
from jaxtp.parallel import Layout, make_mesh
from reference import host_params

RTOL, ATOL = 1e-5, 1e-6
CFGS = {
    "gpt2": ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16),
    # SwiGLU, RoPE and 2 kv heads (sharded at tp=2, replicated at 8), with biases
    "llama": ModelConfig(style="llama", vocab_size=64, n_layers=2, d_model=64, n_heads=8,
                         n_kv_heads=2, d_ff=64, seq_len=16),
    # Qwen3's attention: a head dim of 16, not D/N = 8, and q/k RMSNorm per head
    "qwen3": ModelConfig(style="llama", vocab_size=64, n_layers=2, d_model=64, n_heads=8,
                         n_kv_heads=2, d_head=16, qk_norm=True, d_ff=64, seq_len=16,
                         use_bias=False),
}
MODULES = {"mlp": (MLP, reference.mlp), "attention": (Attention, reference.attention)}


def module_value_and_grads(cls, tp, impl, CFG):
    """Output, d(x), d(params) of a module at tp, with the loss mean(y * c)
    (mean-reduced like a training loss, so gradients have a training scale)."""
    mesh = make_mesh(1, tp, impl=impl)
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


CASES = [("gpt2", 1)] + [(s, tp) for s in ("gpt2", "llama") for tp in (2, 8)]


def check_module(name, tp, style, impls=("shard_map", "gspmd")):
    """Under each of `impls` the module's output, dX and every parameter
    gradient equal one device's reference (tests/reference.py), and the
    outputs each other."""
    cls, ref_fn = MODULES[name]
    CFG = CFGS[style]
    runs = [module_value_and_grads(cls, tp, impl, CFG) for impl in impls]
    for x, c, params, y, dx, dp in runs:
        (_, y_ref), ref_grads = reference_of(name, style)(params, x, c)
        np.testing.assert_allclose(y, y_ref, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(dx, ref_grads[1], rtol=RTOL, atol=ATOL)
        paths = jax.tree_util.tree_flatten_with_path(ref_grads[0])[0]
        assert len(paths) == len(jax.tree.leaves(dp))
        for (path, want), got in zip(paths, jax.tree.leaves(dp)):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                                       err_msg=jax.tree_util.keystr(path))
    for run in runs[1:]:
        np.testing.assert_allclose(run[3], runs[0][3], rtol=RTOL, atol=ATOL)
