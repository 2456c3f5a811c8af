"""A mixture of experts' load over a run (the rows' `moe_layer_*`, logged at
every row from the evaluation batches, `jaxtp.train.evaluation.load_rows`):
each MoE layer's experts' load as a heat map at the first and last row, and
each layer's max violation against steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import pyplot, save
from .runs import read_run


def has_loads(run_dir) -> bool:
    """Whether a run logged per-layer expert loads."""
    return any(r.get("moe_layer_load") for r in read_run(Path(run_dir))[1])


def plot_experts(run_dir, out_dir=None) -> list[Path]:
    """experts.png / experts.svg in `out_dir` (default: the run)."""
    _, rows = read_run(Path(run_dir))
    rows = [r for r in rows if r.get("moe_layer_load")]
    if not rows:
        raise ValueError(f"{run_dir}: no per-layer expert loads in metrics.jsonl (a dense "
                         "model, a run under --pp, or one logged before they were)")
    plt = pyplot()
    first, last = (np.asarray(r["moe_layer_load"]) for r in (rows[0], rows[-1]))
    E = first.shape[1]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    top = max(first.max(), last.max()) * E
    for ax, load, row in ((axes[0], first, rows[0]), (axes[1], last, rows[-1])):
        im = ax.imshow(load * E, cmap="magma", vmin=0, vmax=top, aspect="auto")
        ax.set(xlabel="expert", ylabel="MoE layer",
               title=f"step {row['step']}: load x experts (1 = balanced)",
               xticks=range(E), yticks=range(load.shape[0]))
        dead = np.argwhere(load == 0)
        ax.plot(dead[:, 1], dead[:, 0], "x", color="cyan", markersize=10)
    fig.colorbar(im, ax=axes[:2], shrink=0.8)
    steps = [r["step"] for r in rows]
    violation = np.asarray([r["moe_layer_violation"] for r in rows])
    for layer in range(violation.shape[1]):
        axes[2].plot(steps, violation[:, layer], ".-", label=f"MoE layer {layer}")
    axes[2].set(xlabel="step", ylabel="(max - mean) / mean",
                title="max violation per layer (x on the maps: dead experts)")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    paths = save(fig, Path(run_dir) if out_dir is None else out_dir, "experts")
    plt.close(fig)
    return paths
