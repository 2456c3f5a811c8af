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
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import Config, TrainConfig
from .model import Transformer
from .sharding import mesh_axis_size, named


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, cosine decay to `lr * min_lr_ratio` at `steps`.

    Step 1 runs at lr 0 (it only seeds Adam's moments). Its update would be
    lr * g / (|g| + eps) ~ lr * sign(g): round-off-sized gradients would get
    lr-sized steps of arbitrary sign, and parallel runs would drift ~100x
    further from a single device (measured: 1e-5 vs 1e-7 after 10 steps).
    """
    return optax.warmup_cosine_decay_schedule(
        0.0, t.lr, t.warmup_steps, max(t.steps, t.warmup_steps + 1),
        t.lr * t.min_lr_ratio)


def _decays(path, _) -> bool:
    """Weight decay applies to matrices (kernels, embedding tables), not to
    norm scales or biases, whatever their rank (a q bias is [N, H])."""
    names = [k.key for k in path if hasattr(k, "key")]
    return names[-1] in ("kernel", "embedding")


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019) with the schedule above. Clipping is in the step."""
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(_decays, params)
    return optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                       mask=decay_mask)


def global_norm(grads, specs):
    """sqrt of the sum of squares of all gradients, with one scalar all-reduce.

    Each rank sums the squares of its shards of the tp-sharded gradients, the
    partial sums are added locally and reduced over tp once (as Megatron-LM
    does); replicated gradients are counted once, after the reduction. Left
    to GSPMD, each sharded tensor's sum would be a separate all-reduce.
    """
    leaves = jax.tree.leaves(grads)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    sharded = ["tp" in jax.tree.leaves(tuple(s)) for s in spec_leaves]
    if not any(sharded) or mesh_axis_size("tp") == 1:
        return optax.tree.norm(grads)
    tp_only = [P(*(a if a == "tp" else None for a in s)) for s in spec_leaves]

    def local(*leaves):
        sq = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves]
        part = sum(v for v, sh in zip(sq, sharded) if sh)
        full = sum((v for v, sh in zip(sq, sharded) if not sh), jnp.float32(0))
        return jnp.sqrt(jax.lax.psum(part, "tp") + full)

    return jax.shard_map(local, in_specs=tuple(tp_only), out_specs=P(), axis_names={"tp"},
                         check_vma=True)(*leaves)


def clip_by_global_norm(grads, max_norm: float, specs):
    """(clipped grads, pre-clip global norm), as optax.clip_by_global_norm.

    Done here rather than in the optax chain so that one norm both clips and is
    logged (a second norm would be a second reduction over tp).
    """
    norm = global_norm(grads, specs)
    if max_norm <= 0:
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm


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


def abstract_model(cfg: Config, mesh: Mesh):
    """(graphdef, abstract params) without allocating anything."""
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(
            lambda: Transformer(cfg.model, impl=cfg.parallel.impl, sp=cfg.parallel.sp,
                                rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    return graphdef, params


def init_params(cfg: Config, mesh: Mesh):
    """Initialise directly into the sharded layout.

    Threefry is partitionable, so the values are identical for every tp and dp.
    """
    graphdef, abstract = abstract_model(cfg, mesh)
    shardings = nnx.get_named_sharding(abstract, mesh)

    def create():
        model = Transformer(cfg.model, impl=cfg.parallel.impl, sp=cfg.parallel.sp,
                            rngs=nnx.Rngs(cfg.train.seed))
        return nnx.split(model)[1]

    with jax.set_mesh(mesh):
        params = jax.jit(create, out_shardings=shardings)()
    return graphdef, params, shardings


def _state(cfg: Config, mesh: Mesh, graphdef, params, param_shardings) -> TrainState:
    tx = make_optimizer(cfg.train)
    # Adam's mu and nu mirror the parameters, so they take the same layout.
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))
    if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct):
        opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 jax.eval_shape(tx.init, params), opt_shardings)
    else:
        with jax.set_mesh(mesh):
            opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    return TrainState(graphdef, params, opt_state, tx, mesh, param_shardings, opt_shardings,
                      cfg.train.grad_clip)


