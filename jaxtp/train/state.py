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
from ..model import Transformer
from ..model import kernels
from ..parallel import Layout, compiler_options, mesh_for
from .optim import make_optimizer


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
    # XLA options the steps compile with (GSPMD's windowed einsum under
    # parallel.overlap, `jaxtp.parallel.compiler_options`); None: the defaults
    compiler_options: dict | None = None


def resolve_attention(cfg: Config, device=None, cpu_tuned: bool = True) -> Config:
    """`cfg` with model.attention resolved for `device` (default: the first
    device): `auto` becomes a kernel; `cudnn` where it cannot run is a
    `kernels.KernelError` naming the reason. `cpu_tuned=False`: a CPU device
    takes the accelerators' choice (`kernels.choose`)."""
    m = cfg.model
    device = jax.devices()[0] if device is None else device
    kernel = kernels.choose(m.attention, m.dtype, m.head_dim, m.seq_len, device, cpu_tuned)
    if kernel == "cudnn" and m.attention == "auto" and cfg.parallel.cp > 1:
        kernel = "blockwise"  # cuDNN gives no log-sum-exp to merge cp's parts by
    block = kernels.choose_block(m.attention, m.attention_block, device, cpu_tuned)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, attention=kernel,
                                                              attention_block=block))


def build_model(cfg: Config, seed: int = 0, device=None) -> Transformer:
    """The model of `cfg`, its parameters laid out by its `Layout` (FSDP or not),
    its attention kernel resolved for `device`. Call under `jax.set_mesh` or
    inside eval_shape: each parameter is placed by its PartitionSpec as it is
    created."""
    cfg = resolve_attention(cfg, device)
    return Transformer(cfg.model, Layout.of(cfg), rngs=nnx.Rngs(seed))


def abstract_model(cfg: Config, mesh: Mesh):
    """(graphdef, abstract params) without allocating anything. (Here and in
    each function below, `mesh` may have any axis types: it is retyped for
    the impl, `Layout.on`.)"""
    mesh = Layout.of(cfg).on(mesh)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: build_model(cfg, device=mesh.devices.flat[0]))
    graphdef, params = nnx.split(model)
    return graphdef, params


def init_params(cfg: Config, mesh: Mesh):
    """Initialise directly into the sharded layout.

    Threefry is partitionable and GSPMD partitions the draw, so every tp and
    dp draws the bits one device draws. The draw runs on the mesh's Auto axes
    for every impl: typed on Explicit axes it is computed replicated and then
    sliced, and XLA compiles the float transform of the bits differently (up
    to 3 ulp off one device's). Explicit's arrays are then retyped onto its
    mesh (the same devices and layout).
    """
    mesh = Layout.of(cfg).on(mesh)
    graphdef, abstract = abstract_model(cfg, mesh)
    shardings = nnx.get_named_sharding(abstract, mesh)
    auto = mesh_for(mesh, "gspmd")

    def create():
        return nnx.split(build_model(cfg, cfg.train.seed, mesh.devices.flat[0]))[1]

    with jax.set_mesh(auto):
        params = jax.jit(create, out_shardings=nnx.get_named_sharding(abstract, auto))()
    return graphdef, jax.device_put(params, shardings), shardings


def _state(cfg: Config, mesh: Mesh, graphdef, params, param_shardings) -> TrainState:
    mesh = Layout.of(cfg).on(mesh)
    tx = make_optimizer(cfg.train)
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
                      cfg.train.grad_clip, options)


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
    mesh = Layout.of(cfg).on(mesh)
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
    mesh = Layout.of(cfg).on(mesh)
    graphdef, abstract = abstract_model(cfg, mesh)
    param_shardings = nnx.get_named_sharding(abstract, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract, param_shardings)
    return _state(cfg, mesh, graphdef, params, param_shardings)
