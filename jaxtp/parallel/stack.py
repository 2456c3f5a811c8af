"""The one place the model's stack of blocks runs: as its `Schedule` says, a
Python loop over a list of blocks, a scan over their stacked parameters, or
a pipeline over the pp axis (GPipe, circular: `jaxtp.parallel.pipeline`;
1F1B, which runs the head too: `jaxtp.parallel.pipeline_1f1b`).

The model hands over one layer, `layer(block, (x, aux), key) -> (x, aux)`,
where `aux` is what the blocks add up beside the stream (a MoE layer's router
statistics; None for a dense model), and never names a schedule or a mesh
axis. The impl (`Layout.impl`) decides only how tp runs inside a block.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .collectives import vary
from .layout import PP_AXIS, Layout
from .pipeline import pipeline
from .pipeline_1f1b import pipeline_1f1b
from .schedule import Schedule


def scan_layers(schedule: Schedule, layer: Callable, blocks, carry, keys_L=None):
    """`layer` over the stacked `blocks` in order, by a loop over their
    leading layer axis (so compile time and HLO size do not grow with depth:
    `jaxtp.hlo` multiplies by the trip count). `keys_L`: per-layer dropout
    keys, or None."""
    xs = () if keys_L is None else (keys_L,)

    @nnx.scan(in_axes=(nnx.Carry, 0) + (0,) * len(xs), out_axes=nnx.Carry,
              transform_metadata={nnx.PARTITION_NAME: schedule.stack_axis})
    def body(carry, block, *key):
        return layer(block, carry, key[0] if key else None)

    return body(carry, blocks, *xs)


def _stage(schedule: Schedule, layer: Callable, aux):
    """A pipeline stage's run of its chunk of layers: x -> x, or (x, the
    chunk's own `aux`, from zeros varying over pp) where there is one."""
    if aux is None:
        return lambda blocks, x: scan_layers(schedule, layer, blocks, (x, None))[0]
    zeros = lambda: vary(jnp.zeros(aux.shape, aux.dtype), {PP_AXIS})
    return lambda blocks, x: scan_layers(schedule, layer, blocks, (x, zeros()))


def _units(layer: Callable, aux):
    """(enter(x) -> carry, unit(module, carry) -> carry): `_stage`'s run as a
    loop of units, for a pipeline that differentiates unit by unit."""
    if aux is None:
        return (lambda x: x), (lambda unit, x: layer(unit, (x, None), None)[0])
    zeros = lambda: vary(jnp.zeros(aux.shape, aux.dtype), {PP_AXIS})
    return (lambda x: (x, zeros())), (lambda unit, c: layer(unit, c, None))


def stack(schedule: Schedule, layout: Layout, layer: Callable, blocks, x_BTD, aux=None,
          keys_L=None):
    """(x, aux) after every block on `x_BTD` [B, T, D]: `aux` plus what the
    blocks add (under a pipeline, the stages' sums averaged over the
    microbatches, as M slices of the batch would give them). `keys_L`:
    per-layer dropout keys (none under a pipeline)."""
    if schedule.stages > 1:
        n = 0 if aux is None else aux.shape[0]
        out = pipeline(_stage(schedule, layer, aux), blocks, x_BTD, layout, schedule, n_stats=n)
        return (out, None) if aux is None else (out[0], aux + out[1])
    if schedule.stacked:
        return scan_layers(schedule, layer, blocks, (x_BTD, aux), keys_L)
    for i, block in enumerate(blocks):
        x_BTD, aux = layer(block, (x_BTD, aux), None if keys_L is None else keys_L[i])
    return x_BTD, aux


def stack_loss(schedule: Schedule, layout: Layout, layer: Callable, blocks, head: Callable,
               head_modules, x_BTD, targets_BT, aux=None, weights: np.ndarray | None = None):
    """The mean loss where the schedule runs the head inside the stack
    (`Schedule.runs_head`: 1F1B): `head(head_modules, y, targets)`, a
    microbatch's summed token losses, after the blocks; where the blocks
    add an `aux` (zeros of its shape), plus `weights` . its mean over the
    microbatches, summed over the stages."""
    return pipeline_1f1b(_stage(schedule, layer, aux), head, blocks, head_modules, x_BTD,
                         targets_BT, layout, schedule, weights, _units(layer, aux))
