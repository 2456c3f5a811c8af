"""The model of a config on a layout: its attention kernel resolved for a
device, built under a mesh (each parameter placed by its PartitionSpec as it
is created), or only its shapes."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from ..parallel import Layout, Schedule
from ..parallel.pipeline import stages_leave_axes
from . import kernels
from .transformer import Transformer


def resolve_attention(cfg, device=None, cpu_tuned: bool = True):
    """`cfg` with model.attention resolved for `device` (default: the first
    device): `auto` becomes a kernel; `cudnn` where it cannot run is a
    `kernels.KernelError` naming the reason. `cpu_tuned=False`: a CPU device
    takes the accelerators' choice (`kernels.choose`)."""
    m = cfg.model
    device = jax.devices()[0] if device is None else device
    kernel = kernels.choose(m.attention, m.dtype, m.head_dim, m.seq_len, device, cpu_tuned)
    if kernel == "cudnn" and m.attention == "auto" and (cfg.parallel.cp > 1 or
                                                       stages_leave_axes(cfg.parallel)):
        # cuDNN gives no log-sum-exp to merge cp's parts by; its custom
        # partitioning fails in a pipeline's manual region that leaves tp to the partitioner
        kernel = "blockwise"
    block = kernels.choose_block(m.attention, m.attention_block, device, cpu_tuned)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, attention=kernel,
                                                              attention_block=block))


FLOAT64_NEEDS_X64 = ("model.dtype=float64 needs JAX's 64-bit types: call "
                     "jax.config.update('jax_enable_x64', True) before any array is made "
                     "(train.py does it for --float64); without it every float64 is float32")


def build_model(cfg, layout: Layout, seed: int = 0, device=None) -> Transformer:
    """The model of `cfg` on `layout`, its attention kernel resolved for
    `device`. Call under `jax.set_mesh` or inside eval_shape."""
    if cfg.model.dtype == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(FLOAT64_NEEDS_X64)
    cfg = resolve_attention(cfg, device)
    return Transformer(cfg.model, layout, rngs=nnx.Rngs(seed), schedule=Schedule.of(cfg, layout))


def abstract_model(cfg, mesh, layout: Layout | None = None):
    """(graphdef, abstract params) without allocating anything; `mesh` may
    have any axis types (it is retyped for the layout's impl, `Layout.on`)."""
    layout = Layout.of(cfg) if layout is None else layout
    mesh = layout.on(mesh)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: build_model(cfg, layout, device=mesh.devices.flat[0]))
    return nnx.split(model)
