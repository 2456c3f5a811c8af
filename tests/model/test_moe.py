"""The MoE routing and block (jaxtp.model.moe) against references written
here token by token: softmax, top-k, renormalised weights, a capacity queue
in router order, each kept assignment through its expert's MLP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtp.model import moe
from moe_reference import choose, queue, scores

G, T, D, E, K, F = 2, 8, 8, 4, 2, 16
RNG = np.random.default_rng(0)
X = RNG.normal(size=(G, T, D)).astype(np.float32)
W_ROUTER = RNG.normal(size=(D, E)).astype(np.float32)
W_UP = (RNG.normal(size=(E, D, F)) / np.sqrt(D)).astype(np.float32)
W_DOWN = (RNG.normal(size=(E, F, D)) / np.sqrt(F)).astype(np.float32)


def experts(w_up, w_down):
    return lambda x_EGCD: jnp.einsum("EGCF,EFD->EGCD", jax.nn.gelu(
        jnp.einsum("EGCD,EDF->EGCF", x_EGCD, w_up), approximate=False), w_down)


SOFTMAX = moe.Routing(K)


def reference(x, w_router, w_up, w_down, routing, C, act="gelu"):
    """Each token through its kept experts, one at a time; the routing
    decisions from `queue` (piecewise constant), the weights differentiable;
    GELU exact ("gelu"), its tanh form ("tanh", the model's), or SwiGLU
    ("swiglu": up [E, D, 2, F], gate then up)."""
    decided = queue(np.asarray(jax.lax.stop_gradient(x) @ jax.lax.stop_gradient(w_router)),
                    routing, C)
    rows = []
    for g in range(x.shape[0]):
        ex, _, kept = decided[g]
        probs = scores(x[g] @ w_router, routing, jnp)
        for t in range(x.shape[1]):
            sel = probs[t, ex[t]]
            w = (sel / sel.sum() if routing.norm_topk else sel) * routing.scale
            y = jnp.zeros(x.shape[-1])
            for j in range(routing.k):
                if kept[t, j]:
                    e = ex[t, j]
                    if act == "swiglu":
                        u = x[g, t] @ w_up[e][:, 0]
                        h = u / (1 + jnp.exp(-u)) * (x[g, t] @ w_up[e][:, 1])
                    else:
                        h = jax.nn.gelu(x[g, t] @ w_up[e], approximate=act == "tanh")
                    y = y + w[j] * (h @ w_down[e])
            rows.append(y)
    return jnp.stack(rows).reshape(x.shape)


def run(x, w_router, w_up, w_down, routing=SOFTMAX, factor=0.0):
    return moe.moe(x, x @ w_router, experts(w_up, w_down), routing=routing, factor=factor,
                   monitor=True)


ROUTINGS = {"dropless": (SOFTMAX, 0.0), "cf1": (SOFTMAX, 1.0), "cf0.5": (SOFTMAX, 0.5),
            "unnormalised": (moe.Routing(K, norm_topk=False), 0.0),
            "drop-probs-cf0.5": (moe.Routing(K, drop="probs"), 0.5),
            "sigmoid-scaled": (moe.Routing(K, score="sigmoid", scale=2.5), 0.0),
            "sigmoid-groups-cf0.5": (moe.Routing(K, score="sigmoid", groups=2,
                                                 group_top_k=1), 0.5)}


@pytest.mark.parametrize("case", ROUTINGS)
def test_moe_equals_the_per_token_reference_in_value_and_every_gradient(case):
    routing, factor = ROUTINGS[case]
    C = moe.capacity(T, K, E, factor)
    args = tuple(map(jnp.asarray, (X, W_ROUTER, W_UP, W_DOWN)))
    y, _ = run(*args, routing=routing, factor=factor)
    np.testing.assert_allclose(y, reference(*args, routing, C), rtol=1e-5, atol=1e-6)
    ct = jnp.asarray(RNG.normal(size=y.shape).astype(np.float32))
    got = jax.grad(lambda *a: jnp.sum(run(*a, routing=routing, factor=factor)[0] * ct),
                   argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(lambda *a: jnp.sum(reference(*a, routing, C) * ct), argnums=(0, 1, 2, 3))(*args)
    for g, w, name in zip(got, want, ("x", "router", "up", "down")):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)


test_moe_equals_the_per_token_reference_in_value_and_every_gradient.fast_cases = {
    "cf0.5", "sigmoid-groups-cf0.5"}


@pytest.mark.parametrize("routing", [moe.Routing(4, score="sigmoid", groups=4, group_top_k=2),
                                     moe.Routing(3, groups=8, group_top_k=3, norm_topk=False),
                                     moe.Routing(2, score="sigmoid", groups=2, group_top_k=1,
                                                 scale=2.5)], ids=["ds3", "softmax", "halves"])
def test_group_limited_routing_picks_a_tokens_experts_from_its_best_groups(routing):
    """16 experts, each token's k from its best groups as DeepSeek-V3 scores
    them (the sum of a group's best k // group_top_k), against `choose` token
    by token; and a bias moves the choice, not the weights (its Eq. 16)."""
    E16 = 16
    logits = RNG.normal(size=(3, 32, E16)).astype(np.float32)
    w, ex, aff = moe.route(jnp.asarray(logits), routing)
    s = scores(logits, routing)
    for (g, t), row in np.ndenumerate(s[..., 0]):
        want_e, want_w = choose(s[g, t], routing)
        np.testing.assert_array_equal(ex[g, t], want_e)
        np.testing.assert_allclose(w[g, t], want_w, rtol=1e-6)
    per_group = np.asarray(ex) // (E16 // routing.groups)
    assert max(len(set(r)) for r in per_group.reshape(-1, routing.k)) <= routing.group_top_k
    np.testing.assert_allclose(aff, s / s.sum(-1, keepdims=True), rtol=1e-6)
    # a bias of -1 on every expert but one: chosen by every token where its group may be
    bias = jnp.full((E16,), -1.0).at[5].set(0.0)
    w_b, ex_b, _ = moe.route(jnp.asarray(logits), routing, bias)
    assert (np.asarray(ex_b) == 5).any(-1).mean() > 0.5
    picked = np.take_along_axis(s, np.asarray(ex_b), -1)
    want = picked / picked.sum(-1, keepdims=True) if routing.norm_topk else picked
    np.testing.assert_allclose(w_b, want * routing.scale, rtol=1e-6)


def test_the_dropped_assignments_are_exactly_those_past_capacity():
    """cf 0.5: C = 2 slots per expert for 8 tokens x 2 choices over 4
    experts; the kept mask is the queue's, and some are dropped."""
    C = moe.capacity(T, K, E, 0.5)
    assert C == 2
    logits = X @ W_ROUTER
    _, experts_GTk, _ = moe.route(jnp.asarray(logits), SOFTMAX)
    d, kept = moe.dispatch(experts_GTk, E, C)
    want = np.stack([q[2] for q in queue(logits, SOFTMAX, C)])
    np.testing.assert_array_equal(np.asarray(kept), want)
    assert 0 < want.sum() < want.size
    # every slot holds at most one token, and an expert's slots fill from 0
    assert np.asarray(d).sum(1).max() == 1
    filled = np.asarray(d).sum(1)  # [G, E, C]
    assert (np.diff(filled, axis=-1) <= 0).all()


def test_dispatch_then_identity_experts_then_combine_is_x_times_the_kept_weights():
    """Megatron-Core's dispatcher check: identity experts return each token
    times the sum of its kept routing weights."""
    for factor in (0.0, 0.5):
        y, _ = moe.moe(jnp.asarray(X), jnp.asarray(X @ W_ROUTER), lambda x: x,
                       routing=SOFTMAX, factor=factor)
        C = moe.capacity(T, K, E, factor)
        kept_w = np.stack([(q[1] * q[2]).sum(-1) for q in queue(X @ W_ROUTER, SOFTMAX, C)])
        np.testing.assert_allclose(y, X * kept_w[..., None], rtol=1e-6, atol=1e-6)


def test_router_losses_by_hand():
    """Balance: E/k * sum_e f_e P_e over the 16 tokens; z: the mean of the
    squared logsumexp; dropped: the share of assignments past capacity."""
    logits = X @ W_ROUTER
    _, stats = run(*map(jnp.asarray, (X, W_ROUTER, W_UP, W_DOWN)), factor=0.5)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    tokens = G * T
    f = np.zeros(E)
    for q in queue(logits, SOFTMAX, T):
        for e in q[0].ravel():
            f[e] += 1 / tokens
    balance = E / K * sum(f[e] * p[..., e].sum() / tokens for e in range(E))
    lse = np.log(np.exp(logits).sum(-1))
    dropped = 1 - np.mean([q[2] for q in queue(logits, SOFTMAX, 2)])
    load = np.zeros(E)
    for q in queue(logits, SOFTMAX, T):
        for e in q[0].ravel():
            load[e] += 1 / (tokens * K)
    np.testing.assert_allclose(stats, [balance, np.mean(lse ** 2), dropped, *load], rtol=1e-5)
    # uniform routing balances exactly: loss 1
    flat = jnp.zeros((1, E, E))
    assert float(moe.balance_loss(jax.nn.softmax(flat), jnp.arange(E)[None, :, None])) == \
        pytest.approx(1.0)


def balance_reference(x, w_router, routing, sequences):
    """The balance loss token by token, sum_e f_e P_e as DeepSeek-V3's Eq.
    17-20 write it: f_e = E/(k*T) x expert e's picks and P_e the mean of its
    affinity (the scores over their sum) over a run of T tokens; over all
    the tokens, or per sequence (`sequences` runs) and then their mean."""
    E = w_router.shape[-1]
    flat = x.reshape(-1, x.shape[-1])
    runs = np.split(np.arange(flat.shape[0]), sequences)
    total = 0.0
    for run_ in runs:
        f, P = np.zeros(E), jnp.zeros(E)
        for t in run_:
            logits = flat[t] @ w_router
            s = scores(np.asarray(jax.lax.stop_gradient(logits)), routing)
            for e in choose(s, routing)[0]:
                f[e] += E / (routing.k * len(run_))
            a = scores(logits, routing, jnp)
            P = P + a / a.sum() / len(run_)
        total = total + jnp.sum(jnp.asarray(f) * P)
    return total / sequences


@pytest.mark.parametrize("routing", [SOFTMAX, moe.Routing(K, score="sigmoid", groups=2,
                                                          group_top_k=1)],
                         ids=["softmax", "sigmoid-groups"])
@pytest.mark.parametrize("parts", [0, 1, 2], ids=["aux", "seq_aux", "seq_aux-2parts"])
def test_the_balance_losses_equal_a_per_token_count_in_value_and_gradient(routing, parts):
    """aux: one run of all G*T tokens; seq_aux: each group a sequence, or
    (2 parts: cp's, SP's) each two groups one: the same loss as aux here,
    G = 2."""
    args = tuple(map(jnp.asarray, (X, W_ROUTER)))

    def got(x, w):
        logits = x @ w
        _, experts_GTk, aff = moe.route(logits, routing)
        return moe.balance_loss(aff, experts_GTk, parts=parts)

    sequences = G // parts if parts else 1
    want = lambda x, w: balance_reference(x, w, routing, sequences)
    np.testing.assert_allclose(got(*args), want(*args), rtol=1e-5)
    for g, w in zip(jax.grad(got, (0, 1))(*args), jax.grad(want, (0, 1))(*args)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    if parts == 2:  # 2 sequences of 2 parts each, part-major as `MoE._groups` lays them
        x4 = RNG.normal(size=(4, T // 2, D)).astype(np.float32)
        logits = jnp.asarray(x4 @ W_ROUTER)
        _, ex, aff = moe.route(logits, routing)
        seq_major = jnp.asarray(x4.reshape(2, 2, T // 2, D).transpose(1, 0, 2, 3)
                                .reshape(2, T, D))  # sequence s = parts (0, s) and (1, s)
        np.testing.assert_allclose(moe.balance_loss(aff, ex, parts=2),
                                   balance_reference(seq_major, W_ROUTER, routing, 2), rtol=1e-5)


def test_global_aux_weighs_p_by_the_shares_of_the_microbatches_so_far():
    """Megatron-Core's global_aux at a step's second microbatch: f is the
    mean of the first's shares (`prior`, summed) and this one's, counted
    token by token here; P this microbatch's. Value and gradient; the
    microbatch's own shares come back for the next."""
    prior = RNG.dirichlet(np.ones(E)).astype(np.float32) * K  # (shares sum to k)

    def got(x, w):
        _, stats = moe.moe(x, x @ w, lambda s: s, routing=SOFTMAX, factor=0.0,
                           balance="global_aux", prior_E=jnp.asarray(prior))
        return stats[0], stats[2:]

    def want(x, w):
        f, P = np.zeros(E), jnp.zeros(E)
        flat, n = x.reshape(G * T, D), G * T
        for t in range(n):
            logits = flat[t] @ w
            for e in choose(scores(np.asarray(jax.lax.stop_gradient(logits)), SOFTMAX),
                            SOFTMAX)[0]:
                f[e] += 1 / n
            P = P + scores(logits, SOFTMAX, jnp) / n
        return E / K * jnp.sum(jnp.asarray((prior + f) / 2) * P), f

    args = tuple(map(jnp.asarray, (X, W_ROUTER)))
    (value, own), (ref, ref_own) = got(*args), want(*args)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    np.testing.assert_allclose(own, ref_own, rtol=1e-6)
    for g, w in zip(jax.grad(lambda *a: got(*a)[0], (0, 1))(*args),
                    jax.grad(lambda *a: want(*a)[0], (0, 1))(*args)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    # (no prior, the first microbatch or M = 1: Switch's aux over this one)
    plain = moe.moe(*args[:1], args[0] @ args[1], lambda s: s, routing=SOFTMAX, factor=0.0,
                    balance="global_aux")[1]
    np.testing.assert_allclose(plain[0], moe.balance_loss(
        moe.route(args[0] @ args[1], SOFTMAX)[2], moe.route(args[0] @ args[1], SOFTMAX)[1]),
        rtol=1e-6)


def test_the_balance_loss_is_one_at_a_random_router_as_transformers_two_at_top_two():
    """transformers' `load_balancing_loss_func` is E * sum_e f_e P_e with f
    per choice (k when balanced; its Mixtral test expects about 2 at top 2
    from a random router): k times this one, which is 1 when balanced."""
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, 1024, 8)).astype(np.float32))
    _, experts_GTk, aff = moe.route(logits, moe.Routing(2))
    loss = float(moe.balance_loss(aff, experts_GTk))
    assert 2 * loss == pytest.approx(2.0, rel=0.05)
    assert 2 * loss > 2.0  # (a random router is not exactly balanced)


def test_capacity():
    assert moe.capacity(8, 2, 4, 0) == 8  # dropless: every token could pick one expert
    assert moe.capacity(8, 2, 4, 1.0) == 4
    assert moe.capacity(8, 2, 4, 1.25) == 5
    assert moe.capacity(8, 2, 4, 100.0) == 8


# ---- the MoE block in the model: every layout computes one device's loss and gradients

import dataclasses  # noqa: E402
import functools  # noqa: E402

from jaxtp.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from jaxtp.config import validate  # noqa: E402
from cached import (as_pipeline_slices, assert_same, loss_and_grads, stacked_grads,  # noqa: E402
                    step_loss_and_grads)
from jaxtp import hlo  # noqa: E402
from jaxtp.analysis.budget import expected_collectives  # noqa: E402
from jaxtp.analysis.rows import check, schedule_of  # noqa: E402
from jaxtp.train.state import abstract_train_state  # noqa: E402
from jaxtp.train.step import compile_train_step  # noqa: E402
from flax import nnx  # noqa: E402
from jaxtp.model.moe import MoE  # noqa: E402
from jaxtp.parallel import Layout  # noqa: E402
from reference import mlp as mlp_reference  # noqa: E402

MOE = ModelConfig(n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16, n_experts=4,
                  moe_top_k=2)
RAGGED = dataclasses.replace(MOE, moe_dispatch="ragged")
MOE_LLAMA = dataclasses.replace(MOE, style="llama", n_kv_heads=2, use_bias=False,
                                tie_embeddings=False, moe_d_ff=32)
TOKENS = np.random.default_rng(1).integers(0, 256, (8, MOE.seq_len + 1)).astype(np.int32)


def moe_cfg(model, dp=1, tp=1, microbatches=1, **kw):
    par = {k: kw.pop(k) for k in ("impl", "sp", "fsdp", "ep", "cp", "pp", "pp_schedule",
                                  "pp_repeats", "overlap") if k in kw}
    return validate(Config(dataclasses.replace(model, **kw),
                           TrainConfig(batch_size=8, microbatches=microbatches),
                           ParallelConfig(dp=dp, tp=tp, **par)))


@functools.cache
def moe_one_device(model, microbatches=1):
    return loss_and_grads(moe_cfg(model, microbatches=microbatches), TOKENS)


@pytest.mark.parametrize("name, model, dp, tp, kw", [pytest.param(*case, id=case[0]) for case in [
    ("gpt2-tp8-gspmd", MOE, 1, 8, {}),
    ("gpt2-dp2xtp4-shard_map", MOE, 2, 4, {"impl": "shard_map"}),
    ("gpt2-dp2xtp4-cf1-fsdp", dataclasses.replace(MOE, capacity_factor=1.0), 2, 4,
     {"fsdp": True}),
    ("llama-dp4xtp2-scan-minimal", MOE_LLAMA, 4, 2, {"scan_layers": True, "remat": "minimal"}),
    ("llama-tp2-shard_map-cf1.25", dataclasses.replace(MOE_LLAMA, capacity_factor=1.25), 1, 2,
     {"impl": "shard_map"}),
    # ep: the experts split over ep, the batch over dp x ep
    ("llama-ep4xtp2-bias", dataclasses.replace(MOE_LLAMA, moe_balance="bias"), 1, 2, {"ep": 4}),
    # explicit: the slots' reshards in the types, the down-projection's sum named
    ("llama-ep4xtp2-explicit-cf1", dataclasses.replace(MOE_LLAMA, capacity_factor=1.0), 1, 2,
     {"ep": 4, "impl": "explicit"}),
    ("gpt2-dp2xep2xtp2-cf1-fsdp", dataclasses.replace(MOE, capacity_factor=1.0), 2, 2,
     {"ep": 2, "fsdp": True}),
    ("gpt2-ep4xtp2-shard_map-scan-seq_aux", dataclasses.replace(MOE, moe_balance="seq_aux"),
     1, 2, {"ep": 4, "impl": "shard_map", "scan_layers": True, "remat": "minimal"}),
    ("llama-ep8-cf1.25", dataclasses.replace(MOE_LLAMA, n_experts=8, capacity_factor=1.25), 1, 1,
     {"ep": 8}),
    # microbatches: the router losses per microbatch, so one device runs the same two;
    # DeepSeek-V3's routing (sigmoid, group-limited, scaled), dropping the least weighted
    ("llama-dp2xep2xtp2-microbatches2-cf1-sigmoid-groups-probs", dataclasses.replace(
        MOE_LLAMA, capacity_factor=1.0, moe_score="sigmoid", moe_groups=2, moe_group_top_k=1,
        moe_route_scale=2.5, moe_drop="probs"), 2, 2, {"ep": 2, "microbatches": 2}),
    ("gpt2-ep4xtp2-microbatches2-shard_map", MOE, 1, 2,
     {"ep": 4, "microbatches": 2, "impl": "shard_map"}),
    # Megatron-Core's global_aux: the shares carried from microbatch to microbatch,
    # in sequential slices and in slices reduced over dp once (over_dp)
    ("llama-dp2xep2xtp2-microbatches2-global_aux", dataclasses.replace(
        MOE_LLAMA, moe_balance="global_aux"), 2, 2, {"ep": 2, "microbatches": 2}),
    ("gpt2-dp4xtp2-microbatches2-global_aux-shard_map-scan", dataclasses.replace(
        MOE, moe_balance="global_aux"), 4, 2,
     {"microbatches": 2, "impl": "shard_map", "scan_layers": True}),
    # a shared expert beside the routed ones (a dense MLP on the tp rule)
    ("gpt2-ep4xtp2-shared", dataclasses.replace(MOE, moe_shared_d_ff=48), 1, 2, {"ep": 4}),
    ("llama-dp2xep2xtp2-shared-gated-shard_map-scan-minimal",
     dataclasses.replace(MOE_LLAMA, moe_shared_d_ff=32, moe_shared_gate=True), 2, 2,
     {"ep": 2, "impl": "shard_map", "scan_layers": True, "remat": "minimal"}),
    # every other layer MoE (model.moe_every 2: layer 0 dense, layer 1 MoE)
    ("llama-ep2xtp2-moe_every2", dataclasses.replace(MOE_LLAMA, moe_every=2), 2, 2, {"ep": 2}),
    ("gpt2-ep4xtp2-moe_every2-shard_map", dataclasses.replace(MOE, moe_every=2), 1, 2,
     {"ep": 4, "impl": "shard_map"}),
    # scanned in groups of a dense and a MoE layer (`jaxtp.model.block.Group`)
    ("llama-ep2xtp2-moe_every2-scan-minimal", dataclasses.replace(MOE_LLAMA, moe_every=2), 2,
     2, {"ep": 2, "scan_layers": True, "remat": "minimal"}),
    # a leading dense layer (model.moe_first_dense), then groups of two dense and a MoE
    ("llama-ep2xtp2-moe_first_dense1-scan", dataclasses.replace(
        MOE_LLAMA, n_layers=4, moe_first_dense=1, moe_every=3), 2, 2,
     {"ep": 2, "scan_layers": True}),
    ("gpt2-ep2xtp2-moe_first_dense1-shard_map", dataclasses.replace(MOE, moe_first_dense=1), 2, 2,
     {"ep": 2, "impl": "shard_map"}),
    # the dropless ragged path (at ep 1: XLA:CPU compiles no ragged all-to-all)
    ("gpt2-tp8-ragged", RAGGED, 1, 8, {}),
    ("llama-dp2xtp4-shard_map-ragged-sigmoid", dataclasses.replace(
        MOE_LLAMA, moe_dispatch="ragged", moe_score="sigmoid", moe_route_scale=2.5), 2, 4,
     {"impl": "shard_map"}),
    ("llama-dp4xtp2-ragged-scan-minimal", dataclasses.replace(MOE_LLAMA, moe_dispatch="ragged"),
     4, 2, {"scan_layers": True, "remat": "minimal"}),
]])
def test_the_moe_model_in_every_layout_equals_one_device(name, model, dp, tp, kw):
    """Loss (cross-entropy plus the router losses) and every gradient at rtol
    1e-5: routing is per sequence, so the groups, and with a capacity the
    drops, are one device's (the dense dispatch's, for the ragged path)."""
    cfg = moe_cfg(model, dp, tp, **kw)
    ref_model = dataclasses.replace(model, scan_layers=False, remat="none", moe_dispatch="dense")
    got = loss_and_grads(cfg, TOKENS)
    want = moe_one_device(ref_model, cfg.train.microbatches)
    if kw.get("scan_layers"):  # a scanned model's gradients come stacked
        want = (want[0], stacked_grads(want[1], cfg.model.layer_group))
    assert_same(got, want)


@pytest.mark.parametrize("name, model, dp, ep, tp, kw", [
    pytest.param(*case, id=case[0]) for case in [
        ("gpt2-ep2xtp4-sp", MOE, 1, 2, 4, {"sp": True}),
        ("llama-dp2xep2xtp2-sp-shard_map", MOE_LLAMA, 2, 2, 2, {"sp": True,
                                                              "impl": "shard_map"}),
        # DeepSeek-V3's sequence-wise loss: each sequence's two parts summed
        ("llama-cp2xep2xtp2-seq_aux", dataclasses.replace(MOE_LLAMA, moe_balance="seq_aux"),
         1, 2, 2, {"cp": 2}),
        ("gpt2-cp2xep4-shard_map-scan-minimal", MOE, 1, 4, 1, {"cp": 2, "impl": "shard_map",
                                                              "scan_layers": True,
                                                              "remat": "minimal"}),
        ("llama-cp2xep2xtp2-sp-shard_map", MOE_LLAMA, 1, 2, 2, {"cp": 2, "sp": True,
                                                               "impl": "shard_map"}),
        # collective matmul in the dense layers (the MoE layers' experts unchanged)
        ("llama-ep2xtp4-sp-overlap-shard_map", MOE_LLAMA, 1, 2, 4,
         {"sp": True, "overlap": "collective_matmul", "impl": "shard_map"}),
        ("gpt2-ep2xtp4-sp-overlap", MOE, 1, 2, 4, {"sp": True, "overlap": "collective_matmul"}),
    ]])
def test_under_sp_and_cp_a_rank_routes_its_part_of_each_sequence(name, model, dp, ep, tp, kw):
    """Dropless, each rank routes s/n of each sequence (n = cp, x tp under
    SP), so one compiled train step: its loss and every gradient are one
    device's (rtol 1e-5: no token's experts depend on its group); its
    collectives are the ledger's, and by hand its slots, and ep's
    all-to-alls, hold the rank's own tokens, B/(dp*ep) groups of s/n, C =
    s/n; under SP the experts gather what arrived over tp and scatter their
    output back (shard_map: a reduce-scatter; GSPMD: an all-reduce of the
    gathered slots), else g and f over tp; under cp the experts' gradients
    are summed over cp (its ranks hold the same experts)."""
    cfg = moe_cfg(model, dp, tp, ep=ep, **kw)
    layout = Layout.of(cfg)
    step = compile_train_step(abstract_train_state(cfg, layout.mesh()), 8, model.seq_len)
    want = moe_one_device(dataclasses.replace(model, capacity_factor=0.0))
    if cfg.model.scan_layers:
        want = (want[0], stacked_grads(want[1]))
    assert_same(step_loss_and_grads(cfg, step, TOKENS), want)
    sizes, colls = layout.sizes, hlo.collectives(step.as_text())
    assert check(colls, expected_collectives(cfg, cfg.parallel.impl, "cpu"), sizes) is None
    sp, cp = cfg.parallel.sequence_parallel, cfg.parallel.cp
    n = cp * (tp if sp else 1)
    slots = model.n_experts * (8 // (dp * ep)) * (model.seq_len // n) * model.d_model
    moe_colls = [c for c in colls if c.scope == "moe"]
    for pass_ in ("forward", "backward"):
        a2a = [c for c in moe_colls if c.kind == "all-to-all" and c.pass_ == pass_]
        assert sum(c.elements * c.count for c in a2a) == 2 * model.n_layers * slots
        assert {c.axes(sizes) for c in a2a} == {("ep",)}
        over_tp = sorted((c.kind, c.elements) for c in moe_colls for _ in range(c.count)
                         if c.pass_ == pass_ and c.axes(sizes) == ("tp",))
        exit_ = ("reduce-scatter", slots) if cfg.parallel.impl == "shard_map" else \
            ("all-reduce", tp * slots)
        want_tp = [("all-gather", tp * slots), exit_] if sp else [("all-reduce", slots)]
        assert over_tp == (sorted(want_tp * model.n_layers) if tp > 1 else [])
    experts = [c for c in colls if c.pass_ == "backward" and "cp" in c.axes(sizes)
               and "ep" not in c.axes(sizes) and c.scope == "moe"]
    assert bool(experts) == (cp > 1)


test_under_sp_and_cp_a_rank_routes_its_part_of_each_sequence.fast_cases = {"gpt2-ep2xtp4-sp"}


@pytest.mark.parametrize("name, model, pp, dp, ep, tp, M, kw", [
    pytest.param(*case, id=case[0]) for case in [
        ("gpt2-pp2xep4-shard_map", MOE, 2, 1, 4, 1, 2, {"impl": "shard_map"}),
        # DeepSeek-V3's balance: the loss-free bias and a small sequence-wise loss
        ("llama-pp2xdp2xep2-minimal-bias+seq_aux", dataclasses.replace(
            MOE_LLAMA, moe_balance="bias+seq_aux"), 2, 2, 2, 1, 2, {"remat": "minimal"}),
        # Qwen2-MoE's gated shared expert in the stages
        ("gpt2-pp2xdp2xep2-shard_map-shared-gated", dataclasses.replace(
            MOE, moe_shared_d_ff=32, moe_shared_gate=True), 2, 2, 2, 1, 2, {"impl": "shard_map"}),
        ("llama-pp2xep2xtp2-sp-shard_map-dropless", MOE_LLAMA, 2, 1, 2, 2, 2,
         {"sp": True, "impl": "shard_map", "capacity_factor": 0.0}),
        # 1F1B: a steady tick a forward and a backward; the statistics in the loss's
        # sum (gpipe, circular and 1f1b at pp 2 x ep 2 x cp 2 x tp 2 under both
        # impls, dropless: tests/sixteen.py); interleaved over groups of a dense and
        # a MoE layer
        ("gpt2-pp2xdp2xep2-1f1b-shard_map", MOE, 2, 2, 2, 1, 2,
         {"pp_schedule": "1f1b", "impl": "shard_map"}),
        ("llama-pp2xep2xtp2-zb-minimal", MOE_LLAMA, 2, 1, 2, 2, 2,
         {"pp_schedule": "zb", "remat": "minimal"}),
        ("llama-pp2xep2xtp2-moe_every2-interleaved",
         dataclasses.replace(MOE_LLAMA, moe_every=2, n_layers=8), 2, 1, 2, 2, 2,
         {"pp_schedule": "interleaved", "pp_repeats": 2}),
        # a leading dense layer (model.moe_first_dense) before the stages, on each
        # stage's own rows, as the embedding; under GPipe and 1F1B
        ("llama-pp2xdp2xep2-moe_first_dense1", dataclasses.replace(
            MOE_LLAMA, n_layers=3, moe_first_dense=1), 2, 2, 2, 1, 2, {}),
        ("gpt2-pp2xep2xtp2-M4-moe_first_dense1-1f1b-sp-shard_map-dropless",
         dataclasses.replace(MOE, n_layers=3, moe_first_dense=1), 2, 1, 2, 2, 4,
         {"pp_schedule": "1f1b", "impl": "shard_map", "sp": True, "capacity_factor": 0.0}),
        ("llama-pp2xep2xtp2-M4-moe_first_dense1", dataclasses.replace(
            MOE_LLAMA, n_layers=3, moe_first_dense=1), 2, 1, 2, 2, 4, {}),
        # a stage of groups of a dense and a MoE layer (model.moe_every 2)
        ("llama-pp2xep2xtp2-moe_every2-circular",
         dataclasses.replace(MOE_LLAMA, moe_every=2, n_layers=8), 2, 1, 2, 2, 2,
         {"pp_schedule": "circular", "pp_repeats": 2}),
    ]])
def test_the_moe_pipeline_equals_one_device_and_holds_its_ledger(name, model, pp, dp, ep, tp,
                                                                 M, kw):
    """One compiled train step, twice read. Its loss and every gradient at
    rtol 1e-5 against one device's M slices holding the pipeline's
    microbatches (the router losses are per microbatch; cf 1 unless
    dropless): the stages' statistics summed over pp, means over dp x ep,
    the bubble ticks' left out. Its collectives by the ledger, and by hand:
    every stage runs its L/(pp*v) layers in each of the v*M + pp - 1 ticks
    (the bubble's too), 2 all-to-alls a layer and tick per pass, each a
    microbatch's slots E * B/(M*dp*ep) * C * D (a microbatch holds every
    stage's rows); the stages' statistics summed over pp once (2 floats).
    1F1B: M + pp - 1 forwards and as many backwards per stage, GPipe's; its
    statistics go into the loss's one sum over pp x dp x ep."""
    kw = {"capacity_factor": 1.0, "scan_layers": True, **kw}  # (a stage is a scanned stack)
    cfg = moe_cfg(model, dp, tp, microbatches=M, pp=pp, ep=ep, **kw)
    layout = Layout.of(cfg)
    step = compile_train_step(abstract_train_state(cfg, layout.mesh()), 8, model.seq_len)
    ref = loss_and_grads(moe_cfg(dataclasses.replace(model, capacity_factor=kw["capacity_factor"]),
                                 microbatches=M), as_pipeline_slices(TOKENS, M, pp, dp, ep))
    assert_same(step_loss_and_grads(cfg, step, TOKENS),
                (ref[0], stacked_grads(ref[1], cfg.model.layer_group)))
    sizes, colls = layout.sizes, hlo.collectives(step.as_text())
    assert check(colls, expected_collectives(cfg, cfg.parallel.impl, "cpu"), sizes) is None
    v, f1b = cfg.parallel.pp_repeats, schedule_of(cfg).runs_head
    ticks = v * M + pp - 1
    n = tp if cfg.parallel.sp else 1  # the parts each sequence is routed in
    C = moe.capacity(model.seq_len // n, model.moe_top_k, model.n_experts, kw["capacity_factor"])
    slots = model.n_experts * (8 // (M * dp * ep)) * C * model.d_model
    for pass_ in ("forward", "backward"):
        a2a = [c for c in colls if c.kind == "all-to-all" and c.pass_ == pass_]
        assert sum(c.elements * c.count for c in a2a) == \
            2 * ticks * cfg.model.n_moe_layers // (pp * v) * slots
    over_pp = [c for c in colls if c.axes(sizes) == ("pp",) and c.kind == "all-reduce"]
    assert [(c.elements, c.count, c.pass_) for c in over_pp] == ([] if f1b else
                                                                 [(2, 1, "forward")])


test_the_moe_pipeline_equals_one_device_and_holds_its_ledger.fast_cases = {
    "gpt2-pp2xep4-shard_map"}


@pytest.mark.parametrize("over, fix", [
    ({"moe_top_k": 5}, "between 1 and model.n_experts=4"),
    ({"moe_d_ff": 60, "tp": 8}, "model.moe_d_ff"),
    ({"impl": "explicit", "moe_dispatch": "ragged"}, "not built for --impl explicit with "
     "model.moe_dispatch='ragged'"),
    ({"impl": "explicit", "cp": 2, "capacity_factor": 0.0}, "not built for --impl explicit "
     "with --cp 2"),
    ({"sp": True, "tp": 2, "capacity_factor": 1.0}, "--sp splits each sequence, .* set "
     "model.capacity_factor=0"),
    ({"cp": 2, "capacity_factor": 1.25}, "--cp 2 splits each sequence"),
    ({"cp": 2, "moe_dispatch": "ragged"}, "not built for model.moe_dispatch='ragged' with --cp"),
    ({"pp": 2, "microbatches": 2, "sp": True, "tp": 2, "capacity_factor": 0.0},
     "--sp in a pipeline under --impl gspmd .* use --impl shard_map"),
    ({"capacity_factor": -1.0}, "must be finite and >= 0 \\(0: dropless\\)"),
    ({"moe_dispatch": "ragged", "capacity_factor": 1.0}, "is dropless"),
    ({"moe_dispatch": "sparse"}, "choose one of \\('dense', 'ragged'\\)"),
    ({"ep": 3}, "valid --ep: \\[1, 2, 4\\]"),
    ({"ep": 2, "n_experts": 0}, "model.n_experts=0 has none"),
    ({"moe_every": 3}, "model.moe_every=3 must be between 1 .* and model.n_layers=2"),
    ({"moe_every": 2, "n_layers": 3, "scan_layers": True},
     "a scanned stack repeats groups of model.moe_every=2 layers .* model.scan_layers=false"),
    ({"moe_every": 2, "moe_shared_d_ff": 32}, "not built with model.moe_shared_d_ff"),
    ({"moe_first_dense": 2}, "model.moe_first_dense=2 leaves no MoE layer of model.n_layers=2"),
    ({"moe_first_dense": 1, "n_layers": 4, "pp": 2, "microbatches": 2},
     r"model.n_layers=4 \(3 after model.moe_first_dense=1\) evenly over pp=2"),
    ({"moe_balance": "seq_aux", "pp": 2, "microbatches": 2, "cp": 2, "capacity_factor": 0.0},
     "seq_aux' sums each sequence's parts, .* under --cp: not built yet"),
    ({"moe_shared_gate": True}, "moe_shared_gate gates the shared expert, and "
     "model.moe_shared_d_ff=0 has none"),
    ({"moe_balance": "bias", "moe_bias_rate": 0.0}, "0 never moves it"),
    ({"moe_balance": "bias+seq_aux", "moe_balance_coef": 0.0}, "which is 0: set it"),
    ({"moe_slots": "resend", "sp": True, "tp": 2, "ep": 2, "remat": "minimal",
      "capacity_factor": 0.0}, "moe_slots=resend is not built with --sp"),
    ({"moe_score": "tanh"}, "choose one of \\('softmax', 'sigmoid'\\)"),
    ({"moe_groups": 3}, "model.moe_groups=3 must divide model.n_experts=4 .* \\[1, 2, 4\\]"),
    ({"moe_groups": 2, "moe_group_top_k": 3}, "picks more groups than model.moe_groups=2"),
    ({"moe_groups": 4, "moe_group_top_k": 1}, "moe_top_k=2 experts cannot come from "
     "model.moe_group_top_k=1 groups of 1"),
    ({"moe_groups": 4, "moe_group_top_k": 3, "moe_top_k": 2}, "lower moe_group_top_k"),
    ({"moe_route_scale": 0.0}, "model.moe_route_scale=0.0 must be positive"),
    ({"moe_drop": "probs"}, "model.capacity_factor=0 is dropless"),
    ({"moe_drop": "random", "capacity_factor": 1.0}, "choose one of \\('position', 'probs'\\)"),
])
def test_moe_refusals_name_the_fix(over, fix):
    kw = dict(over)
    tp = kw.pop("tp", 1)
    with pytest.raises(ConfigError, match=fix):
        moe_cfg(MOE if "n_experts" not in kw else dataclasses.replace(MOE, moe_top_k=0), 1,
                tp, **kw)


def test_a_moe_run_says_its_ep_degree_and_experts_as_it_starts():
    """The lines a run starts with name ep and the experts (before, an ep4 x
    tp2 run printed `mesh dp=1 x tp=2`); a dense run prints no experts line."""
    import types

    from jaxtp.config import apply_overrides, load_config
    from jaxtp.train.start import describe

    data = types.SimpleNamespace(train=range(1000), val=range(100))
    cfg = apply_overrides(load_config("moe-tiny"), ["parallel.ep=4", "parallel.tp=2"])
    lines = describe(cfg, 1, data)
    assert "mesh dp=1 x ep=4 x tp=2, impl=gspmd" in lines[0]
    assert lines[2] == ("experts: 8 per MoE layer (top-2, d_ff 96), capacity factor 1.25, "
                        "2 per ep rank")
    dropless = apply_overrides(cfg, ["model.capacity_factor=0", "parallel.ep=1",
                                     "model.moe_shared_d_ff=64"])
    assert describe(dropless, 1, data)[2].endswith("dropless, 8 per ep rank, a shared expert "
                                                   "of d_ff 64")
    assert len(describe(load_config("tiny"), 1, data)) == 2


@pytest.mark.slow
def test_a_moe_run_logs_its_router_statistics(tmp_path):
    """moe-tiny (2 layers, 8 x 32 tokens) for 2 steps: the evaluation row
    carries the router losses (summed over the layers), the dropped share
    and each expert's share of the assignments (summing to 1)."""
    import json

    import train

    assert train.main(["--config", "moe-tiny", "--dp", "4", "--tp", "2", "--steps", "2",
                       "train.eval_every=2", "train.eval_batches=1", "train.warmup_steps=1",
                       "model.n_layers=2", "model.seq_len=32", "train.batch_size=8",
                       "--out", str(tmp_path)]) == 0
    row = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
           if '"eval_loss"' in line][-1]
    assert row["moe_balance"] > 0 and row["moe_z"] > 0
    assert 0 <= row["moe_dropped"] < 1
    assert len(row["moe_load"]) == 8 and sum(row["moe_load"]) == pytest.approx(1, abs=1e-4)


test_the_moe_model_in_every_layout_equals_one_device.fast_cases = {"llama-ep4xtp2-bias"}


@pytest.mark.parametrize("style, gated", [("gpt2", False), ("llama", False), ("llama", True)],
                         ids=["gpt2", "llama", "llama-gated"])
def test_the_shared_expert_adds_a_dense_mlp_every_token_takes(style, gated):
    """A layer with a shared expert (model.moe_shared_d_ff) is the routed
    experts' per-token reference plus the reference dense MLP on the shared
    weights, GELU with biases or SwiGLU without; gated (Qwen2-MoE's), that
    MLP's output times sigmoid(x . w_gate) per token."""
    cfg = dataclasses.replace(MOE if style == "gpt2" else MOE_LLAMA, moe_shared_d_ff=24,
                              moe_shared_gate=gated)
    layout = Layout.make()
    with jax.set_mesh(layout.mesh()):
        layer = MoE(cfg, layout, rngs=nnx.Rngs(3))
        x = jnp.asarray(RNG.normal(size=(2, cfg.seq_len, cfg.d_model)).astype(np.float32))
        y, _ = layer(x)
    w = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(layer)))
    shared = mlp_reference(w["shared"], x, cfg)
    if gated:
        shared = shared / (1 + np.exp(-np.asarray(x) @ w["shared_gate"]))
    routed = reference(x, w["router"], w["experts"]["up"], w["experts"]["down"],
                       moe.Routing.of(cfg), cfg.seq_len,
                       act="tanh" if style == "gpt2" else "swiglu")
    np.testing.assert_allclose(y, routed + shared, rtol=1e-5, atol=1e-6)
    assert np.abs(shared).max() > 0.1 * np.abs(routed).max()  # (it matters)


@pytest.fixture
def float64_run():
    """train.main under --float64 turns on jax_enable_x64 for the process:
    turned off again after the test, so the worker's later tests run fp32."""
    yield
    jax.config.update("jax_enable_x64", False)


def _losses(out):
    import json

    return np.array([json.loads(line)["loss"] for line in
                     (out / "metrics.jsonl").read_text().splitlines()])


@pytest.mark.slow
@pytest.mark.parametrize("impl, factor", [("gspmd", "1.25")])  # (dropless under four
# axes against one device: tests/sixteen.py)
def test_in_float64_ep_logs_the_losses_of_dp(impl, factor, tmp_path, float64_run):
    """--float64, the verification mode: moe-tiny (2 layers, 8 x 64 tokens
    here) at ep4 x tp2 and at dp4 x tp2 log the same losses to float64's
    rounding (< 1e-12 relative; 4.9e-15 measured over 40 steps of the full
    preset, docs/scale.md), and the losses are float64's (none an fp32
    value). In fp32 the two differ from the first steps (8.6e-8, an ulp, at
    step 2 here, under the suite's XLA flags and the default: their expert
    gradients are summed in another order) and part once a top-k choice flips."""
    import train

    runs = {}
    for axis in ("--ep", "--dp"):
        out = tmp_path / axis[2:]
        assert train.main(["--config", "moe-tiny", axis, "4", "--tp", "2", "--float64",
                           "--impl", impl, "--steps", "6", "train.log_every=1",
                           "train.eval_every=100", "train.eval_batches=1", "model.n_layers=2",
                           "model.seq_len=64", "train.batch_size=8",
                           f"model.capacity_factor={factor}", "--out", str(out)]) == 0
        runs[axis] = _losses(out)
        assert json_dtype(out) == "float64"
    assert len(runs["--ep"]) == 6
    assert all(np.float32(x) != x for x in runs["--ep"])
    np.testing.assert_allclose(runs["--ep"], runs["--dp"], rtol=1e-12, atol=0)
    assert not np.array_equal(runs["--ep"][:1], runs["--ep"][-1:])  # it trained


def json_dtype(out):
    import json

    return json.loads((out / "run.json").read_text())["model"]["dtype"]
