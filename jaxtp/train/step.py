"""The jitted train and eval steps.

The model is split once (`nnx.split`) into a static graphdef and a pytree of
parameters; the steps are pure functions of that pytree, jitted with explicit
in/out shardings read from each parameter's PartitionSpec, and the train step
donates the parameter and optimizer buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ..config import Config
from ..parallel import (Layout, Schedule, batch_shape, batch_sharding, inputs_targets,
                        make_mesh)
from ..model import reorder_layers
from ..parallel.layout import AXES
from .optim import clip_by_global_norm, is_bias
from .state import TrainState, abstract_train_state, init_train_state


def loss_fn(graphdef, params, tokens_BT1, dropout_key=None, forward_only: bool = False,
            shares=None):
    """Next-token cross-entropy of tokens [B, T+1] (under cp, a placed
    [B, 2, T]: `jaxtp.parallel.batch_shape`); `forward_only`: no gradient
    will be taken (evaluation); `shares`: a MoE's running shares
    ("global_aux": `Transformer.loss`)."""
    model = nnx.merge(graphdef, params)
    return model.loss(*inputs_targets(tokens_BT1), dropout_key=dropout_key,
                      forward_only=forward_only, shares=shares)


def cross_entropy_of(model, tokens_BT1):
    """Mean next-token loss of a merged model on tokens [B, T+1] (jitted)."""
    graphdef, params = nnx.split(model)
    return jax.jit(lambda p, t: loss_fn(graphdef, p, t, forward_only=True))(params, tokens_BT1)


def grads_of(graphdef, params, tokens_BT1, key, schedule: Schedule = Schedule()):
    """(mean loss, gradients) of a batch [B, T+1] as `schedule` consumes it
    (`jaxtp.parallel.Schedule`: whole, in sequential slices, or in slices
    reduced over dp once per step): the same result as one batch."""
    # ("global_aux" over slices: each slice's shares come back beside its loss)
    value_and_grad = jax.value_and_grad(
        lambda p, t, k, s: loss_fn(graphdef, p, t, k, shares=s), has_aux=True) \
        if schedule.shares else jax.value_and_grad(lambda p, t, k: loss_fn(graphdef, p, t, k))
    return schedule.loss_and_grads(value_and_grad, params, nnx.get_partition_spec(params),
                                   tokens_BT1, key)


def step_fn(state: TrainState, use_dropout: bool) -> Callable:
    graphdef, tx, clip, schedule = state.graphdef, state.tx, state.grad_clip, state.schedule
    specs = jax.tree.map(lambda s: s.spec, state.param_shardings)
    biased = any(is_bias(path)  # (a MoE's loss-free balance biases)
                 for path, _ in jax.tree_util.tree_leaves_with_path(specs))

    def step(params, opt_state, tokens_BT1, key, controls):
        max_loss, grad_scale = controls[0], controls[1]
        loss, grads = grads_of(graphdef, params, tokens_BT1, key if use_dropout else None,
                               schedule)
        grads = jax.tree.map(lambda g: (g * grad_scale).astype(g.dtype), grads)
        grads, grad_norm = clip_by_global_norm(grads, clip, specs, biased)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (loss <= max_loss)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        return (keep(new_params, params), keep(new_opt_state, opt_state),
                {"loss": loss, "grad_norm": grad_norm, "skipped": ~ok})

    return step


def make_train_step(state: TrainState, use_dropout: bool) -> Callable:
    """jitted (params, opt_state, tokens, key, controls) -> (params, opt_state, metrics).

    `controls` = f32[2] (see `step_controls`): [max_loss, grad_scale]. The
    update is applied only if the loss and the gradient norm are finite and
    the loss is at most max_loss (the spike guard; inf turns it off);
    otherwise parameters and optimizer state come back unchanged and
    metrics["skipped"] is true. grad_scale multiplies the gradients (1.0; NaN
    injects a non-finite gradient, to drill the skip path). The training loop
    runs this inside `make_loop_step`.
    """
    replicated = NamedSharding(state.mesh, P())
    return jax.jit(
        step_fn(state, use_dropout),
        in_shardings=(state.param_shardings, state.opt_shardings,
                      batch_sharding(state.mesh), replicated, replicated),
        out_shardings=(state.param_shardings, state.opt_shardings, replicated),
        donate_argnums=(0, 1), compiler_options=state.compiler_options,
    )


def step_controls(max_loss: float = float("inf"), grad_scale: float = 1.0) -> np.ndarray:
    """The `controls` argument of a train step: no spike guard, gradients as they are."""
    return np.array([max_loss, grad_scale], np.float32)


def make_eval_step(state: TrainState) -> Callable:
    graphdef = state.graphdef
    return jax.jit(lambda params, tokens: loss_fn(graphdef, params, tokens, forward_only=True),
                   in_shardings=(state.param_shardings, batch_sharding(state.mesh)),
                   compiler_options=state.compiler_options)


def make_router_stats(state: TrainState) -> Callable:
    """jitted (params, tokens) -> a MoE model's router statistics on a batch,
    forward only, per MoE layer [L_moe, n] (`Transformer.hidden_and_stats`;
    under a pipeline the stack in one loop); call it under the mesh."""
    graphdef = state.graphdef

    def stats(params, tokens_BT1):
        model = nnx.merge(graphdef, params)
        model.set_attributes(monitor=True)
        return model.hidden_and_stats(inputs_targets(tokens_BT1)[0])[1]

    return jax.jit(stats, in_shardings=(state.param_shardings, batch_sharding(state.mesh)),
                   compiler_options=state.compiler_options)


def compile_train_step(state: TrainState, batch_size: int, seq_len: int,
                       use_dropout: bool = False, compiler_options: dict | None = None):
    """Ahead-of-time compiled train step for [batch, seq+1] tokens.

    Callable like the jitted step; `.as_text()` is the post-partitioning HLO
    whose collectives `jaxtp.hlo` reads. Works on an abstract state too.
    """
    step = make_train_step(state, use_dropout)
    tokens = jax.ShapeDtypeStruct(batch_shape(batch_size, seq_len, state.mesh), jnp.int32,
                                  sharding=batch_sharding(state.mesh))
    # every argument abstract, so a mesh of compile-only devices works too
    # (jaxtp.analysis.plan and ahead-of-time compiles for another platform)
    replicated = NamedSharding(state.mesh, P())
    key = jax.eval_shape(jax.random.key, 0)
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
    controls = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=replicated)
    options = {**(state.compiler_options or {}), **(compiler_options or {})} or None
    with jax.set_mesh(state.mesh):
        return step.lower(state.params, state.opt_state, tokens, key, controls).compile(options)


def compiled_step(cfg: Config, mesh, compiler_options: dict | None = None):
    """(the abstract TrainState of `cfg` on `mesh`, its train step compiled
    for [batch, seq+1] tokens): the program `jaxtp.analysis` reads, handed to
    it as `compile_step` (analysis imports nothing of `jaxtp.train`)."""
    state = abstract_train_state(cfg, mesh)
    return state, compile_train_step(state, cfg.train.batch_size, cfg.model.seq_len,
                                     compiler_options=compiler_options)


def one_device(cfg: Config, stacked: bool) -> Config:
    """`cfg` on one device: every mesh axis's degree 1 (`AXES`: a new axis
    is reset with the others), impl gspmd, the blocks stacked or not."""
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, scan_layers=stacked),
        parallel=dataclasses.replace(cfg.parallel, impl="gspmd", **{a: 1 for a in AXES}))


def single_device_check(cfg: Config, params0, batches, keys, loss: float, grad_norm: float,
                        params_n) -> dict:
    """Replay the first steps on a single device (tp=1, dp=1) and compare.

    `params0`/`params_n`: the parallel run's parameters before step 1 and
    after step n = len(batches) (host copies); `loss`, `grad_norm`: its step-n
    metrics. Parameter error: ||p_n - ref_n|| / ||ref_n||; update error:
    ||p_n - ref_n|| / ||ref_n - p0||, far more sensitive, as Adam's first
    updates are nearly lr * sign(g) and magnify round-off in small gradients.
    """
    # one device, its blocks stacked as the run's are (a pipeline's, scanned),
    # in model order (a circular pipeline's stack is interleaved)
    layout = Layout.of(cfg)
    schedule = Schedule.of(cfg, layout)
    stacked = schedule.stacked
    back = np.argsort(schedule.layer_order())
    params0, params_n = (reorder_layers(nnx.to_pure_dict(p), back) for p in (params0, params_n))
    one = one_device(cfg, stacked)
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    state = init_train_state(one, mesh, params=params0)
    step = make_train_step(state, use_dropout=cfg.model.dropout > 0)
    params, opt_state = state.params, state.opt_state
    # the run's keys live on its mesh (typed with it under impl explicit)
    keys = [jax.device_put(k, NamedSharding(mesh, P())) for k in keys]
    with jax.set_mesh(mesh):
        for tokens, key in zip(batches, keys):
            params, opt_state, metrics = step(params, opt_state, tokens, key, step_controls())
    sq = lambda a, b: sum(float(np.sum(np.square(np.asarray(x) - np.asarray(y))))
                          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    ref = nnx.to_pure_dict(jax.device_get(params))
    zero = jax.tree.map(np.zeros_like, ref)
    diff, upd, norm = sq(params_n, ref), sq(ref, params0), sq(ref, zero)
    return {"after_step": len(batches), "loss_diff": abs(loss - float(metrics["loss"])),
            "grad_norm_diff": abs(grad_norm - float(metrics["grad_norm"])),
            "param_rel_error": (diff / norm) ** 0.5,
            "param_update_rel_error": (diff / upd) ** 0.5 if upd else 0.0}


class ReplayCheck:
    """--check: keep the first steps' batches and keys, then replay them on one
    device from the initial parameters, up to the first step that moves the
    parameters (step 1 runs at lr 0 when there is a warmup)."""

    def __init__(self, cfg: Config, params, schedule):
        t = cfg.train
        self.cfg, self.params0, self.replay = cfg, jax.device_get(params), []
        self.at = next((s for s in range(1, t.steps + 1) if schedule(s - 1) > 0), t.steps)

    def after(self, step: int, host_tokens, metrics, params, record: dict, log) -> None:
        if step > self.at:
            return
        self.replay.append((host_tokens,
                            jax.random.fold_in(jax.random.key(self.cfg.train.seed), step)))
        if step == self.at:
            host = jax.device_get(metrics)
            record["check"] = single_device_check(
                self.cfg, self.params0, *zip(*self.replay), float(host["loss"]),
                float(host["grad_norm"]), jax.device_get(params))
            log(f"check against one device after step {step}: " + ", ".join(
                f"{k} {v:.2e}" for k, v in record["check"].items() if k != "after_step"))