def init_train_state(cfg: Config, mesh: Mesh, params=None) -> TrainState:
    """Parameters (fresh, or `params` placed onto this mesh) and AdamW state."""
    if params is None:
        graphdef, params, param_shardings = init_params(cfg, mesh)
    else:
        graphdef, params, param_shardings = place_params(cfg, mesh, params)
    return _state(cfg, mesh, graphdef, params, param_shardings)


def place_params(cfg: Config, mesh: Mesh, values):
    """Put parameter values (an nnx.State from any tp, or a nested dict of
    arrays) into this config's layout on `mesh`: (graphdef, params, shardings).

    The layout metadata is part of the pytree (a kv projection is sharded at
    one tp and replicated at another), so values go through a plain dict.
    """
    graphdef, abstract = abstract_model(cfg, mesh)
    shardings = nnx.get_named_sharding(abstract, mesh)
    pure = values if isinstance(values, dict) else nnx.to_pure_dict(values)
    want = jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), nnx.to_pure_dict(abstract))
    got = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), pure)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise ValueError("parameter values do not fit this model config (names, shapes or "
                         "dtypes differ)")
    nnx.replace_by_pure_dict(abstract, pure)
    return graphdef, jax.device_put(abstract, shardings), shardings


def abstract_train_state(cfg: Config, mesh: Mesh) -> TrainState:
    """A TrainState of ShapeDtypeStructs: enough to compile a step, allocates nothing."""
    graphdef, abstract = abstract_model(cfg, mesh)
    param_shardings = nnx.get_named_sharding(abstract, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract, param_shardings)
    return _state(cfg, mesh, graphdef, params, param_shardings)


def loss_fn(graphdef, params, tokens_BT1, dropout_key=None):
    """Next-token cross-entropy of tokens [B, T+1]."""
    model = nnx.merge(graphdef, params)
    return model.loss(tokens_BT1[:, :-1], tokens_BT1[:, 1:], dropout_key=dropout_key)


def cross_entropy_of(model, tokens_BT1):
    """Mean next-token loss of a merged model on tokens [B, T+1] (jitted)."""
    graphdef, params = nnx.split(model)
    return jax.jit(lambda p, t: loss_fn(graphdef, p, t))(params, tokens_BT1)


def make_train_step(state: TrainState, use_dropout: bool) -> Callable:
    """jitted (params, opt_state, tokens, key) -> (params, opt_state, metrics)."""
    graphdef, tx, clip = state.graphdef, state.tx, state.grad_clip
    specs = jax.tree.map(lambda s: s.spec, state.param_shardings)

    def step(params, opt_state, tokens_BT1, key):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(graphdef, p, tokens_BT1, key if use_dropout else None))(params)
        grads, grad_norm = clip_by_global_norm(grads, clip, specs)
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


def single_device_check(cfg: Config, params0, batches, keys, loss: float, grad_norm: float,
                        params_n) -> dict:
    """Replay the first steps on a single device (tp=1, dp=1) and compare.

    `params0`/`params_n`: the parallel run's parameters before step 1 and
    after step n = len(batches) (host copies); `loss`, `grad_norm`: its step-n
    metrics. Parameter error: ||p_n - ref_n|| / ||ref_n||; update error:
    ||p_n - ref_n|| / ||ref_n - p0||, far more sensitive, as Adam's first
    updates are nearly lr * sign(g) and magnify round-off in small gradients.
    """
    from .sharding import make_mesh

    one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=1, tp=1,
                                                                impl="gspmd"))
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    state = init_train_state(one, mesh, params=params0)
    step = make_train_step(state, use_dropout=cfg.model.dropout > 0)
    params, opt_state = state.params, state.opt_state
    with jax.set_mesh(mesh):
        for tokens, key in zip(batches, keys):
            params, opt_state, metrics = step(params, opt_state, tokens, key)
    sq = lambda a, b: sum(float(np.sum(np.square(np.asarray(x) - np.asarray(y))))
                          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    ref = jax.device_get(params)
    zero = jax.tree.map(np.zeros_like, ref)
    diff, upd, norm = sq(params_n, ref), sq(ref, params0), sq(ref, zero)
    return {"after_step": len(batches), "loss_diff": abs(loss - float(metrics["loss"])),
            "grad_norm_diff": abs(grad_norm - float(metrics["grad_norm"])),
            "param_rel_error": (diff / norm) ** 0.5,
            "param_update_rel_error": (diff / upd) ** 0.5 if upd else 0.0}
