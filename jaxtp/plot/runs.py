"""Training runs overlaid: loss and eval loss against step and against
tokens, tokens/s and MFU per logged row, skipped steps marked. Each run's
legend entry names what its config changes from the others' (tp=8,
impl=shard_map, ...)."""

from __future__ import annotations

import json
from pathlib import Path

from ..config_keys import RENAMED
from . import pyplot, save


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """(flat config {"parallel.tp": 8, ...}, metrics rows) of a run directory."""
    run_dir = Path(run_dir)
    cfg_path, rows_path = run_dir / "config.json", run_dir / "metrics.jsonl"
    if not cfg_path.is_file() or not rows_path.is_file():
        raise ValueError(f"{run_dir}: not a training run (no config.json and metrics.jsonl)")
    cfg = json.loads(cfg_path.read_text())
    flat = {f"{sec}.{RENAMED.get(sec, {}).get(k, k)}": v for sec, d in cfg.items()
            for k, v in d.items()}  # (a key by its name now: runs saved before compare)
    rows = []
    for n, line in enumerate(rows_path.read_text().splitlines(), 1):
        try:
            rows += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"{rows_path}, line {n}: not a metrics row ({e.msg}); a line cut "
                             "by a kill or damaged: remove it, or plot the run after "
                             "train.py --resume repairs it") from None
    if not rows:
        raise ValueError(f"{run_dir}: metrics.jsonl has no rows yet")
    return flat, rows


def labels(configs: list[dict], names: list[str]) -> list[str]:
    """Per run, the config values that differ between the runs ("tp=8,
    impl=shard_map"); the directory name where none do."""
    keys = sorted(k for k in set().union(*configs)
                  if len({json.dumps(c.get(k)) for c in configs}) > 1)
    out = []
    for cfg, name in zip(configs, names):
        parts = [f"{k.split('.', 1)[1]}={cfg.get(k)}" for k in keys]
        out.append(", ".join(parts) if parts else name)
    return out if len(set(out)) == len(out) else [f"{n}: {o}" for n, o in zip(names, out)]


def plot_runs(run_dirs: list, out_dir=None) -> list[Path]:
    """runs.png / runs.svg in `out_dir` (default: the run itself when there is
    one, the current directory for several)."""
    plt = pyplot()
    runs = [read_run(Path(d)) for d in run_dirs]
    names = [Path(d).resolve().name for d in run_dirs]
    legend = labels([c for c, _ in runs], names)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (loss_ax, tok_ax), (speed_ax, mfu_ax) = axes
    any_mfu = False
    for (cfg, rows), label in zip(runs, legend):
        tokens = cfg["train.batch_size"] * cfg["model.seq_len"]
        steps = [r["step"] for r in rows if r.get("loss") is not None]
        loss = [r["loss"] for r in rows if r.get("loss") is not None]
        line, = loss_ax.plot(steps, loss, label=label)
        tok_ax.plot([s * tokens for s in steps], loss, color=line.get_color(), label=label)
        ev = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
        if ev:
            for ax, scale in ((loss_ax, 1), (tok_ax, tokens)):
                ax.plot([s * scale for s, _ in ev], [v for _, v in ev], "o--",
                        color=line.get_color(), markersize=4, label=f"{label} (eval)")
        skipped = [(r["step"], r["loss"] if r.get("loss") is not None else min(loss))
                   for r in rows if r.get("skipped")]
        if skipped:
            loss_ax.plot([s for s, _ in skipped], [v for _, v in skipped], "x",
                         color=line.get_color(), markersize=9, label=f"{label}: skipped steps")
        for ax, key, scale in ((speed_ax, "tokens_per_sec", 1), (mfu_ax, "mfu", 100)):
            pts = [(r["step"], scale * r[key]) for r in rows if r.get(key)]
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], ".-", color=line.get_color(),
                        label=label)
                any_mfu |= key == "mfu"
    loss_ax.set(xlabel="step", ylabel="loss", title="training loss (o: eval, x: skipped)")
    tok_ax.set(xlabel="tokens", ylabel="loss", title="loss against tokens seen")
    speed_ax.set(xlabel="step", ylabel="tokens/s", title="throughput per logged row")
    mfu_ax.set(xlabel="step", ylabel="MFU %", title="model FLOPs utilisation")
    if not any_mfu:
        mfu_ax.text(0.5, 0.5, "no MFU: the device's peak FLOPs are unknown\n(CPU; "
                    "train.py --peak-tflops sets one)", ha="center", va="center",
                    transform=mfu_ax.transAxes)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("  vs  ".join(legend) if len(legend) > 1 else legend[0])
    fig.tight_layout()
    if out_dir is None:
        out_dir = Path(run_dirs[0]) if len(run_dirs) == 1 else Path.cwd()
    paths = save(fig, out_dir, "runs")
    plt.close(fig)
    return paths
