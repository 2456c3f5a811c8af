"""The train state: the model built for a config and a mesh, its parameters
placed by their PartitionSpecs, and AdamW's state laid out like them."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..config import Config
from ..model import reorder_layers
from ..model.build import abstract_model, build_model, resolve_attention
from ..parallel import Layout, Schedule, compiler_options, mesh_for, wide
from .optim import make_optimizer


@dataclasses.dataclass
class TrainState:
    """Everything a step needs, with the shardings it was placed with, and the
    Layout and Schedule the run was decided with (once, from its config)."""

    graphdef: Any
    params: Any  # nnx.State of Params, sharded over the mesh
    opt_state: Any
    tx: optax.GradientTransformation
    mesh: Mesh
    param_shardings: Any
    opt_shardings: Any
    grad_clip: float
    # XLA options the steps compile with (GSPMD's windowed einsum under
    # parallel.overlap, `jaxtp.parallel.compiler_options`); None: the defaults
    compiler_options: dict | None = None
    layout: Layout = Layout()
    schedule: Schedule = Schedule()


def decide(cfg: Config, mesh: Mesh | None = None) -> tuple[Config, Layout, Mesh]:
    """The run's decisions, made here and nowhere else in `jaxtp.train`: its
    `Layout`, `mesh` (default: the layout's over this machine's devices) with
    the impl's axis types, and `cfg` with its attention kernel resolved for
    the mesh's devices. (Here and below `mesh` may have any axis types.)"""
    layout = Layout.of(cfg)
    mesh = layout.mesh() if mesh is None else layout.on(mesh)
    return resolve_attention(cfg, mesh.devices.flat[0]), layout, mesh


def init_params(cfg: Config, mesh: Mesh, layout: Layout | None = None):
    """Initialise directly into the sharded layout.

    Threefry is partitionable and GSPMD partitions the draw, so every tp and
    dp draws the bits one device draws. The draw runs on the mesh's Auto axes
    for every impl: typed on Explicit axes it is computed replicated and then
    sliced, and XLA compiles the float transform of the bits differently (up
    to 3 ulp off one device's). Explicit's arrays are then retyped onto its
    mesh (the same devices and layout).
    """
    if layout is None:
        cfg, layout, mesh = decide(cfg, mesh)
    graphdef, abstract = abstract_model(cfg, mesh, layout)
    shardings = nnx.get_named_sharding(abstract, mesh)
    auto = mesh_for(mesh, "gspmd")

    def create():
        return nnx.split(build_model(cfg, layout, cfg.train.seed, mesh.devices.flat[0]))[1]

    with jax.set_mesh(auto):
        params = jax.jit(create, out_shardings=nnx.get_named_sharding(abstract, auto))()
    return graphdef, jax.device_put(params, shardings), shardings


def _state(cfg: Config, layout: Layout, mesh: Mesh, graphdef, params,
           param_shardings) -> TrainState:
    m = cfg.model
    tx = make_optimizer(cfg.train, wide(m.dtype),
                        m.moe_bias_rate if m.n_experts and m.moe_balance.startswith("bias") else 0)
    abstract = isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct)
    # placed parameters: under this mesh, whatever mesh the caller is under
    # (the single-device check runs inside the loop's); abstract ones may be
    # on compile-only devices, on which nothing can run eagerly
    with contextlib.nullcontext() if abstract else jax.set_mesh(mesh):
        # Adam's mu and nu mirror the parameters, so they take the same layout.
        opt_shardings = optax.tree_map_params(
            tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
            transform_non_params=lambda _: NamedSharding(mesh, P()))
        if abstract:
            opt_state = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                jax.eval_shape(tx.init, params), opt_shardings)
        else:
            opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    options = compiler_options(cfg, mesh.devices.flat[0].platform)
    return TrainState(graphdef, params, opt_state, tx, mesh, param_shardings, opt_shardings,
                      cfg.train.grad_clip, options, layout, Schedule.of(cfg, layout))


def init_train_state(cfg: Config, mesh: Mesh, params=None) -> TrainState:
    """Parameters (fresh, or `params` placed onto this mesh) and AdamW state."""
    cfg, layout, mesh = decide(cfg, mesh)
    if params is None:
        graphdef, params, param_shardings = init_params(cfg, mesh, layout)
    else:
        graphdef, params, param_shardings = place_params(cfg, mesh, params, layout)
    return _state(cfg, layout, mesh, graphdef, params, param_shardings)


def place_params(cfg: Config, mesh: Mesh, values, layout: Layout | None = None):
    """Put parameter values (an nnx.State from any tp, or a nested dict of
    arrays; stacked layers in model order) into this config's layout on
    `mesh`: (graphdef, params, shardings).

    The layout metadata is part of the pytree (a kv projection is sharded at
    one tp and replicated at another), so values go through a plain dict.
    """
    if layout is None:
        cfg, layout, mesh = decide(cfg, mesh)
    graphdef, abstract = abstract_model(cfg, mesh, layout)
    shardings = nnx.get_named_sharding(abstract, mesh)
    pure = values if isinstance(values, dict) else nnx.to_pure_dict(values)
    schedule = Schedule.of(cfg, layout)
    if schedule.stacked and "blocks" in pure:  # model order -> the stack's
        pure = reorder_layers(pure, schedule.layer_order())
    want = jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), nnx.to_pure_dict(abstract))
    got = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), pure)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise ValueError("parameter values do not fit this model config (names, shapes or "
                         "dtypes differ)")
    nnx.replace_by_pure_dict(abstract, pure)
    return graphdef, jax.device_put(abstract, shardings), shardings


def abstract_train_state(cfg: Config, mesh: Mesh) -> TrainState:
    """A TrainState of ShapeDtypeStructs: enough to compile a step, allocates nothing."""
    cfg, layout, mesh = decide(cfg, mesh)
    graphdef, abstract = abstract_model(cfg, mesh, layout)
    param_shardings = nnx.get_named_sharding(abstract, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract, param_shardings)
    return _state(cfg, layout, mesh, graphdef, params, param_shardings)
