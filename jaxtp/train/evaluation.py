"""What a run measures on its evaluation batches: the mean loss, and a
mixture of experts' router statistics for a metrics row."""

from __future__ import annotations

import jax
import numpy as np

from ..model.moe import STATS
from .data import to_mesh


def router_row(stats_fn, params, batches, mesh, cp_balance: bool, layers: int) -> dict:
    """A MoE model's router statistics on the evaluation batches, for a
    metrics row: the balance and z losses summed over the `layers` MoE
    layers (as the training loss adds them), the dropped share and each
    expert's share of the assignments averaged over them; and where the
    statistics come per layer (`hidden_and_stats`) `load_rows` of them."""
    s = np.mean(jax.device_get([stats_fn(params, to_mesh(b, mesh, cp_balance))
                                for b in batches]), 0)
    n = len(STATS)
    total = s.sum(0) if s.ndim == 2 else s
    row = {"moe_balance": float(total[0]), "moe_z": float(total[1]),
           "moe_dropped": float(total[2]) / layers,
           "moe_load": [round(float(x) / layers, 6) for x in total[n:]]}
    return row | (load_rows(s[:, n:], s[:, 2]) if s.ndim == 2 else {})


def load_rows(load_LE, dropped_L) -> dict:
    """Per MoE layer: each expert's share of the assignments [L][E], the
    dropped share, the max violation (max - mean) / mean of the experts'
    loads (0 when balanced; Wang et al. 2024, the loss-free balance paper's
    MaxVio, arXiv 2408.15664), the dead experts (none assigned); the largest
    violation of any layer."""
    load_LE = np.asarray(load_LE, np.float64)
    mean = load_LE.mean(1)
    violation = (load_LE.max(1) - mean) / np.maximum(mean, 1e-30)
    return {"moe_layer_load": [[round(float(x), 6) for x in r] for r in load_LE],
            "moe_layer_dropped": [round(float(x), 6) for x in dropped_L],
            "moe_layer_violation": [round(float(x), 6) for x in violation],
            "moe_layer_dead": [int(x) for x in (load_LE == 0).sum(1)],
            "moe_max_violation": round(float(violation.max()), 6)}


def evaluate(eval_step, params, batches, mesh, cp_balance: bool = True) -> float:
    losses = [eval_step(params, to_mesh(b, mesh, cp_balance)) for b in batches]
    return float(np.mean(jax.device_get(losses)))
