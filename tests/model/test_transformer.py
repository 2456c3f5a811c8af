"""tp degrees 1, 2 and 8 and every implementation compute what one device computes.

The reference is tests/reference.py (plain jnp, one device), fed the same
parameters; jaxtp at tp 1, 2 and 8, under gspmd and shard_map, must match its
logits, loss and every gradient to fp32 tolerance; so must explicit (sharding
in types) for GPT-2 and GQA, kv heads sharded and replicated.

The cases cover each model and kv layout (sharded, replicated) under each impl
at tp 2 and 8, not every product of them: tp=4 runs at dp=2 x tp=4
(tests/train/test_scale.py), where a tp of 4 meets a dp axis too.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtp.config import Config, ModelConfig, ParallelConfig
from jaxtp.model import unstack_layers
from jaxtp.parallel import Layout, Schedule, make_mesh
from jaxtp.train.state import init_params
from jaxtp.train.step import loss_fn
from cached import initial_params, initial_values
from reference import forward, host_params, loss as ref_loss

RTOL, ATOL = 1e-5, 1e-6
MODEL = ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16)
LLAMA = dict(style="llama", vocab_size=61, n_layers=2, d_model=64, n_heads=8, d_ff=64,
             seq_len=16, tie_embeddings=False, use_bias=False, rope_theta=500.0)
VARIANTS = {
    "gpt2": MODEL,
    "llama-mha": ModelConfig(**LLAMA, n_kv_heads=8),
    # 4 kv heads: sharded at tp=2, replicated (2 ranks per kv head) at tp=8
    "llama-gqa": ModelConfig(**LLAMA, n_kv_heads=4),
    "llama-mqa": ModelConfig(**LLAMA, n_kv_heads=1),
    # Qwen3's attention: a head dim of 16 (not 64 / 8) and q/k RMSNorm per head
    "llama-qk": ModelConfig(**LLAMA, n_kv_heads=4, d_head=16, qk_norm=True),
}


def make_cfg(tp, impl="gspmd", model=MODEL, sp=False, overlap="none"):
    return Config(model=model, parallel=ParallelConfig(tp=tp, impl=impl, sp=sp, overlap=overlap))


def tokens(cfg, batch=4, seed=1):
    return np.random.default_rng(seed).integers(
        0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1)).astype(np.int32)


def run_model(cfg, with_logits=True):
    """(params on host, logits, loss, grads on host, tokens) from jaxtp at cfg's
    tp (one jit). with_logits=False: None for them, one forward less to compile."""
    mesh = make_mesh(1, cfg.parallel.tp, impl=cfg.parallel.impl)
    graphdef, params, _ = initial_params(cfg, mesh)
    toks = tokens(cfg)

    def loss_and_logits(p, t):
        return loss_fn(graphdef, p, t), nnx.merge(graphdef, p)(t[:, :-1]) if with_logits else None

    with jax.set_mesh(mesh):
        (loss, logits), grads = jax.jit(jax.value_and_grad(loss_and_logits, has_aux=True))(
            params, toks)
    logits = np.asarray(logits) if with_logits else None
    return host_params(params), logits, float(loss), host_params(grads), toks


_REFERENCES = {}


def reference(variant):
    """The single-device reference on tp=1 parameters (computed once per variant)."""
    if variant not in _REFERENCES:
        cfg = make_cfg(1, model=VARIANTS[variant])
        params, _, _, _, toks = run_model(cfg)
        logits = jax.jit(forward, static_argnums=2)(params, toks[:, :-1], cfg.model)
        loss, grads = jax.jit(jax.value_and_grad(ref_loss), static_argnums=2)(
            params, toks, cfg.model)
        _REFERENCES[variant] = (params, np.asarray(logits), float(loss),
                                jax.tree.map(np.asarray, grads))
    return _REFERENCES[variant]


def assert_trees_close(got, want):
    paths = jax.tree_util.tree_flatten_with_path(want)[0]
    got_leaves = jax.tree.leaves(got)
    assert len(paths) == len(got_leaves)
    for (path, w), g in zip(paths, got_leaves):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa"])
def test_init_is_the_same_in_every_layout(variant):
    """Threefry is partitionable: `init_params` draws the same values, bit for
    bit, as one device at every tp (the kv heads sharded at tp=2, replicated
    at 8), split over dp by FSDP, and on a mesh of Explicit axes (drawn on its
    Auto twin: typed on Explicit axes a third of the normal draws came out up
    to 3 ulp off); shard_map's parameters are gspmd's; stacked on a layer
    axis (scanned, and over pp's stages) the blocks hold the list's values.
    So the other tests take them from one init (tests/cached.py)."""
    model = VARIANTS[variant]
    want = initial_values(make_cfg(1, model=model))
    scanned = dataclasses.replace(model, scan_layers=True)
    for m, par in ((model, ParallelConfig(tp=2)), (model, ParallelConfig(tp=8)),
                   (model, ParallelConfig(tp=8, impl="explicit")),
                   (model, ParallelConfig(dp=2, tp=4, fsdp=True)),
                   (scanned, ParallelConfig(tp=4)), (model, ParallelConfig(pp=2, tp=4))):
        layout = Layout.of(Config(model=m, parallel=par))
        got = host_params(init_params(Config(model=m, parallel=par), layout.mesh())[1])
        if Schedule.of(Config(model=m, parallel=par), layout).stacked:
            got = unstack_layers(got)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for path, w in jax.tree_util.tree_flatten_with_path(want)[0]:
            g = functools.reduce(lambda d, k: d[k.key], path, got)
            np.testing.assert_array_equal(g, w, err_msg=f"{m.scan_layers} {par} "
                                                        f"{jax.tree_util.keystr(path)}")


test_init_is_the_same_in_every_layout.fast_cases = set()


# GPT-2 and GQA (kv heads sharded at tp 2, replicated at 8) at tp 1, 2 and 8;
# MHA (kv sharded), MQA (one kv head, replicated) and Qwen3's attention (d_head 16,
# q/k norms; 4 kv heads, replicated) at tp 8
CASES = [(v, tp) for v in ("gpt2", "llama-gqa") for tp in (1, 2, 8)] + \
    [(v, 8) for v in ("llama-mha", "llama-mqa", "llama-qk")]


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
@pytest.mark.parametrize("variant, tp", CASES)
def test_matches_single_device_reference(variant, tp, impl):
    _, ref_logits, ref_l, ref_grads = reference(variant)
    params, logits, loss, grads, _ = run_model(make_cfg(tp, impl, model=VARIANTS[variant]))
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(loss, ref_l, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, ref_grads)


test_matches_single_device_reference.fast_cases = {'llama-gqa-8-shard_map', 'gpt2-8-gspmd'}


@pytest.mark.slow  # fast tier: the budget's explicit cases
@pytest.mark.parametrize("variant, tp", [("gpt2", 1)] + [
    (v, tp) for v in ("gpt2", "llama-gqa") for tp in (2, 8)] + [("llama-mqa", 8), ("llama-qk", 8)])
def test_explicit_matches_single_device_reference(variant, tp):
    """impl explicit, on a mesh of Explicit axes (of size 1 too): the same
    parameters, logits, loss and gradients as one device, the kv heads sharded
    (GQA at tp 2), replicated and picked per rank (GQA at tp 8, MQA)."""
    _, ref_logits, ref_l, ref_grads = reference(variant)
    params, logits, loss, grads, _ = run_model(make_cfg(tp, "explicit",
                                                        model=VARIANTS[variant]))
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(loss, ref_l, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, ref_grads)




@pytest.mark.parametrize("impl", ["gspmd", "shard_map", "explicit"])
@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa", "llama-qk"])
def test_sequence_parallel_matches_single_device_reference(variant, tp, impl):
    """Sequence parallelism changes where activations live, not what is
    computed: loss and every gradient, norm weights included, as on one device
    (GQA's kv heads sharded at tp=2, replicated at 8; SP at tp=4 with dp=2:
    tests/train/test_scale.py)."""
    _, _, ref_l, ref_grads = reference(variant)
    _, _, loss, grads, _ = run_model(make_cfg(tp, impl, model=VARIANTS[variant], sp=True),
                                     with_logits=False)
    np.testing.assert_allclose(loss, ref_l, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, ref_grads)


test_sequence_parallel_matches_single_device_reference.fast_cases = {'llama-gqa-8-gspmd'}


@pytest.mark.slow
@pytest.mark.parametrize("variant, tp, scan, remat, impl, chunk", [
    ("gpt2", 8, False, "none", "shard_map", 0), ("gpt2", 4, False, "dots", "shard_map", 0),
    ("llama-gqa", 2, False, "none", "shard_map", 0), ("llama-gqa", 8, True, "full", "shard_map", 0),
    ("gpt2", 8, False, "none", "bidi", 0), ("gpt2", 4, False, "dots", "bidi", 0),
    ("llama-gqa", 2, False, "none", "bidi", 0),
    ("gpt2", 8, False, "none", "gspmd", 0), ("llama-gqa", 2, False, "dots", "gspmd", 32),
    ("llama-gqa", 8, False, "full", "explicit", 0), ("gpt2", 4, True, "minimal", "explicit", 0)])
def test_collective_matmul_matches_single_device_reference(variant, tp, scan, remat, impl, chunk):
    """SP's overlap: loss and every gradient as on one device. shard_map:
    each entry and exit as a ppermute ring ("bidi": each step's halves sent
    both ways, collective_matmul_bidi). gspmd and explicit: each entry's
    matmul fed x split along T and rematerialised, each exit named split
    along T, the LM head's entry too (or, with loss chunks, gathered first),
    in the form XLA's windowed einsum decomposes. With the kv heads sharded
    (GQA at tp 2) and replicated (tp 8), with remat (the entry's ring, or
    gather, run again in the backward pass). A scanned stack (initialised per
    layer slice, so other values than the reference's) against the same
    stack with overlap=none."""
    model = dataclasses.replace(VARIANTS[variant], scan_layers=scan, remat=remat,
                                loss_chunk=chunk)
    bidi = impl == "bidi"
    impl = "shard_map" if bidi else impl
    cfg = lambda overlap: make_cfg(tp, impl, model=model, sp=True, overlap=overlap)
    _, _, loss, grads, _ = run_model(
        cfg("collective_matmul_bidi" if bidi else "collective_matmul"), with_logits=False)
    if scan:
        _, _, ref_l, ref_grads, _ = run_model(cfg("none"), with_logits=False)
    else:
        _, _, ref_l, ref_grads = reference(variant)
    np.testing.assert_allclose(loss, ref_l, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, ref_grads)


# fast tier: the rings' units (tests/parallel/test_overlap.py) and budget


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_untied_head_no_bias_dropout_keys(impl):
    """Untied head and bias-free layers match the reference; dropout is seeded."""
    model = ModelConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, d_ff=64,
                        seq_len=8, tie_embeddings=False, use_bias=False, dropout=0.5)
    params, logits, _, _, toks = run_model(make_cfg(4, impl, model=model))
    assert "lm_head" in params and "bias" not in params["blocks"][0]["mlp"]["up"]
    np.testing.assert_allclose(logits, forward(params, toks[:, :-1], model),
                               rtol=RTOL, atol=ATOL)
    mesh = make_mesh(1, 4)
    graphdef, p, _ = initial_params(make_cfg(4, impl, model=model), mesh)
    with jax.set_mesh(mesh):
        f = jax.jit(lambda p, t, k: nnx.merge(graphdef, p)(t, dropout_key=k))
        a, b, c = (f(p, toks[:, :-1], jax.random.key(s)) for s in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)  # a different key drops different units
    assert not np.allclose(a, logits)




def test_sequence_longer_than_model_is_rejected():
    mesh = make_mesh(1, 1)
    graphdef, params, _ = init_params(make_cfg(1), mesh)
    with pytest.raises(ValueError, match="exceeds model.seq_len=16"):
        nnx.merge(graphdef, params)(jnp.zeros((1, 17), jnp.int32))


def _dropped(cfg, toks):
    """The logits with dropout under key 7."""
    mesh = make_mesh(1, cfg.parallel.tp, impl=cfg.parallel.impl)
    graphdef, params, _ = initial_params(cfg, mesh)
    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(
            t, dropout_key=jax.random.key(7)))(params, toks))


DROPOUT = dataclasses.replace(MODEL, dropout=0.3)
_one_device_dropped = functools.cache(lambda: _dropped(make_cfg(1, model=DROPOUT),
                                                       tokens(make_cfg(1))[:, :-1]))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gspmd", "shard_map", "explicit"])
def test_dropout_masks_do_not_depend_on_tp(impl):
    """Dropout acts on the replicated residual stream with a partitionable
    threefry key, so tp=8 drops exactly the units tp=1 drops (one device's
    logits, computed once, against each impl's)."""
    got = _dropped(make_cfg(8, impl, model=DROPOUT), tokens(make_cfg(1))[:, :-1])
    np.testing.assert_allclose(got, _one_device_dropped(), rtol=RTOL, atol=ATOL)




# --- attention kernels and the chunked loss inside the whole model -----------
BLOCKWISE = dataclasses.replace(VARIANTS["llama-gqa"], attention="blockwise",
                                attention_block=6)  # T=16: 3 blocks, the last padded


@pytest.mark.parametrize("tp, sp, impl", [
    (2, True, "gspmd"), (8, True, "shard_map"), (8, False, "explicit")])
def test_blockwise_attention_in_the_model_matches_the_reference(tp, sp, impl):
    """Heads split over tp (kv sharded at tp=2, replicated at tp=8), with and
    without SP: the logits, the loss and every gradient as on one device."""
    _, ref_logits, ref_l, ref_grads = reference("llama-gqa")
    params, logits, loss, grads, _ = run_model(make_cfg(tp, impl, model=BLOCKWISE, sp=sp))
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(loss, ref_l, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, ref_grads)


test_blockwise_attention_in_the_model_matches_the_reference.fast_cases = set()  # test_blockwise


@pytest.mark.parametrize("tp, impl", [(1, "gspmd"), (8, "gspmd"), (8, "shard_map"),
                                      (8, "explicit")])
def test_chunked_loss_matches_the_reference(tp, impl):
    """loss_chunk=24 tokens of 4 rows: chunks of 6 positions, T=16 padded to 18
    (24 does not divide the 64 tokens): the same loss and every gradient."""
    model = dataclasses.replace(VARIANTS["gpt2"], loss_chunk=24)
    _, _, ref_l, ref_grads = reference("gpt2")
    _, _, loss, grads, _ = run_model(make_cfg(tp, impl, model=model), with_logits=False)
    np.testing.assert_allclose(loss, ref_l, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, ref_grads)


test_chunked_loss_matches_the_reference.fast_cases = {'8-shard_map'}
