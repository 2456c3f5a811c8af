"""Tensor-parallel regions: where the column -> row pair communicates."""

from __future__ import annotations

from .sharding import constrain


def tp_region(module, x_BTD):
    """Run `module.region` (replicated in -> partial out) and sum over tp.

    Under GSPMD the partitioner inserts f (backward all-reduce of dX) and g
    (forward all-reduce of the row-parallel output) itself; pinning the output
    replicated tells it where g goes.
    """
    return constrain(module.region(x_BTD), "batch", "seq", "embed")
