"""Each weight carries the PartitionSpec its layer promises, and lands that way."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtp.config import Config, ModelConfig, ParallelConfig
from jaxtp.parallel import make_mesh
from jaxtp.train.state import init_params

GPT2 = ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16,
                   tie_embeddings=False)
LLAMA_GQA = ModelConfig(style="llama", vocab_size=64, n_layers=2, d_model=64, n_heads=8,
                        n_kv_heads=4, d_ff=64, seq_len=16, tie_embeddings=False,
                        use_bias=False)

COLUMN_ROW = {  # path suffix -> spec; column: output dim on tp, row: input dim on tp
    ("attn", "q", "kernel"): P(None, "tp", None),  # [D, N, H]
    ("attn", "q", "bias"): P("tp", None),
    ("attn", "kv", "kernel"): P(None, None, "tp", None),  # [D, 2, K, H]
    ("attn", "kv", "bias"): P(None, "tp", None),
    ("attn", "out", "kernel"): P("tp", None, None),  # [N, H, D]
    ("attn", "out", "bias"): P(),
    ("mlp", "up", "kernel"): P(None, "tp"),  # [D, F]; SwiGLU [D, 2, F]
    ("mlp", "up", "bias"): P("tp"),
    ("mlp", "down", "kernel"): P("tp", None),  # [F, D]
    ("mlp", "down", "bias"): P(),
    ("wte", "embedding"): P("tp", None),  # [V, D], vocab-parallel
    ("lm_head", "embedding"): P("tp", None),
}


def _full(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def layouts(model, tp):
    mesh = make_mesh(1, tp)
    _, params, _ = init_params(Config(model, parallel=ParallelConfig(tp=tp)), mesh)
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
    return {tuple(str(k.key) for k in path): arr for path, arr in flat}


def _expected(keys, model, tp):
    want = COLUMN_ROW.get(keys[-3:], COLUMN_ROW.get(keys[-2:], P()))
    if model.style == "llama" and keys[-2:] == ("up", "kernel"):
        want = P(None, None, "tp")  # [D, 2, F]
    if keys[-2] == "kv" and model.kv_heads < tp:
        want = P()  # fewer kv heads than tp: replicated
    return want


@pytest.mark.slow
@pytest.mark.parametrize("model, tp", [(GPT2, 2), (GPT2, 8), (LLAMA_GQA, 2), (LLAMA_GQA, 8)])
def test_every_weight_has_its_layers_sharding(model, tp):
    seen = 0
    for keys, arr in layouts(model, tp).items():
        want = _expected(keys, model, tp)
        assert _full(arr.sharding.spec, arr.ndim) == _full(want, arr.ndim), keys
        split = [i for i, a in enumerate(_full(want, arr.ndim)) if a == "tp"]
        shard = arr.addressable_shards[0].data.shape
        assert [arr.shape[i] // shard[i] for i in split] == [tp] * len(split), keys
        assert all(arr.shape[i] == shard[i] for i in range(arr.ndim) if i not in split), keys
        seen += bool(split)
    per_block = 8 if model.use_bias else 5  # q, kv, out, up, down (+ q, kv, up biases)
    if model.kv_heads < tp:
        per_block -= 1 + model.use_bias  # the kv kernel (and bias) is replicated
    assert seen == per_block * model.n_layers + 2  # + embedding and LM head




@pytest.mark.slow
def test_replicated_kv_costs_the_full_projection_per_device():
    """With 4 kv heads at tp=8 every device holds all of W_kv (2*D*K*H floats)
    but only 1/8 of W_q; at tp=4 W_kv is split like W_q."""
    at8, at4 = layouts(LLAMA_GQA, 8), layouts(LLAMA_GQA, 4)
    D, K, H = LLAMA_GQA.d_model, LLAMA_GQA.kv_heads, LLAMA_GQA.head_dim
    kv8 = at8[("blocks", "0", "attn", "kv", "kernel")]
    q8 = at8[("blocks", "0", "attn", "q", "kernel")]
    assert {s.data.nbytes for s in kv8.addressable_shards} == {D * 2 * K * H * 4}
    assert {s.data.nbytes for s in q8.addressable_shards} == {q8.nbytes // 8}
    kv4 = at4[("blocks", "0", "attn", "kv", "kernel")]
    assert {s.data.nbytes for s in kv4.addressable_shards} == {D * 2 * K * H * 4 // 4}


def test_rope_matches_a_complex_number_reference_over_256_tokens():
    """Pair (i, i + H/2) as the complex number x_i + j x_{i+H/2}; position m
    multiplies it by exp(j m theta^(-2i/H)) (Su et al. 2021, Sec. 3.2)."""
    from jaxtp.model.layers import rope

    T, N, H, theta = 256, 3, 16, 10000.0
    x = np.random.default_rng(0).normal(size=(2, T, N, H))
    z = x[..., : H // 2] + 1j * x[..., H // 2:]
    angle = np.arange(T)[:, None] * theta ** (-np.arange(H // 2) * 2.0 / H)[None]
    z = z * np.exp(1j * angle)[None, :, None, :]
    want = np.concatenate([z.real, z.imag], axis=-1)
    got = rope(jax.numpy.asarray(x, jax.numpy.float32), jax.numpy.arange(T), theta)
    # fp32 angles up to 255 rad: sin/cos carry ~1e-5 absolute error at the far end
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got[:, :32], want[:, :32], rtol=0, atol=2e-6)


def test_rope_depends_only_on_relative_position():
    from jaxtp.model.layers import rope

    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(1, 1, 1, 8)), rng.normal(size=(1, 1, 1, 8))
    at = lambda v, m: np.asarray(rope(jax.numpy.asarray(v, jax.numpy.float32),
                                      jax.numpy.array([m]), 500.0))
    dots = [float(np.sum(at(q, m + s) * at(k, n + s))) for (m, n) in ((5, 2), (9, 9))
            for s in (0, 7, 40)]
    np.testing.assert_allclose(dots[:3], dots[0], rtol=1e-5)
    np.testing.assert_allclose(dots[3:], dots[3], rtol=1e-5)
    assert abs(dots[0] - dots[3]) > 1e-3  # and it does depend on m - n
