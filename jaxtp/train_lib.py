"""Optimizer, sharded state, the jitted train/eval steps.

The model is split once (`nnx.split`) into a static graphdef and a pytree of
parameters; the steps are pure functions of that pytree, jitted with explicit
in/out shardings read from each parameter's PartitionSpec, and the train step
donates the parameter and optimizer buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import Config, TrainConfig
from .model import Transformer
from .sharding import named


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup to `lr`, cosine decay to `lr * min_lr_ratio` at `steps`.

    Warmup starts at lr / (warmup + 1), not 0: a first step at lr 0 is wasted.
    """
    return optax.warmup_cosine_decay_schedule(
        t.lr / (t.warmup_steps + 1), t.lr, t.warmup_steps, max(t.steps, t.warmup_steps + 1),
        t.lr * t.min_lr_ratio)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    """AdamW; no weight decay on norms and biases. Clipping is in the step."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                       mask=decay_mask)


def clip_by_global_norm(grads, max_norm: float):
    """(clipped grads, pre-clip global norm), as optax.clip_by_global_norm.

    Done here rather than in the optax chain so that one norm both clips and is
    logged: each tp-sharded gradient's squared sum is a scalar all-reduce over
    tp, and a second norm would double those reductions.
    """
    norm = optax.tree.norm(grads)
    if max_norm <= 0:
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm


def cross_entropy(logits_BTV, targets_BT):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BTV.astype(jnp.float32), targets_BT).mean()


@dataclasses.dataclass
class TrainState:
    """Everything a step needs, with the shardings it was placed with."""

    graphdef: Any
    params: Any  # nnx.State of Params, sharded over the mesh
    opt_state: Any
    tx: optax.GradientTransformation
    mesh: Mesh
    param_shardings: Any
    opt_shardings: Any
    grad_clip: float

    def model(self) -> Transformer:
        return nnx.merge(self.graphdef, self.params)


def abstract_model(cfg: Config, mesh: Mesh):
    """(graphdef, abstract params) without allocating anything."""
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(
            lambda: Transformer(cfg.model, impl=cfg.parallel.impl, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    return graphdef, params


def init_params(cfg: Config, mesh: Mesh):
    """Initialise directly into the sharded layout.

    Threefry is partitionable, so the values are identical for every tp and dp.
    """
    graphdef, abstract = abstract_model(cfg, mesh)
    shardings = nnx.get_named_sharding(abstract, mesh)

    def create():
        model = Transformer(cfg.model, impl=cfg.parallel.impl,
                            rngs=nnx.Rngs(cfg.train.seed))
        return nnx.split(model)[1]

    with jax.set_mesh(mesh):
        params = jax.jit(create, out_shardings=shardings)()
    return graphdef, params, shardings


def _opt_shardings(tx, params, param_shardings, mesh: Mesh):
    # Adam's mu and nu mirror the parameters, so they take the same layout.
    return optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))


def init_train_state(cfg: Config, mesh: Mesh, params=None) -> TrainState:
    """Parameters (fresh, or `params` resharded) and AdamW state on the mesh."""
    graphdef, fresh, param_shardings = init_params(cfg, mesh)
    params = fresh if params is None else jax.device_put(params, param_shardings)
    tx = make_optimizer(cfg.train)
    opt_shardings = _opt_shardings(tx, params, param_shardings, mesh)
    with jax.set_mesh(mesh):
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    return TrainState(graphdef, params, opt_state, tx, mesh, param_shardings, opt_shardings,
                      cfg.train.grad_clip)


def abstract_train_state(cfg: Config, mesh: Mesh) -> TrainState:
    """A TrainState of ShapeDtypeStructs: enough to compile a step, allocates nothing."""
    graphdef, abstract = abstract_model(cfg, mesh)
    param_shardings = nnx.get_named_sharding(abstract, mesh)
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    params = jax.tree.map(sds, abstract, param_shardings)
    tx = make_optimizer(cfg.train)
    opt_shardings = _opt_shardings(tx, params, param_shardings, mesh)
    opt_state = jax.tree.map(sds, jax.eval_shape(tx.init, params), opt_shardings)
    return TrainState(graphdef, params, opt_state, tx, mesh, param_shardings, opt_shardings,
                      cfg.train.grad_clip)


def loss_fn(graphdef, params, tokens_BT1, dropout_key=None):
    """Next-token cross-entropy of tokens [B, T+1]."""
    model = nnx.merge(graphdef, params)
    logits_BTV = model(tokens_BT1[:, :-1], dropout_key=dropout_key)
    return cross_entropy(logits_BTV, tokens_BT1[:, 1:])


def make_train_step(state: TrainState, use_dropout: bool) -> Callable:
    """jitted (params, opt_state, tokens, key) -> (params, opt_state, metrics)."""
    graphdef, tx, clip = state.graphdef, state.tx, state.grad_clip

    def step(params, opt_state, tokens_BT1, key):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(graphdef, p, tokens_BT1, key if use_dropout else None))(params)
        grads, grad_norm = clip_by_global_norm(grads, clip)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

    replicated = NamedSharding(state.mesh, P())
    return jax.jit(
        step,
        in_shardings=(state.param_shardings, state.opt_shardings,
                      named(state.mesh, "batch", None), replicated),
        out_shardings=(state.param_shardings, state.opt_shardings, replicated),
        donate_argnums=(0, 1),
    )


def make_eval_step(state: TrainState) -> Callable:
    graphdef = state.graphdef
    return jax.jit(lambda params, tokens: loss_fn(graphdef, params, tokens),
                   in_shardings=(state.param_shardings, named(state.mesh, "batch", None)))


def compile_train_step(state: TrainState, batch_size: int, seq_len: int,
                       use_dropout: bool = False):
    """Ahead-of-time compiled train step for [batch, seq+1] tokens.

    Callable like the jitted step; `.as_text()` is the post-partitioning HLO
    whose collectives `jaxtp.hlo` reads. Works on an abstract state too.
    """
    step = make_train_step(state, use_dropout)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32,
                                  sharding=named(state.mesh, "batch", None))
    with jax.set_mesh(state.mesh):
        return step.lower(state.params, state.opt_state, tokens, jax.random.key(0)).compile()


def single_device_check(cfg: Config, tokens_BT1, key, loss: float, grad_norm: float,
                        params_after) -> dict:
    """Replay step 1 on one device (tp=1, dp=1) and compare with the parallel run.

    `params_after`: the parallel run's parameters after that step (host copy).
    The update error is ||p_tp - p_ref|| / ||p_ref - p_0|| over all tensors.
    """
    import numpy as np

    from .sharding import make_mesh

    one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=1, tp=1,
                                                                impl="gspmd"))
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    state = init_train_state(one, mesh)
    p0 = jax.device_get(state.params)
    step = make_train_step(state, use_dropout=cfg.model.dropout > 0)
    with jax.set_mesh(mesh):
        p1, _, metrics = step(state.params, state.opt_state, tokens_BT1, key)
    p1 = jax.device_get(p1)
    diff = sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2))
               for a, b in zip(jax.tree.leaves(params_after), jax.tree.leaves(p1)))
    upd = sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2))
              for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)))
    return {"loss_diff": abs(loss - float(metrics["loss"])),
            "grad_norm_diff": abs(grad_norm - float(metrics["grad_norm"])),
            "param_update_rel_error": (diff / upd) ** 0.5 if upd else 0.0}
