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
from ..parallel import (DATA_AXIS, batch_shape, batch_sharding, constrain, inputs_targets,
                        keep_axes, make_mesh)
from ..parallel.layout import explicit_mesh
from .optim import clip_by_global_norm
from .state import TrainState, init_train_state


def loss_fn(graphdef, params, tokens_BT1, dropout_key=None):
    """Next-token cross-entropy of tokens [B, T+1] (under cp, a placed
    [B, 2, T]: `jaxtp.parallel.batch_shape`)."""
    model = nnx.merge(graphdef, params)
    return model.loss(*inputs_targets(tokens_BT1), dropout_key=dropout_key)


def cross_entropy_of(model, tokens_BT1):
    """Mean next-token loss of a merged model on tokens [B, T+1] (jitted)."""
    graphdef, params = nnx.split(model)
    return jax.jit(lambda p, t: loss_fn(graphdef, p, t))(params, tokens_BT1)


def grads_of(graphdef, params, tokens_BT1, key, microbatches: int = 1):
    """(mean loss, gradients) of a batch [B, T+1], in `microbatches` sequential
    slices of B/M rows whose gradients are summed in fp32: the same result as
    one batch (the loss is a mean over equal-sized slices), with the
    activation memory of B/M rows. The dropout key is folded per slice.

    Slice m holds rows m, M+m, 2M+m, ...: reshaping [B] -> [B/M, M] keeps
    each dp rank's rows on that rank (the dp split is on the leading B/M), so
    slicing needs no communication.

    With dp > 1 and parameters replicated over dp (their PartitionSpecs name
    no dp), the slices run inside a shard_map manual over
    dp (`_over_dp_once`): each rank sums its own partial gradients and the sum
    is reduced over dp once per step, not once per slice. Under FSDP each
    slice's gradient is reduce-scattered over dp where it is made (ZeRO-3's
    sharded accumulator: Rajbhandari et al. 2020, Sec. 5.1), M times a step.
    """
    value_and_grad = jax.value_and_grad(lambda p, t, k: loss_fn(graphdef, p, t, k))
    if microbatches == 1:
        return value_and_grad(params, tokens_BT1, key)
    specs = nnx.get_partition_spec(params)
    model = nnx.merge(graphdef, params)  # what it was built with: its layout, its kernel
    if slices_over_dp(model.layout.dp, model.layout.fsdp, microbatches, model.layout.impl,
                      model.cfg.attention, model.layout.cp):
        return _over_dp_once(value_and_grad, params, specs, tokens_BT1, key, microbatches)
    return _accumulate(value_and_grad, params, tokens_BT1, key, microbatches)


def slices_over_dp(dp: int, fsdp: bool, microbatches: int, impl: str, attention: str,
                   cp: int = 1) -> bool:
    """Whether `grads_of` runs its slices in a shard_map manual over dp (the
    gradient reduced once per step). Not under FSDP (each slice's gradient is
    reduce-scattered), nor with cuDNN attention under gspmd or explicit
    (jax 0.10.2: its custom partitioning fails inside a shard_map that leaves
    an axis to GSPMD; shard_map's own regions are manual over every axis),
    nor under cp (its sum over cp is per slice, so the slices reduce as one
    batch does: not yet built): those reduce once per slice."""
    return (dp > 1 and not fsdp and microbatches > 1 and cp == 1
            and (attention != "cudnn" or impl == "shard_map"))


def slices_over_dp_of(cfg: Config) -> bool:
    """`slices_over_dp` for `cfg` (its attention resolved for the device)."""
    p = cfg.parallel
    return slices_over_dp(p.dp, p.fsdp, cfg.train.microbatches, p.impl, cfg.model.attention,
                          p.cp)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _accumulate(value_and_grad, params, tokens_BT1, key, microbatches: int):
    """The slices' (mean loss, mean gradient), summed in fp32 by a scan."""
    B, *rest = tokens_BT1.shape
    tail = (None, "seq") if len(rest) == 2 else (None,)  # under cp [B, 2, T]: T over cp
    tokens_MBT = constrain(tokens_BT1.reshape(B // microbatches, microbatches, *rest),
                           "batch", None, *tail)
    tokens_MBT = constrain(jnp.moveaxis(tokens_MBT, 1, 0), None, "batch", *tail)
    # zeros_like: typed like each parameter (its sharding, under impl explicit)
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)

    def body(carry, xs):
        loss_sum, grad_sum = carry
        m, tokens = xs
        loss, grads = value_and_grad(params, tokens,
                                     None if key is None else jax.random.fold_in(key, m))
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        return (loss_sum + loss, grad_sum), None

    (loss_sum, grad_sum), _ = jax.lax.scan(
        body, (jnp.float32(0), zeros), (jnp.arange(microbatches), tokens_MBT))
    grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grad_sum, params)
    return loss_sum / microbatches, grads


