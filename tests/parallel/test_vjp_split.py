"""The backward split in two (jaxtp.parallel.vjp_split): B and W together
give jax.vjp's gradients, and each matmul of the backward runs in exactly
one of them: an input gradient's in B, a weight gradient's in W."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtp.config import load_config
from jaxtp.model.build import build_model
from jaxtp.parallel import Layout
from jaxtp.parallel.vjp_split import split_vjp


def _mlp(w, x):
    """Two matmuls with a tanh between, rematerialised as a block is."""
    return jax.checkpoint(lambda w, x: jnp.tanh(x @ w["a"]) @ w["b"])(w, x)


def _dots(fn, *args) -> list[tuple[int, ...]]:
    """The shapes of the dot_generals `fn` runs, nested calls included."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                out.append(tuple(e.outvars[0].aval.shape))
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sorted(out)


def test_b_and_w_give_the_vjp_and_split_its_matmuls():
    """A rematerialised two-matmul function, x [8, 4], weights [4, 16] and
    [16, 4]: B's dots are the recomputed forward's first (x @ a) and the two
    input gradients ([8, 16], [8, 4]), W's the two weight gradients ([4, 16],
    [16, 4]); together they are the full backward's, none twice; the
    gradients equal jax.vjp's."""
    k = jax.random.split(jax.random.key(0), 4)
    w = {"a": jax.random.normal(k[0], (4, 16)), "b": jax.random.normal(k[1], (16, 4))}
    x, g = jax.random.normal(k[2], (8, 4)), jax.random.normal(k[3], (8, 4))
    s = split_vjp(_mlp, w, x)
    _, kept = s.forward(w, x)
    g_x, saved = s.backward_input(w, kept, g)
    g_w = s.backward_weights(w, kept, saved)
    want_w, want_x = jax.vjp(_mlp, w, x)[1](g)
    np.testing.assert_allclose(g_x, want_x, rtol=1e-6)
    for name in w:
        np.testing.assert_allclose(g_w[name], want_w[name], rtol=1e-6)
    b = _dots(lambda w, k, g: s.backward_input(w, k, g), w, kept, g)
    wd = _dots(lambda w, k, s_: s.backward_weights(w, k, s_), w, kept, saved)
    assert b == [(8, 4), (8, 16), (8, 16)] and wd == [(4, 16), (16, 4)]
    full = _dots(lambda w, x, g: jax.vjp(_mlp, w, x)[1](g), w, x, g)
    forward = _dots(_mlp, w, x)
    assert sorted(b + wd + forward) == full


@pytest.mark.parametrize("config, remat", [("llama-tiny", "minimal"), ("moe-tiny", "full")])
def test_a_blocks_split_backward_is_its_vjp(config, remat):
    """A Transformer block (a MoE one with its router statistics beside the
    stream) under remat: B then W equal jax.vjp's gradients in every
    parameter and the input."""
    cfg = load_config(config)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat))
    layout = Layout.of(cfg)
    with jax.set_mesh(layout.mesh(jax.devices()[:1])):
        model = build_model(cfg, layout)
    layer, (graphdef, w) = model._layer(), nnx.split(model.blocks[0])
    stats = jnp.zeros(2) if cfg.model.n_experts else None
    f = lambda w, c: layer(nnx.merge(graphdef, w), c, None)
    k = jax.random.split(jax.random.key(1), 2)
    x = (jax.random.normal(k[0], (2, 16, cfg.model.d_model)), stats)
    g = (jax.random.normal(k[1], x[0].shape), None if stats is None else jnp.ones(2))
    s = split_vjp(f, w, x)

    @jax.jit
    def both(w, x, g):
        kept = s.forward(w, x)[1]
        g_x, saved = s.backward_input(w, kept, g)
        return s.backward_weights(w, kept, saved), g_x

    got, want = both(w, x, g), jax.jit(lambda w, x, g: jax.vjp(f, w, x)[1](g))(w, x, g)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


test_a_blocks_split_backward_is_its_vjp.fast_cases = {"llama-tiny-minimal"}
