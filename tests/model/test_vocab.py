"""Vocab-parallel embedding, LM head and cross-entropy against plain numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtp.config import ModelConfig
from jaxtp.model.vocab import VocabEmbed
from jaxtp.parallel import Layout, make_mesh

CFG = ModelConfig(vocab_size=61, vocab_multiple=16, d_model=8)  # padded to 64


def make(tp, impl, pad_value=None):
    mesh = make_mesh(1, tp)
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(VocabEmbed(CFG, Layout.make(tp=tp, impl=impl), rngs=nnx.Rngs(0)))
        if pad_value is not None:  # poison the padding rows
            table = params["embedding"][...]
            params["embedding"][...] = table.at[CFG.vocab_size:].set(pad_value)
    return mesh, graphdef, params


def numpy_ce(table, x, targets):
    logits = x.astype(np.float64) @ table[: CFG.vocab_size].astype(np.float64).T
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1)[..., 0]


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_loss_is_the_unsharded_cross_entropy_and_ignores_padding(tp, impl):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, CFG.d_model)).astype(np.float32)
    targets = rng.integers(0, CFG.vocab_size, (3, 5)).astype(np.int32)
    # padding rows set huge: if they took any probability the loss would move
    mesh, graphdef, params = make(tp, impl, pad_value=50.0)
    with jax.set_mesh(mesh):
        losses = jax.jit(lambda p, x, t: nnx.merge(graphdef, p).token_losses(x, t))(
            params, x, targets)
        logits = jax.jit(lambda p, x: nnx.merge(graphdef, p).logits(x))(params, x)
    table = np.asarray(params["embedding"][...])
    np.testing.assert_allclose(losses, numpy_ce(table, x, targets), rtol=1e-5, atol=1e-6)
    assert logits.shape == (3, 5, CFG.vocab_size)  # padded entries never predicted
    np.testing.assert_allclose(logits, x @ table[: CFG.vocab_size].T, rtol=1e-5, atol=1e-5)


test_loss_is_the_unsharded_cross_entropy_and_ignores_padding.fast_cases = {'8-shard_map', '8-gspmd'}


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
@pytest.mark.parametrize("tp", [1, 8])
def test_lookup_and_untouched_rows_get_exactly_zero_gradient(tp, impl):
    ids = np.array([[3, 17, 3, 60], [0, 42, 17, 9]], np.int32)
    c = np.random.default_rng(1).normal(size=(2, 4, CFG.d_model)).astype(np.float32)
    mesh, graphdef, params = make(tp, impl)
    with jax.set_mesh(mesh):
        f = lambda p: jnp.sum(nnx.merge(graphdef, p)(ids) * c)
        x = jax.jit(lambda p: nnx.merge(graphdef, p)(ids))(params)
        grad = np.asarray(jax.jit(jax.grad(f))(params)["embedding"][...])
    table = np.asarray(params["embedding"][...])
    np.testing.assert_array_equal(x, table[ids])
    want = np.zeros_like(table)
    np.add.at(want, ids.reshape(-1), c.reshape(-1, CFG.d_model))
    untouched = np.setdiff1d(np.arange(len(table)), ids)
    assert np.all(grad[untouched] == 0.0)  # exactly, not approximately
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-7)


test_lookup_and_untouched_rows_get_exactly_zero_gradient.fast_cases = {'8-shard_map'}
