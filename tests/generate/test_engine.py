"""Generation: the KV-cache path against a full forward without a cache, the
sampler against its distribution, tp invariance, and the cache's bytes."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

import reference
from jaxtp.config import Config, ModelConfig, ParallelConfig, TrainConfig, validate
from jaxtp.generate import Generator, Sampling, cache_bytes_per_device
from jaxtp.model.transformer import unstack_layers
from jaxtp.parallel import make_mesh
from cached import OPTIMISED, initial_params

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]  # three lengths in one batch
NEW = 8
# (style, n_kv_heads): MHA, GQA with K < tp at tp=8 (and K = tp at 2), MQA;
# Qwen3's attention: GQA with a head dim of 16 (not D/N = 8) and q/k norms
MODELS = {"gpt2": ("gpt2", 0), "llama-gqa": ("llama", 2), "llama-mqa": ("llama", 1),
          "qwen3-attn": ("llama", 2)}
EXTRA = {"qwen3-attn": dict(d_head=16, qk_norm=True)}


def config(name: str, tp: int, impl: str = "gspmd", scan: bool = False, dp: int = 1,
           vocab: int = 256) -> Config:
    style, K = MODELS[name]
    # init_std 0.3: peaked logits, so no greedy choice is a near tie that the
    # cache's other summation order could flip
    m = ModelConfig(style=style, n_layers=2, d_model=64, n_heads=8, n_kv_heads=K, d_ff=128,
                    seq_len=32, init_std=0.3, attention="xla", scan_layers=scan,
                    use_bias=style == "gpt2", tie_embeddings=style == "gpt2", vocab_size=vocab,
                    **EXTRA.get(name, {}))
    return validate(Config(m, TrainConfig(batch_size=4), ParallelConfig(dp=dp, tp=tp,
                                                                        impl=impl)))


def generator(cfg: Config, sampling: Sampling = Sampling()):
    mesh = make_mesh(cfg.parallel.dp, cfg.parallel.tp)
    graphdef, params, _ = initial_params(cfg, mesh)  # the same values at every tp
    return Generator(nnx.merge(graphdef, params), mesh, sampling), params


@functools.cache
def reference_greedy(name: str, scan: bool = False) -> list[list[int]]:
    """Arg-max of the plain single-device forward over the growing sequence,
    no cache: the whole prefix is recomputed for every token. (Zero-padded to
    seq_len, one compile: the forward is causal, so the logits at the last
    real position do not see the padding.)"""
    cfg = config(name, 1, scan=scan)
    _, params = generator(cfg)
    p = reference.host_params(params)
    p = unstack_layers(p) if scan else p
    forward = jax.jit(lambda p, t: reference.forward(p, t, cfg.model)[0])
    out = []
    for prompt in PROMPTS:
        seq = list(prompt)
        for _ in range(NEW):
            padded = np.zeros((1, cfg.model.seq_len), np.int32)
            padded[0, :len(seq)] = seq
            seq.append(int(np.asarray(forward(p, padded))[len(seq) - 1].argmax()))
        out.append(seq[len(prompt):])
    return out


# every model at tp=8 under both impls, and GQA (and Qwen3's) also at tp 2 (K = tp: kv
# sharded; at 8 replicated), each against one device's forward; the cache at
# tp=1 for every model
GREEDY = [(name, 1, "gspmd") for name in MODELS] + [
    (name, tp, impl) for name in MODELS for tp in (2, 8) for impl in ("gspmd", "shard_map")
    if tp == 8 or name in ("llama-gqa", "qwen3-attn")]


@pytest.mark.parametrize("name, tp, impl", GREEDY)
def test_greedy_with_the_cache_equals_the_full_forward(name, tp, impl):
    gen, _ = generator(config(name, tp, impl))
    assert gen.generate(PROMPTS, NEW) == reference_greedy(name)


test_greedy_with_the_cache_equals_the_full_forward.fast_cases = {"llama-gqa-8-shard_map",
                                                                  "qwen3-attn-2-gspmd"}


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_scanned_layers_generate_the_same(impl):
    gen, _ = generator(config("llama-gqa", 8, impl, scan=True))
    assert gen.generate(PROMPTS, NEW) == reference_greedy("llama-gqa", scan=True)


# the filters one at a time: test_the_sampler_draws_from_the_filtered_softmax
SAMPLINGS = {"temperature": Sampling(0.9), "top-k-p": Sampling(0.7, top_k=20, top_p=0.9)}


@pytest.mark.parametrize("how", list(SAMPLINGS))
def test_seeded_sampling_is_the_same_at_tp1_and_tp8(how):
    s = SAMPLINGS[how]
    tp1 = generator(config("llama-gqa", 1), s)[0]
    one = tp1.generate(PROMPTS, NEW, seed=3)
    for impl in ("gspmd", "shard_map"):
        assert generator(config("llama-gqa", 8, impl), s)[0].generate(PROMPTS, NEW, seed=3) == one
    assert tp1.generate(PROMPTS, NEW, seed=4) != one  # the seed matters


test_seeded_sampling_is_the_same_at_tp1_and_tp8.fast_cases = set()


@pytest.mark.slow
def test_top_p_over_a_large_vocabulary_is_the_same_at_tp1_and_tp8():
    """4096 ids: tp=8 gathers 8 x 256 candidates, tp=1 has 256; the best 256
    of them are the same set, so the tokens are too."""
    s, prompts = Sampling(1.0, top_p=0.9), [[5, 17, 3], [9]]
    one = generator(config("llama-gqa", 1, vocab=4096), s)[0].generate(prompts, NEW, seed=1)
    for impl in ("gspmd", "shard_map"):
        eight = generator(config("llama-gqa", 8, impl, vocab=4096), s)[0]
        assert eight.generate(prompts, NEW, seed=1) == one


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_every_row_has_its_own_noise_at_dp2(impl):
    """Four identical prompts at dp=2 x tp=4 sample what one device samples:
    a dp rank's rows are numbered globally, not from 0 on each rank."""
    s, prompts = Sampling(1.5), [[5, 17, 3]] * 4
    one = generator(config("llama-gqa", 1), s)[0].generate(prompts, NEW, seed=2)
    assert len({tuple(r) for r in one}) == 4  # the rows differ
    assert generator(config("llama-gqa", 4, impl, dp=2), s)[0].generate(
        prompts, NEW, seed=2) == one


