"""What a run measures on its evaluation batches: the mean loss, and a
mixture of experts' router statistics for a metrics row."""

from __future__ import annotations

import jax
import numpy as np

from ..model.moe import STATS
from .data import to_mesh


def router_row(stats_fn, params, batches, mesh, cp_balance: bool, layers: int) -> dict:
    """A MoE model's router statistics on the evaluation batches, for a
    metrics row: the balance and z losses summed over the MoE layers (as the
    training loss adds them), the dropped share and each expert's share of
    the assignments averaged over the layers."""
    s = np.mean(jax.device_get([stats_fn(params, to_mesh(b, mesh, cp_balance))
                                for b in batches]), 0)
    n = len(STATS)
    return {"moe_balance": float(s[0]), "moe_z": float(s[1]),
            "moe_dropped": float(s[2]) / layers,
            "moe_load": [round(float(x) / layers, 6) for x in s[n:]]}


def evaluate(eval_step, params, batches, mesh, cp_balance: bool = True) -> float:
    losses = [eval_step(params, to_mesh(b, mesh, cp_balance)) for b in batches]
    return float(np.mean(jax.device_get(losses)))
