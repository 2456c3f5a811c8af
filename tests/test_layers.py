"""Each weight carries the PartitionSpec its layer promises, and lands that way."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtp.config import Config, ModelConfig, ParallelConfig
from jaxtp.layers import RowParallelLinear
from jaxtp.sharding import make_mesh
from jaxtp.train_lib import init_params

MODEL = ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16,
                    tie_embeddings=False)

EXPECTED = {  # path suffix -> spec; column: output dim on tp, row: input dim on tp
    ("attn", "qkv", "kernel"): P(None, None, "tp", None),  # [D, 3, N, H]
    ("attn", "qkv", "bias"): P(None, "tp", None),
    ("attn", "out", "kernel"): P("tp", None, None),  # [N, H, D]
    ("attn", "out", "bias"): P(),
    ("mlp", "up", "kernel"): P(None, "tp"),  # [D, F]
    ("mlp", "up", "bias"): P("tp"),
    ("mlp", "down", "kernel"): P("tp", None),  # [F, D]
    ("mlp", "down", "bias"): P(),
}

@pytest.mark.parametrize("tp", [2, 8])
def test_every_weight_has_its_layers_sharding(tp):
    mesh = make_mesh(1, tp)
    _, params, shardings = init_params(Config(MODEL, parallel=ParallelConfig(tp=tp)), mesh)
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
    seen = 0
    for path, arr in flat:
        keys = tuple(str(k.key) for k in path)
        want = EXPECTED.get(keys[-3:], P())  # embeddings, norms, head: replicated
        got = arr.sharding.spec
        assert tuple(got) + (None,) * (arr.ndim - len(got)) == \
            tuple(want) + (None,) * (arr.ndim - len(want)), keys
        if keys[-3:] in EXPECTED:
            seen += 1
            shard = arr.addressable_shards[0].data.shape
            split = [i for i, a in enumerate(want) if a == "tp"]
            assert [arr.shape[i] // shard[i] for i in split] == [tp] * len(split), keys
    assert seen == len(EXPECTED) * MODEL.n_layers

def test_row_parallel_bias_is_added_once():
    """Under tp=4 the row-parallel output is X W + b, not X W + tp*b."""
    mesh = make_mesh(1, 4)
    with jax.set_mesh(mesh):
        layer = RowParallelLinear((8,), ("mlp",), 4, use_bias=True, std=1.0,
                                  dtype="float32", param_dtype="float32", rngs=nnx.Rngs(0))
        layer.bias[...] = jax.numpy.arange(4.0)
        x = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)
        y = jax.jit(lambda m, x: m(x))(layer, x)
    w, b = np.asarray(layer.kernel[...]), np.arange(4.0)
    np.testing.assert_allclose(y, x @ w + b, rtol=1e-5, atol=1e-6)
