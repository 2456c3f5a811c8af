"""Optimizer, sharded state, the jitted train/eval steps.

The model is split once (`nnx.split`) into a static graphdef and a pytree of
parameters; the steps are pure functions of that pytree, jitted with explicit
in/out shardings read from each parameter's PartitionSpec, and the train step
donates the parameter and optimizer buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import kernels
from .config import Config, TrainConfig
from .model import Transformer
from .sharding import constrain, mesh_axis_size, named, param_layout


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

    Each rank sums the squares of its shards, weighting a gradient that is
    replicated over a mesh axis by 1/size of that axis, and the weighted sums
    are reduced once over the axes the gradients are split on (tp; and dp
    under FSDP), as Megatron-LM reduces its norm once. Left to GSPMD, each
    sharded tensor's sum would be a separate all-reduce. (The weights are
    powers of two for the usual tp/dp, so exact.)
    """
    leaves = jax.tree.leaves(grads)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    split = [set(a for a in jax.tree.leaves(tuple(s)) if a in ("dp", "tp"))
             for s in spec_leaves]
    axes = tuple(a for a in ("dp", "tp")
                 if mesh_axis_size(a) > 1 and any(a in s for s in split))
    if not axes:
        return optax.tree.norm(grads)
    size = {a: mesh_axis_size(a) for a in axes}
    in_specs = tuple(P(*(a if a in axes else None for a in s)) for s in spec_leaves)

    def local(*leaves):
        total = jnp.float32(0)
        for x, s in zip(leaves, split):
            weight = math.prod(size[a] for a in axes if a not in s)
            total += jnp.sum(jnp.square(x.astype(jnp.float32))) / weight
        return jnp.sqrt(jax.lax.psum(total, axes))

    return jax.shard_map(local, in_specs=in_specs, out_specs=P(), axis_names=set(axes),
                         check_vma=False)(*leaves)


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


def resolve_attention(cfg: Config, device=None) -> Config:
    """`cfg` with model.attention resolved for `device` (default: the first
    device): `auto` becomes a kernel; `cudnn` where it cannot run is a
    `kernels.KernelError` naming the reason."""
    m = cfg.model
    device = jax.devices()[0] if device is None else device
    kernel = kernels.choose(m.attention, m.dtype, m.head_dim, m.seq_len, device,
                            cfg.parallel.impl, cfg.parallel.dp)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, attention=kernel))


def build_model(cfg: Config, seed: int = 0, device=None) -> Transformer:
    """The model of `cfg`, its parameters laid out by the config's rules (FSDP or not),
    its attention kernel resolved for `device`. Call under `jax.set_mesh` (the kv
    layout depends on tp), or inside eval_shape."""
    cfg = resolve_attention(cfg, device)
    with param_layout(cfg.parallel.fsdp):
        return Transformer(cfg.model, impl=cfg.parallel.impl, sp=cfg.parallel.sequence_parallel,
                           rngs=nnx.Rngs(seed))


def abstract_model(cfg: Config, mesh: Mesh):
    """(graphdef, abstract params) without allocating anything."""
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: build_model(cfg, device=mesh.devices.flat[0]))
    graphdef, params = nnx.split(model)
    return graphdef, params


def init_params(cfg: Config, mesh: Mesh):
    """Initialise directly into the sharded layout.

    Threefry is partitionable, so the values are identical for every tp and dp.
    """
    graphdef, abstract = abstract_model(cfg, mesh)
    shardings = nnx.get_named_sharding(abstract, mesh)

    def create():
        return nnx.split(build_model(cfg, cfg.train.seed, mesh.devices.flat[0]))[1]

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


def grads_of(graphdef, params, tokens_BT1, key, microbatches: int = 1):
    """(mean loss, gradients) of a batch [B, T+1], in `microbatches` sequential
    slices of B/M rows whose gradients are summed in fp32: the same result as
    one batch (the loss is a mean over equal-sized slices), with the
    activation memory of B/M rows. The dropout key is folded per slice.

    Slice m holds rows m, M+m, 2M+m, ...: reshaping [B] -> [B/M, M] keeps
    each dp rank's rows on that rank (the dp split is on the leading B/M), so
    slicing needs no communication.
    """
    value_and_grad = jax.value_and_grad(lambda p, t, k: loss_fn(graphdef, p, t, k))
    if microbatches == 1:
        return value_and_grad(params, tokens_BT1, key)
    B, T1 = tokens_BT1.shape
    tokens_MBT = constrain(tokens_BT1.reshape(B // microbatches, microbatches, T1),
                           "batch", None, None).transpose(1, 0, 2)
    tokens_MBT = constrain(tokens_MBT, None, "batch", None)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

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


def _step_fn(state: TrainState, use_dropout: bool, microbatches: int) -> Callable:
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
        _step_fn(state, use_dropout, microbatches),
        in_shardings=(state.param_shardings, state.opt_shardings,
                      named(state.mesh, "batch", None), replicated, replicated),
        out_shardings=(state.param_shardings, state.opt_shardings, replicated),
        donate_argnums=(0, 1),
    )


def step_controls(max_loss: float = float("inf"), grad_scale: float = 1.0) -> np.ndarray:
    """The `controls` argument of a train step: no spike guard, gradients as they are."""
    return np.array([max_loss, grad_scale], np.float32)


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
    def start(cls, seed: int, mesh: Mesh, saved: dict | None = None) -> "LoopState":
        """A fresh run's state, or the one `to_json` saved, replicated on `mesh`
        (built by a jitted function: in a multi-process run no process can
        place an array on the others' devices)."""
        saved = saved or {}
        host = {k: np.int32(saved.get(k, 0)) for k in _LOOP_INTS}
        host |= {k: np.float32(saved.get(k, 0.0)) for k in _LOOP_FLOATS}
        host["recent"] = np.asarray(saved.get("recent", [0.0] * SPIKE_WINDOW), np.float32)
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
    core = _step_fn(state, m.dropout > 0, t.microbatches)
    schedule = lr_schedule(t)
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
                      named(state.mesh, "batch", None)),
        out_shardings=(state.param_shardings, state.opt_shardings, replicated, replicated),
        donate_argnums=(0, 1, 2),
    )


def make_eval_step(state: TrainState) -> Callable:
    graphdef = state.graphdef
    return jax.jit(lambda params, tokens: loss_fn(graphdef, params, tokens),
                   in_shardings=(state.param_shardings, named(state.mesh, "batch", None)))


def compile_train_step(state: TrainState, batch_size: int, seq_len: int,
                       use_dropout: bool = False, microbatches: int = 1,
                       compiler_options: dict | None = None):
    """Ahead-of-time compiled train step for [batch, seq+1] tokens.

    Callable like the jitted step; `.as_text()` is the post-partitioning HLO
    whose collectives `jaxtp.hlo` reads. Works on an abstract state too.
    """
    step = make_train_step(state, use_dropout, microbatches)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32,
                                  sharding=named(state.mesh, "batch", None))
    # every argument abstract, so a mesh of compile-only devices works too
    # (jaxtp.plan and ahead-of-time compiles for another platform)
    replicated = NamedSharding(state.mesh, P())
    key = jax.eval_shape(jax.random.key, 0)
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
    controls = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=replicated)
    with jax.set_mesh(state.mesh):
        return step.lower(state.params, state.opt_state, tokens, key, controls).compile(
            compiler_options)


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
    step = make_train_step(state, use_dropout=cfg.model.dropout > 0,
                           microbatches=cfg.train.microbatches)
    params, opt_state = state.params, state.opt_state
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
