"""The train step: tp=8 follows tp=1 step for step under both implementations,
and learns on the built-in corpus. (Its collectives: tests/analysis/test_budget.py.)"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtp.config import Config, ModelConfig, ParallelConfig, TrainConfig
from jaxtp.parallel import make_mesh
from jaxtp.train.state import init_train_state
from cached import initial_values
from jaxtp.train.step import loss_fn, make_train_step, step_controls
from jaxtp.train.loop import train
from jaxtp.train.options import RunOptions

MODEL = ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=8, d_ff=64, seq_len=16)
TRAIN = TrainConfig(steps=10, batch_size=8, lr=1e-2, warmup_steps=2)


def run_steps(cfg, n):
    mesh = make_mesh(cfg.parallel.dp, cfg.parallel.tp)
    state = init_train_state(cfg, mesh, initial_values(cfg))
    step = make_train_step(state, use_dropout=cfg.model.dropout > 0)
    rng = np.random.default_rng(0)
    params, opt_state, metrics = state.params, state.opt_state, None
    with jax.set_mesh(mesh):
        for i in range(n):
            toks = rng.integers(0, MODEL.vocab_size, (8, MODEL.seq_len + 1)).astype(np.int32)
            params, opt_state, metrics = step(params, opt_state, toks, jax.random.key(i),
                                              step_controls())
    return jax.tree.map(np.asarray, jax.device_get(params)), metrics


def _is_key_bias(path):
    keys = [getattr(k, "key", None) for k in path]
    return "kv" in keys and "bias" in keys  # [2, K, H]: k bias, v bias


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_ten_adamw_steps_tp8_match_tp1(impl):
    """Parameters after 10 AdamW steps agree to relative norm 1e-5, per
    tensor and over all parameters together.

    The key bias b_k is left out: its exact gradient is zero (q.(k + b_k)
    shifts every logit of a query row by the same q.b_k, and softmax is
    shift-invariant), so what autodiff returns is round-off, which Adam turns
    into lr-sized steps of arbitrary sign at *any* tp. It cannot change the
    model's outputs; the next test checks that its gradient is round-off.
    """
    cfg = Config(MODEL, TRAIN, ParallelConfig(tp=1))
    ref, _ = run_steps(cfg, 10)
    got, metrics = run_steps(Config(MODEL, TRAIN, ParallelConfig(tp=8, impl=impl)), 10)
    assert np.isfinite(float(metrics["loss"]))
    init, _ = run_steps(cfg, 0)
    flat = jax.tree_util.tree_flatten_with_path(ref)[0]
    diff2 = norm2 = 0.0
    for (path, r), g, i in zip(flat, jax.tree.leaves(got), jax.tree.leaves(init)):
        if _is_key_bias(path):
            r, g, i = r[1], g[1], i[1]  # the v bias
        assert not np.array_equal(r, i), path  # the parameters did move
        diff2 += float(np.sum((g - r) ** 2))
        norm2 += float(np.sum(r ** 2))
        assert np.linalg.norm(g - r) <= 1e-5 * np.linalg.norm(r), path
    assert diff2 ** 0.5 <= 1e-5 * norm2 ** 0.5, (diff2 / norm2) ** 0.5




@pytest.mark.slow
def test_key_bias_gradient_is_round_off():
    mesh = make_mesh(1, 1)
    cfg = Config(MODEL, TRAIN)
    state = init_train_state(cfg, mesh, initial_values(cfg))
    toks = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
    grads = jax.jit(jax.grad(lambda p: loss_fn(state.graphdef, p, toks)))(state.params)
    for path, g in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0]:
        if _is_key_bias(path):
            g = np.asarray(g)
            assert np.abs(g[0]).max() < 1e-6 * np.abs(g[1]).max()
            assert np.abs(g[1]).max() > 1e-4


@pytest.mark.slow
def test_short_run_on_builtin_corpus_learns(tmp_path):
    model = ModelConfig(n_layers=2, d_model=64, n_heads=8, d_ff=256, seq_len=64)
    cfg = Config(model, TrainConfig(steps=40, batch_size=16, lr=6e-3, warmup_steps=5,
                                    log_every=10, eval_every=20, eval_batches=2),
                 ParallelConfig(tp=4))
    summary = train(cfg, tmp_path, RunOptions(log=lambda s: None))
    # byte-level loss starts at ln(256) = 5.55; 40 steps on Python source
    # reach well under 3.5 (5.42 -> eval 2.91 measured)
    assert summary["first_loss"] > 5.0
    assert summary["final_eval_loss"] < summary["first_loss"] - 2.0
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 10, 20, 30, 40]
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec"} <= set(rows[0])
    assert "eval_loss" in rows[2] and "eval_loss" not in rows[1]
    assert (tmp_path / "config.json").is_file()


@pytest.mark.slow
def test_loop_step_keeps_the_host_bookkeeping_on_device():
    """make_loop_step against the same bookkeeping done on the host: the dropout
    key of step n is fold_in(seed key, n); a NaN step is skipped, leaves the
    parameters, the Adam count and so the lr alone; the row totals restart
    after every logged row; the spike guard uses the mean of the applied
    losses; max_skipped_steps in a row set stop_at, after which nothing
    changes."""
    from jaxtp.train.loopstep import LoopState, is_row_step, make_loop_step
    from jaxtp.train.optim import lr_schedule

    t = TrainConfig(steps=12, batch_size=8, lr=1e-2, warmup_steps=2, log_every=3,
                    eval_every=100, max_skipped_steps=2, spike_factor=50.0)
    cfg = Config(ModelConfig(**{**MODEL.__dict__, "dropout": 0.1}), t, ParallelConfig(tp=2))
    mesh = make_mesh(1, 2)
    # Both programs compile with XLA's default CPU fusion emitters, as a
    # user's run does. Under the suite's faster legacy emitters (conftest)
    # XLA fuses the shared step differently inside the two programs, which
    # moves every parameter by round-off (~1e-9) from step 2 on.
    emitters = {"xla_cpu_use_fusion_emitters": True}
    state = dataclasses.replace(init_train_state(cfg, mesh, initial_values(cfg)),
                                compiler_options=emitters)
    core = make_train_step(state, use_dropout=True)
    step = make_loop_step(state, cfg, inject_nan_at={4, 9, 10})
    loop = LoopState.start(t.seed, mesh)
    params, opt = state.params, state.opt_state
    ref = init_train_state(cfg, mesh, initial_values(cfg))  # each step donates its own
    ref_p, ref_o = ref.params, ref.opt_state
    rng = np.random.default_rng(0)
    schedule = lr_schedule(t)
    applied, row_loss, row_n, row_skip, in_a_row, stop_at, losses = 0, 0.0, 0, 0, 0, 0, []
    with jax.set_mesh(mesh):
        for n in range(1, 13):
            toks = rng.integers(0, MODEL.vocab_size, (8, MODEL.seq_len + 1)).astype(np.int32)
            params, opt, loop, m = step(params, opt, loop, toks)
            # the host's version of the same step
            limit = (50.0 * float(np.mean(losses[-20:])) if len(losses) >= 5 else np.inf)
            limit = -np.inf if stop_at else limit
            scale = np.nan if n in (4, 9, 10) else 1.0
            ref_p, ref_o, rm = core(ref_p, ref_o, toks, jax.random.fold_in(jax.random.key(0), n),
                                    step_controls(limit, scale))
            if is_row_step(n - 1, t):
                row_loss, row_n, row_skip = 0.0, 0, 0
            if rm["skipped"]:
                row_skip += 0 if stop_at else 1
                in_a_row += 0 if stop_at else 1
                if in_a_row >= 2 and not stop_at:
                    stop_at = n
            else:
                applied, in_a_row = applied + 1, 0
                row_loss, row_n = row_loss + float(rm["loss"]), row_n + 1
                losses.append(float(rm["loss"]))
            got = loop.to_json()
            assert got["step"] == n and got["applied"] == applied and got["stop_at"] == stop_at
            assert (got["row_applied"], got["row_skipped"], got["in_a_row"]) == (
                row_n, row_skip, in_a_row), n
            np.testing.assert_allclose(got["row_loss"], row_loss, rtol=1e-6)
            lr_count = applied - (not rm["skipped"])  # optax's count before this step
            np.testing.assert_allclose(float(m["lr"]), float(schedule(lr_count)), rtol=1e-6)
            assert bool(m["skipped"]) == bool(rm["skipped"])
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_p)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # 9 and 10 in a row stop the run; steps 11 and 12 ran as no-ops
    assert stop_at == 10 and got["skip_step"] == 10 and got["applied"] == 7


def test_a_float64_run_schedules_its_lr_in_float64():
    """--float64's schedule: optax's warmup is float32 whatever its inputs,
    so the float64 schedule is its own; it must be optax's function (to
    float32's rounding: its warmup subtracts nearly equal numbers) at every
    step, warmup, peak, decay and floor, in float64 (step 1 of a 30-step
    warmup to 3e-3 is 1e-4 to float64's rounding, ~1e-6 off in optax's)."""
    from jaxtp.train.optim import lr_schedule

    t = TrainConfig(lr=3e-3, warmup_steps=30, steps=40, min_lr_ratio=0.1)
    with jax.enable_x64(True):
        f64 = lr_schedule(t, np.float64)
        got = np.array([f64(np.int32(n)) for n in range(45)])
        assert f64(np.int32(1)).dtype == np.float64
    f32 = lr_schedule(t)
    want = np.array([f32(np.int32(n)) for n in range(45)], np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    assert got[1] == pytest.approx(1e-4, rel=1e-15) and abs(want[1] / 1e-4 - 1) > 1e-7
    assert got[30] == 3e-3 and got[40:] == pytest.approx(3e-4, rel=1e-15)


def test_the_check_replays_on_one_device_whatever_the_axes():
    """`--check` replays a run with every mesh axis at degree 1 (ep's was
    once left as the run's: a replay on one device laid out for ep 2)."""
    from jaxtp.parallel import Layout
    from jaxtp.parallel.layout import AXES
    from jaxtp.train.step import one_device
    cfg = Config(ModelConfig(n_experts=4, moe_top_k=2), TrainConfig(batch_size=16),
                 ParallelConfig(**{a: 2 for a in AXES}, impl="shard_map"))
    one = one_device(cfg, stacked=True)
    assert Layout.of(one).devices == 1 and one.parallel.impl == "gspmd"
    assert one.model.scan_layers and one.model == dataclasses.replace(cfg.model, scan_layers=True)


@pytest.mark.slow
def test_the_check_of_an_ep_run_matches_one_device(tmp_path):
    """`--check --ep 2` (no test ran it): after an AdamW step the
    replay's parameters are the ep run's to fp32 round-off."""
    import train as cli
    out = tmp_path / "run"
    assert cli.main(["--config", "moe-tiny", "--ep", "2", "--tp", "2", "--steps", "1", "--check",
                 "--out", str(out), "train.eval_batches=1", "train.warmup_steps=0"]) == 0
    check = json.loads((out / "run.json").read_text())["check"]
    assert check["after_step"] == 1 and check["loss_diff"] < 1e-5
    assert check["param_update_rel_error"] < 1e-3