def _over_dp_once(value_and_grad, params, specs, tokens_BT1, key, microbatches: int):
    """`_accumulate` on each dp rank's rows, inside a shard_map manual over dp
    (check_vma off: the body has no dp collective to check, and with it on
    jax 0.10.2 mis-specs the residuals of a nested shard_map): the gradient
    of each slice is this rank's partial sum (the parameters are replicated
    over dp and dp is manual, so no one sums it), and the mean over dp is
    taken once at the end, in the gradient dtype: one all-reduce of every
    gradient per step, the bytes of an unsliced step. GSPMD (or a shard_map
    nested over the other axes) places the rest as it does without slices.

    On an Explicit mesh the other axes are made Auto around the shard_map and
    Explicit again inside it (`auto_axes`, `explicit_axes`), so that the
    model's types are as without slices: jax 0.10.2 closes a partial-manual
    shard_map's Explicit axes at its boundary, and every gradient would be
    gathered over tp on the way out. (Typing the parameters `reduced` over dp,
    whose gradients are then `unreduced`, fails at the first elementwise use
    of a parameter: jax 0.10.2 types only dot_general's mixed operands.)"""
    mesh = jax.sharding.get_abstract_mesh()
    others = tuple(a for a in mesh.axis_names if a != DATA_AXIS)
    drop = lambda s: keep_axes(s, others)
    whole = jax.tree.map(lambda s: P(), specs, is_leaf=_is_spec)  # over dp: replicated
    key_spec = None if key is None else P()

    def local(params, tokens_BT1, key):
        loss, grads = _accumulate(value_and_grad, params, tokens_BT1, key, microbatches)
        return (jax.lax.pmean(loss, DATA_AXIS),
                jax.tree.map(lambda g: jax.lax.pmean(g, DATA_AXIS), grads))

    explicit = explicit_mesh()
    if explicit:
        local = jax.sharding.explicit_axes(
            local, axes=others, in_sharding=(jax.tree.map(drop, specs, is_leaf=_is_spec),
                                             P(), key_spec))
    step = jax.shard_map(local, in_specs=(whole, P(DATA_AXIS), key_spec),
                         out_specs=(P(), whole), axis_names={DATA_AXIS}, check_vma=False)
    if explicit:
        step = jax.sharding.auto_axes(step, axes=others, out_sharding=(P(), specs))
    return step(params, tokens_BT1, key)


def step_fn(state: TrainState, use_dropout: bool, microbatches: int) -> Callable:
    graphdef, tx, clip = state.graphdef, state.tx, state.grad_clip
    specs = jax.tree.map(lambda s: s.spec, state.param_shardings)

    def step(params, opt_state, tokens_BT1, key, controls):
        max_loss, grad_scale = controls[0], controls[1]
        loss, grads = grads_of(graphdef, params, tokens_BT1, key if use_dropout else None,
                               microbatches)
        grads = jax.tree.map(lambda g: (g * grad_scale).astype(g.dtype), grads)
        grads, grad_norm = clip_by_global_norm(grads, clip, specs)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (loss <= max_loss)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        return (keep(new_params, params), keep(new_opt_state, opt_state),
                {"loss": loss, "grad_norm": grad_norm, "skipped": ~ok})

    return step


def make_train_step(state: TrainState, use_dropout: bool, microbatches: int = 1) -> Callable:
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
        step_fn(state, use_dropout, microbatches),
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
    return jax.jit(lambda params, tokens: loss_fn(graphdef, params, tokens),
                   in_shardings=(state.param_shardings, batch_sharding(state.mesh)),
                   compiler_options=state.compiler_options)


def compile_train_step(state: TrainState, batch_size: int, seq_len: int,
                       use_dropout: bool = False, microbatches: int = 1,
                       compiler_options: dict | None = None):
    """Ahead-of-time compiled train step for [batch, seq+1] tokens.

    Callable like the jitted step; `.as_text()` is the post-partitioning HLO
    whose collectives `jaxtp.hlo` reads. Works on an abstract state too.
    """
    step = make_train_step(state, use_dropout, microbatches)
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


def single_device_check(cfg: Config, params0, batches, keys, loss: float, grad_norm: float,
                        params_n) -> dict:
    """Replay the first steps on a single device (tp=1, dp=1) and compare.

    `params0`/`params_n`: the parallel run's parameters before step 1 and
    after step n = len(batches) (host copies); `loss`, `grad_norm`: its step-n
    metrics. Parameter error: ||p_n - ref_n|| / ||ref_n||; update error:
    ||p_n - ref_n|| / ||ref_n - p0||, far more sensitive, as Adam's first
    updates are nearly lr * sign(g) and magnify round-off in small gradients.
    """
    one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=1, tp=1, cp=1,
                                                                impl="gspmd"))
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    state = init_train_state(one, mesh, params=params0)
    step = make_train_step(state, use_dropout=cfg.model.dropout > 0,
                           microbatches=cfg.train.microbatches)
    params, opt_state = state.params, state.opt_state
    # the run's keys live on its mesh (typed with it under impl explicit)
    keys = [jax.device_put(k, NamedSharding(mesh, P())) for k in keys]
    with jax.set_mesh(mesh):
        for tokens, key in zip(batches, keys):
            params, opt_state, metrics = step(params, opt_state, tokens, key, step_controls())
    sq = lambda a, b: sum(float(np.sum(np.square(np.asarray(x) - np.asarray(y))))
                          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    ref = jax.device_get(params)
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