KEYS = jax.random.split(jax.random.PRNGKey(0), 4000)


def _draws(head, x_BD, sampling: Sampling, keys) -> np.ndarray:
    """Tokens sampled for the same hidden state under each key: [keys, B]."""
    def draw(key):
        return head.next_token(x_BD, key, temperature=sampling.temperature,
                               top_k=sampling.top_k, top_p=sampling.top_p)
    return np.asarray(jax.jit(jax.vmap(draw)).lower(keys).compile(OPTIMISED)(keys))


@pytest.mark.slow  # 3 x 4000 x 8 draws; the fast tier keeps the seeded tp1 = tp8 check
def test_the_sampler_draws_from_the_filtered_softmax():
    """Empirical frequencies of 4000 x 8 draws (GSPMD, tp=8) against
    softmax(logits / T) restricted to the top-k / top-p set, computed here
    from the full logits; shard_map draws the same tokens for the same keys."""
    cfg = config("gpt2", 8)
    gen, params = generator(cfg)
    model = nnx.merge(gen.graphdef, params)
    manual, _ = generator(config("gpt2", 8, "shard_map"))
    manual_model = nnx.merge(manual.graphdef, params)
    x_BD = jax.random.normal(jax.random.PRNGKey(1), (8, 64)) * 2
    table = reference.host_params(params)["wte"]["embedding"][:256]
    logits = np.asarray(x_BD) @ table.T
    for s in (Sampling(1.3), Sampling(1.0, top_k=4), Sampling(0.8, top_p=0.7)):
        with jax.set_mesh(gen.mesh):
            toks = _draws(model.head, x_BD, s, KEYS)
            assert np.array_equal(_draws(manual_model.head, x_BD, s, KEYS[:200]), toks[:200])
        z = logits / s.temperature
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        order = np.argsort(-p, -1)
        rank = np.argsort(order, -1)
        keep = np.ones_like(p, bool)
        if s.top_k:
            keep &= rank < s.top_k
        if s.top_p < 1:
            sorted_p = np.take_along_axis(p, order, -1)
            before = np.cumsum(sorted_p, -1) - sorted_p
            keep &= np.take_along_axis(before < s.top_p, rank, -1)
        want = np.where(keep, p, 0)
        want /= want.sum(-1, keepdims=True)
        for b in range(8):
            got = np.bincount(toks[:, b], minlength=256) / len(toks)
            assert got[~keep[b]].sum() == 0, (s, b)  # nothing outside the set
            # 4000 draws: a frequency's standard error is at most 0.008
            np.testing.assert_allclose(got, want[b], atol=0.035, err_msg=str(s))



