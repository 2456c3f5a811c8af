"""How a batch of token windows is placed on the mesh: [B, T+1] split over
dp, or on a mesh with a cp axis inputs and targets apart, [B, 2, T], their
sequence reordered once for the causal load balance (`jaxtp.parallel.layout.cp_order`) and split
over cp."""

from __future__ import annotations

import numpy as np
from jax.sharding import NamedSharding

from .layout import CP_AXIS, cp_order, named


def batch_shape(B: int, T: int, mesh) -> tuple[int, ...]:
    """A placed batch of B windows of T+1 tokens: [B, T+1], or on a mesh
    with a cp axis [B, 2, T] (inputs and targets apart, so that no shift
    crosses a cp chunk's edge: `cp_batch`)."""
    return (B, 2, T) if CP_AXIS in mesh.axis_names else (B, T + 1)


def batch_sharding(mesh) -> NamedSharding:
    """How a batch (`batch_shape`) is placed, by `RULES`: its rows as
    "batch" (over dp), and under cp its T as "seq"."""
    if CP_AXIS in mesh.axis_names:
        return named(mesh, "batch", None, "seq")
    return named(mesh, "batch", None)


def sequence_split(mesh) -> int:
    """How many ranks `mesh` splits a sequence over (its cp degree; 1: whole)."""
    return dict(mesh.shape).get(CP_AXIS, 1)


def cp_batch(windows_BT1: np.ndarray, cp: int, balance: bool) -> np.ndarray:
    """Host windows [B, T+1] -> [B, 2, T]: inputs and targets, each reordered
    along T by `cp_order` (once, when a batch is placed)."""
    order = cp_order(windows_BT1.shape[1] - 1, cp, balance)
    return np.stack([windows_BT1[:, :-1], windows_BT1[:, 1:]], 1)[:, :, order]


def inputs_targets(batch):
    """(inputs [B, T], targets [B, T]) of a placed batch (`batch_shape`)."""
    if batch.ndim == 3:
        return batch[:, 0], batch[:, 1]
    return batch[:, :-1], batch[:, 1:]
