"""Balance you can steer and see. The auxiliary-loss-free balance
(`model.moe_balance=bias`, DeepSeek-V3 Sec. 2.1.2): each MoE layer's bias
moves by its formula from each step's expert counts, the same at every
layout, and resumes bit for bit. The expert load per MoE layer in the
metrics, against a count done here."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtp.config import (Config, ModelConfig, ParallelConfig, TrainConfig, apply_overrides,
                          load_config, validate)
from jaxtp.parallel import Layout, batch_sharding
from jaxtp.train.loop import train
from jaxtp.train.options import RunOptions
from jaxtp.train.state import init_train_state
from jaxtp.train.step import make_router_stats, make_train_step, step_controls

# one MoE layer (layer 1 of 2), so the monitored loads are that layer's
MOE = ModelConfig(n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16, n_experts=8,
                  moe_top_k=2, moe_every=2, moe_balance="bias", moe_bias_rate=0.01)
TOKENS = np.random.default_rng(1).integers(0, 256, (8, MOE.seq_len + 1)).astype(np.int32)
RATE, STEPS = MOE.moe_bias_rate, 3


def biases(params) -> np.ndarray:
    (bias,) = [np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(params)
               if "router_bias" in jax.tree_util.keystr(path)]
    return bias


@functools.cache
def trained(dp: int, ep: int, tp: int, microbatches: int = 1, model: ModelConfig = MOE):
    """(the bias before each step and after the last, each step's counts of
    assignments per expert on the whole batch, counted from the loads the
    router statistics report at that step's parameters)."""
    cfg = validate(Config(model, TrainConfig(batch_size=8, microbatches=microbatches, lr=1e-2,
                                             warmup_steps=1),
                          ParallelConfig(dp=dp, ep=ep, tp=tp)))
    state = init_train_state(cfg, Layout.of(cfg).mesh())
    step, stats = make_train_step(state, False), make_router_stats(state)
    tokens = jax.device_put(TOKENS, batch_sharding(state.mesh))
    params, opt, seen, counts = state.params, state.opt_state, [], []
    assignments = TOKENS.shape[0] * model.seq_len * model.moe_top_k
    for _ in range(STEPS):
        seen.append(biases(params))
        # (the one MoE layer's row: balance, z, dropped, then the loads)
        load = np.asarray(stats(params, tokens))[0, 3:]
        counts.append(np.rint(load * assignments))
        params, opt, metrics = step(params, opt, tokens, jax.random.key(0), step_controls())
        assert not bool(metrics["skipped"])
    return seen + [biases(params)], counts


def test_each_step_moves_the_bias_by_the_sign_of_its_load_against_the_mean():
    """b += rate * (u - mean(u)), u = sign(mean load - load): DeepSeek-V3's
    step, re-centred as torchtitan's, from the step's counts on the batch."""
    seen, counts = trained(1, 1, 1)
    centred = False
    for t in range(STEPS):
        c = counts[t]
        assert c.sum() == TOKENS.shape[0] * MOE.seq_len * MOE.moe_top_k
        u = np.sign(c.mean() - c)
        np.testing.assert_allclose(seen[t + 1], seen[t] + RATE * (u - u.mean()), atol=1e-8)
        centred |= u.mean() != 0
    assert centred and np.abs(seen[-1]).max() > 0  # (it moved, and the centring did too)


@pytest.mark.parametrize("dp, ep, tp, microbatches", [(1, 2, 2, 1), (1, 4, 2, 1), (2, 2, 2, 2)],
                         ids=["ep2xtp2", "ep4xtp2", "dp2xep2xtp2-microbatches2"])
def test_the_bias_is_the_same_at_every_ep_and_dp(dp, ep, tp, microbatches):
    """Each step's counts are summed over the microbatches and every rank
    that holds tokens (the bias's gradient): one device's biases, bit for bit."""
    got, want = trained(dp, ep, tp, microbatches)[0], trained(1, 1, 1)[0]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_a_run_with_the_bias_resumes_bit_for_bit(tmp_path):
    """The bias is a parameter the optimizer moves: saved with the others, a
    run stopped at step 2 and resumed logs the losses of the run that never
    stopped, and ends with its biases."""
    from procs import final_params, logged  # noqa: PLC0415

    cfg = apply_overrides(load_config("moe-tiny"), [
        "model.n_layers=2", "model.seq_len=32", "model.moe_balance=bias+seq_aux",
        "model.moe_balance_coef=0.0001", "train.steps=4", "train.eval_every=2",
        "parallel.ep=2", "parallel.tp=2"])
    quiet = lambda _: None
    straight, out = tmp_path / "straight", tmp_path / "resumed"
    train(cfg, straight, RunOptions(log=quiet))
    train(cfg, out, RunOptions(log=quiet, until=2))
    train(cfg, out, RunOptions(log=quiet, resume=True))
    assert logged(out) == logged(straight)
    want, got = final_params(straight, 4, cfg), final_params(out, 4, cfg)
    bias = [k for k in want if "router_bias" in k]
    assert bias and np.abs(want[bias[0]]).max() > 0
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# ---- expert load you can see: per MoE layer, against a count done here

LOADS = ModelConfig(style="llama", n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64,
                    seq_len=16, use_bias=False, tie_embeddings=False, n_experts=8,
                    moe_top_k=2, moe_d_ff=32, moe_every=2, capacity_factor=0.5)


def counted_loads(model, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(each MoE layer's share of assignments per expert [L, E], its dropped
    share [L]) by running the list model eagerly with each MoE layer's input
    recorded, then routing every token by hand (`moe_reference.queue`: the
    top k, a capacity queue of first choices before second ones)."""
    from jaxtp.model.moe import MoE, Routing
    from jaxtp.sizes import capacity
    from moe_reference import queue

    seen, call = [], MoE.__call__

    def record(self, x):
        seen.append((np.asarray(x), np.asarray(self.router[...])))
        return call(self, x)

    MoE.__call__ = record
    try:
        model.hidden(tokens)
    finally:
        MoE.__call__ = call
    k, E = LOADS.moe_top_k, LOADS.n_experts
    C = capacity(LOADS.seq_len, k, E, LOADS.capacity_factor)
    loads, dropped = [], []
    for x, w in seen:  # (one routing group per sequence)
        groups = queue(x.astype(np.float64) @ w, Routing(k), C)
        counts = np.bincount(np.concatenate([ex.ravel() for ex, _, _ in groups]), minlength=E)
        loads.append(counts / counts.sum())
        dropped.append(1 - np.mean([kept for _, _, kept in groups]))
    return np.array(loads), np.array(dropped)


@pytest.mark.parametrize("layers, kw", [
    (4, {}), (4, {"scan_layers": True}),
    # a pipeline's stack in one loop, circular's rows put back in model order
    (8, {"pp": 2, "pp_schedule": "circular", "pp_repeats": 2, "microbatches": 2,
         "scan_layers": True}),
    (5, {"pp": 2, "pp_schedule": "1f1b", "microbatches": 2, "impl": "shard_map",
         "moe_first_dense": 1, "scan_layers": True})],
    ids=["list", "scan", "pp2-circular", "pp2-1f1b-shard_map-first_dense"])
def test_the_per_layer_loads_equal_a_count_done_here(layers, kw):
    """The monitored statistics per MoE layer (a shift register through the
    stack, so the scanned groups' rows come in layer order) against the
    count above; the row's violation, dead experts and dropped share from
    them by the formulas."""
    from jaxtp.model.build import build_model
    from jaxtp.train.evaluation import load_rows
    from jaxtp.train.state import abstract_train_state
    from cached import initial_params  # noqa: PLC0415

    kw = {"n_layers": layers, **kw}
    par = {k: kw.pop(k) for k in ("pp", "pp_schedule", "pp_repeats", "impl") if k in kw}
    M = kw.pop("microbatches", 1)
    model = dataclasses.replace(LOADS, **kw)
    cfg = validate(Config(model, TrainConfig(batch_size=8, microbatches=M),
                          ParallelConfig(ep=2, tp=2, **par)))
    plain = validate(Config(dataclasses.replace(model, scan_layers=False),
                            TrainConfig(batch_size=8), ParallelConfig()))
    layout = Layout.of(cfg)
    _, params, _ = initial_params(cfg, layout.mesh())
    state = abstract_train_state(cfg, layout.mesh())
    stats = make_router_stats(dataclasses.replace(state, params=params))
    with jax.set_mesh(state.mesh):  # (as the training loop calls it)
        got = np.asarray(stats(params, jax.device_put(TOKENS, batch_sharding(state.mesh))))
    assert got.shape == (cfg.model.n_moe_layers, 3 + LOADS.n_experts)
    with jax.set_mesh(Layout.of(plain).mesh()):
        model = build_model(plain, Layout.of(plain), plain.train.seed, jax.devices()[0])
        want_load, want_dropped = counted_loads(model, TOKENS[:, :-1])
    np.testing.assert_allclose(got[:, 3:], want_load, atol=1e-6)
    np.testing.assert_allclose(got[:, 2], want_dropped, atol=1e-6)
    row = load_rows(got[:, 3:], got[:, 2])
    mean = want_load.mean(1)
    np.testing.assert_allclose(row["moe_layer_violation"],
                               (want_load.max(1) - mean) / mean, atol=1e-5)
    assert row["moe_layer_dead"] == [int((r == 0).sum()) for r in want_load]
    assert row["moe_max_violation"] == max(row["moe_layer_violation"]) > 0
    assert 0 < min(row["moe_layer_dropped"])


test_the_per_layer_loads_equal_a_count_done_here.fast_cases = {"list", "scan"}


@pytest.mark.slow
def test_global_aux_carries_each_microbatchs_shares_to_the_next():
    """At M = 2 the step's loss and gradients are the mean of two direct
    calls, the second given the first's shares per MoE layer (the one
    device's; every dp x ep split gives its: tests/model/test_moe.py); at
    M = 1 it is aux; at M = 2 it is not aux's."""
    from cached import initial_params, loss_and_grads  # noqa: PLC0415
    from jaxtp.train.step import loss_fn

    model = dataclasses.replace(LOADS, moe_balance="global_aux", moe_balance_coef=1.0)
    cfg = lambda m, M: validate(Config(m, TrainConfig(batch_size=8, microbatches=M),
                                       ParallelConfig()))
    got = loss_and_grads(cfg(model, 2), TOKENS)
    graphdef, params, _ = initial_params(cfg(model, 2), Layout.of(cfg(model, 2)).mesh())
    shares = jax.numpy.zeros((model.n_moe_layers, model.n_experts))

    def direct(p):
        total, s = 0.0, shares
        for m in range(2):  # (slice m: rows m, 2 + m, ...: `Schedule`'s)
            loss, own = loss_fn(graphdef, p, TOKENS[m::2], shares=s)
            total, s = total + loss / 2, s + own
        return total

    loss, grads = jax.value_and_grad(direct)(params)
    assert got[0] == pytest.approx(float(loss), rel=1e-6)
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0]}
    for path, g in got[1].items():
        np.testing.assert_allclose(g, flat[path], rtol=1e-5, atol=1e-7)
    aux = dataclasses.replace(model, moe_balance="aux")
    assert loss_and_grads(cfg(model, 1), TOKENS)[0] == loss_and_grads(cfg(aux, 1), TOKENS)[0]
    assert abs(loss_and_grads(cfg(aux, 2), TOKENS)[0] - got[0]) > 1e-4
