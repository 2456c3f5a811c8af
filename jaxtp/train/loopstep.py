"""The training loop's step: one train step with the loop's bookkeeping (the
dropout key, the lr, the spike guard, NaN drills, skip and row counts) kept
on the devices, so the host reads it only when it logs or saves."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..config import Config, TrainConfig
from ..parallel import batch_sharding, wide
from .optim import lr_schedule
from .state import TrainState
from .step import step_fn


SPIKE_WINDOW = 20  # applied losses the spike guard averages over
_LOOP_INTS = ("step", "applied", "in_a_row", "stop_at", "row_applied", "row_skipped",
              "skip_step")
_LOOP_FLOATS = ("row_loss", "skip_loss", "skip_grad_norm")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=[*_LOOP_INTS, *_LOOP_FLOATS, "recent", "key"], meta_fields=[])
@dataclasses.dataclass
class LoopState:
    """The loop's bookkeeping, kept on the devices and updated inside the step
    (`make_loop_step`), so the host reads it only when it logs or saves.

    step: the last step run; applied: steps whose update was applied (optax's
    count, which sets the lr); in_a_row: skipped steps in a row; stop_at: the
    step that reached train.max_skipped_steps (0: running); row_*: applied
    losses summed, applied and skipped steps since the last logged row;
    skip_*: the last skipped step and its loss and gradient norm; recent: the
    last SPIKE_WINDOW applied losses (a ring, by `applied`); key: the run's
    base PRNG key (step n's dropout key is fold_in(key, n)).
    """

    step: Any
    applied: Any
    in_a_row: Any
    stop_at: Any
    row_applied: Any
    row_skipped: Any
    skip_step: Any
    row_loss: Any
    skip_loss: Any
    skip_grad_norm: Any
    recent: Any
    key: Any

    @classmethod
    def start(cls, seed: int, mesh: Mesh, saved: dict | None = None,
              dtype=np.float32) -> "LoopState":
        """A fresh run's state, or the one `to_json` saved, replicated on `mesh`
        (built by a jitted function: in a multi-process run no process can
        place an array on the others' devices). `dtype`: the losses' (the
        model's `wide` dtype: float64 in a float64 run)."""
        saved = saved or {}
        host = {k: np.int32(saved.get(k, 0)) for k in _LOOP_INTS}
        host |= {k: np.asarray(saved.get(k, 0.0), dtype) for k in _LOOP_FLOATS}
        host["recent"] = np.asarray(saved.get("recent", [0.0] * SPIKE_WINDOW), dtype)
        build = lambda h: cls(**h, key=jax.random.key(seed))
        return jax.jit(build, out_shardings=NamedSharding(mesh, P()))(host)

    def to_json(self) -> dict:
        """Host values of every field but the key (it follows from the seed)."""
        host = jax.device_get({k: getattr(self, k) for k in (*_LOOP_INTS, *_LOOP_FLOATS,
                                                              "recent")})
        out = {k: int(host[k]) for k in _LOOP_INTS}
        out |= {k: float(host[k]) for k in _LOOP_FLOATS}
        return out | {"recent": [float(x) for x in host["recent"]]}


def is_row_step(n, t: TrainConfig):
    """Whether step n ends a logged row: step 1, every log_every, every
    eval_every and the last (works on ints and on traced values)."""
    return (n == 1) | (n % t.log_every == 0) | (n % t.eval_every == 0) | (n == t.steps)


def make_loop_step(state: TrainState, cfg: Config, inject_nan_at=()) -> Callable:
    """jitted (params, opt_state, loop, tokens) -> (params, opt_state, loop, metrics):
    one step of the training loop with everything the host used to do per step
    moved inside (the dropout key, the lr, the spike guard's limit, NaN
    injection, the skip and row bookkeeping of `LoopState`), so consecutive
    steps dispatch without the host waiting for the device.

    metrics: this step's loss, grad_norm, lr and skipped. Once `stop_at` is
    set, further steps change nothing (a host that reads the state only when
    it logs may have dispatched a few more).
    """
    t, m = cfg.train, cfg.model
    core = step_fn(state, m.dropout > 0)
    schedule = lr_schedule(t, wide(m.dtype))
    nan_steps = np.asarray(sorted(inject_nan_at) or [-1], np.int32)

    def step(params, opt_state, loop: LoopState, tokens_BT1):
        n = loop.step + 1
        stopped = loop.stop_at > 0
        window = jnp.arange(SPIKE_WINDOW) < loop.applied
        mean = jnp.sum(jnp.where(window, loop.recent, 0)) / jnp.maximum(
            jnp.minimum(loop.applied, SPIKE_WINDOW), 1)
        max_loss = jnp.where((t.spike_factor > 0) & (loop.applied >= 5),
                             t.spike_factor * mean, jnp.inf)
        max_loss = jnp.where(stopped, -jnp.inf, max_loss)  # a stopped run applies nothing
        grad_scale = jnp.where(jnp.any(nan_steps == n), jnp.nan, 1.0)
        params, opt_state, metrics = core(params, opt_state, tokens_BT1,
                                          jax.random.fold_in(loop.key, n),
                                          jnp.stack([max_loss, grad_scale]).astype(jnp.float32))
        ok = ~metrics["skipped"]
        bad = metrics["skipped"] & ~stopped
        fresh = is_row_step(loop.step, t) | (loop.step == 0)  # a new row starts here
        zero = lambda x: jnp.where(fresh, jnp.zeros_like(x), x)
        in_a_row = jnp.where(ok, 0, loop.in_a_row + bad)
        loss = metrics["loss"]
        new = LoopState(
            step=n, applied=loop.applied + ok, in_a_row=in_a_row,
            stop_at=jnp.where(~stopped & (in_a_row >= t.max_skipped_steps), n, loop.stop_at),
            row_applied=zero(loop.row_applied) + ok, row_skipped=zero(loop.row_skipped) + bad,
            skip_step=jnp.where(bad, n, loop.skip_step),
            row_loss=zero(loop.row_loss) + jnp.where(ok, loss, 0.0),
            skip_loss=jnp.where(bad, loss, loop.skip_loss),
            skip_grad_norm=jnp.where(bad, metrics["grad_norm"], loop.skip_grad_norm),
            recent=jnp.where(ok, loop.recent.at[loop.applied % SPIKE_WINDOW].set(loss),
                             loop.recent),
            key=loop.key)
        # the lr this step applied (or would have): optax's count before it
        return params, opt_state, new, metrics | {"lr": schedule(loop.applied)}

    replicated = NamedSharding(state.mesh, P())
    return jax.jit(
        step,
        in_shardings=(state.param_shardings, state.opt_shardings, replicated,
                      batch_sharding(state.mesh)),
        out_shardings=(state.param_shardings, state.opt_shardings, replicated, replicated),
        donate_argnums=(0, 1, 2), compiler_options=state.compiler_options,
    )