@pytest.mark.parametrize("name, tp", [("gpt2", 8), ("llama-gqa", 8), ("llama-gqa", 2),
                                      ("llama-mqa", 4)])
def test_the_cache_holds_the_formulas_bytes_per_device(name, tp):
    cfg = config(name, tp)
    gen, _ = generator(cfg)
    with jax.set_mesh(gen.mesh):
        k, v = gen.empty_cache(4, 24)
    per_device = sum(s.data.nbytes for a in (k, v) for s in a.addressable_shards) / tp
    m = cfg.model
    K, H = m.kv_heads, m.head_dim
    # 2 * L * B * T_max * K * H * bytes / tp, K/tp rounded up to 1 when K < tp
    want = 2 * m.n_layers * 4 * 24 * max(K / tp, 1) * H * 4
    assert per_device == want == cache_bytes_per_device(cfg, 4, 24)


@pytest.mark.slow
def test_past_seq_len_the_context_slides():
    gen, _ = generator(config("llama-gqa", 2))
    short = gen.generate(PROMPTS, 20)  # the longest row ends at position 25 < 32
    long = gen.generate(PROMPTS, 40)  # slides at 32, keeping the last 16 tokens
    assert [len(r) for r in long] == [40] * 3
    assert [r[:20] for r in long] == short


def test_bad_requests_are_refused():
    gen, _ = generator(config("gpt2", 2))
    with pytest.raises(ValueError, match="longer than model.seq_len=32"):
        gen.generate([[1] * 33], 5)
    with pytest.raises(ValueError, match="at least one token"):
        gen.generate([[1], []], 5)
    with pytest.raises(ValueError, match="top_p=0"):
        Sampling(1.0, top_p=0)
    with pytest.raises(ValueError, match="without sequence parallelism"):
        cfg = config("gpt2", 2)
        cfg = Config(cfg.model, cfg.train, ParallelConfig(tp=2, sp=True))
        generator(cfg)


def test_eos_stops_a_row_and_the_rest_go_on():
    gen, _ = generator(config("gpt2", 2))
    free = gen.generate(PROMPTS, NEW)
    eos = free[1][2]  # row 1 stops by its third token
    out = gen.generate(PROMPTS, NEW, eos=eos)
    assert len(out[1]) <= 3 and max(map(len, out)) > 3
    for got, row in zip(out, free):  # each row up to its own first eos, if any
        assert got == (row[:row.index(eos) + 1] if eos in row else row)


@pytest.mark.parametrize("lead, every", [(0, 2), (1, 3)], ids=["groups", "lead-and-groups"])
def test_a_scanned_stack_of_groups_generates_as_its_list_of_layers(lead, every):
    """model.moe_every 2 scanned: each loop trip a Group of a dense and a MoE
    layer (`jaxtp.model.block.Group`), its KV caches [L/2, 2, ...] per
    trip (with model.moe_first_dense 1, a dense layer first, unstacked, then a
    group of three); the same values (a stack starts from the plain model's)
    generate the same tokens as the list of layers, at tp 2."""
    def moe(scan: bool) -> Config:
        cfg = config("llama-gqa", 2, scan=scan)
        return validate(dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, n_layers=4, n_experts=4, moe_top_k=2, moe_d_ff=32, moe_every=every,
            moe_first_dense=lead)))

    listed, scanned = (generator(moe(scan))[0] for scan in (False, True))
    assert listed.generate(PROMPTS, NEW) == scanned.generate(PROMPTS, NEW)
