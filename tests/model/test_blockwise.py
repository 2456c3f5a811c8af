"""The blockwise kernel (jaxtp.model.blockwise): equal to the XLA reference
and to a naive one written from the definition, skips the blocks above the
diagonal, fits in O(T * block) memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtp.model import blockwise, kernels

RTOL, ATOL = 1e-5, 1e-6


def naive(q_BTKGH, k_BTKH, v_BTKH):
    """Written from the definition: every query head with its kv head repeated,
    a [T, T] mask of -inf, softmax, weighted sum (and the log-sum-exp)."""
    B, T, K, G, H = q_BTKGH.shape
    q = q_BTKGH.reshape(B, T, K * G, H).transpose(0, 2, 1, 3)
    k = jnp.repeat(k_BTKH, G, axis=2).transpose(0, 2, 1, 3)
    v = jnp.repeat(v_BTKH, G, axis=2).transpose(0, 2, 1, 3)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(H)
    s = jnp.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    o = jax.nn.softmax(s, -1) @ v
    lse = jax.nn.logsumexp(s, -1).reshape(B, K, G, T)
    return o.transpose(0, 2, 1, 3).reshape(B, T, K, G, H), lse


def inputs(B, T, K, G, H, seed=0):
    rng = np.random.default_rng(seed)
    q, c = (jnp.asarray(rng.normal(size=(B, T, K, G, H)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
    return q, k, v, c


# MHA, GQA, MQA; T a multiple of the block, not one, and shorter than one block
CASES = {"mha-T37-b8": (2, 37, 4, 1, 16, 8), "gqa-T64-b16": (2, 64, 2, 3, 8, 16),
         "mqa-T50-b16": (1, 50, 1, 4, 8, 16), "gqa-T20-b512": (2, 20, 2, 2, 8, 512)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_blockwise_equals_xla_and_the_definition(case):
    B, T, K, G, H, block = CASES[case]
    q, k, v, c = inputs(B, T, K, G, H)
    o_ref, lse_ref = naive(q, k, v)
    o_x, lse_x = kernels.xla_attention(q, k, v, return_lse=True)
    o_b, lse_b = blockwise.blockwise_with_lse(q, k, v, block)
    for o, lse in ((o_x, lse_x), (o_b, lse_b)):
        np.testing.assert_allclose(o, o_ref, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(lse, lse_ref, rtol=RTOL, atol=ATOL)
    grads = lambda fn: jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * c),
                                        argnums=(0, 1, 2)))(q, k, v)
    want = grads(lambda q, k, v: naive(q, k, v)[0])
    for fn in (kernels.xla_attention, lambda q, k, v: blockwise.blockwise_attention(q, k, v, block)):
        for got, w, name in zip(grads(fn), want, "qkv"):
            np.testing.assert_allclose(got, w, rtol=RTOL, atol=ATOL, err_msg=f"d{name}")


test_blockwise_equals_xla_and_the_definition.fast_cases = {'gqa-T64-b16', 'mha-T37-b8'}


def test_blockwise_never_reads_the_blocks_above_the_diagonal():
    """Keys and values of the last block made NaN: a kernel that masks them
    (xla) still multiplies them (0 * NaN), one that skips them (blockwise)
    leaves every earlier query block untouched, forward and backward."""
    q, k, v, c = inputs(1, 64, 2, 2, 8)
    k, v = k.at[:, 48:].set(jnp.nan), v.at[:, 48:].set(jnp.nan)
    o = blockwise.blockwise_attention(q, k, v, 16)
    assert np.isfinite(o[:, :48]).all() and np.isnan(o[:, 48:]).any()
    assert np.isnan(kernels.xla_attention(q, k, v)[:, :48]).all()
    dq = jax.grad(lambda q: jnp.sum(blockwise.blockwise_attention(q, k, v, 16)[:, :48]))(q)
    assert np.isfinite(dq[:, :48]).all()


@pytest.mark.slow
def test_blockwise_temporaries_grow_with_t_times_block_not_t_squared():
    """Forward + backward at T = 2048 and 4096 (block 256): XLA's temporaries
    hold [B, heads, T, T] scores and grow 4x; blockwise's grow ~2x."""
    def temps(fn, T):
        q, k, v, c = (jax.ShapeDtypeStruct(s, jnp.float32) for s in
                      ((1, T, 2, 2, 32), (1, T, 2, 32), (1, T, 2, 32), (1, T, 2, 2, 32)))
        g = jax.jit(jax.grad(lambda q, k, v, c: jnp.sum(fn(q, k, v) * c), argnums=(0, 1, 2)))
        return g.lower(q, k, v, c).compile().memory_analysis().temp_size_in_bytes

    blocks = lambda q, k, v: blockwise.blockwise_attention(q, k, v, 256)
    x1, x2 = temps(kernels.xla_attention, 2048), temps(kernels.xla_attention, 4096)
    b1, b2 = temps(blocks, 2048), temps(blocks, 4096)
    assert x2 > 3.5 * x1 and b2 < 2.5 * b1
    assert b2 < x2 / 8
