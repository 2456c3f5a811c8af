"""Figures of a benchmark report (`python -m jaxtp.bench --out DIR`): step
time against tp with and without SP per impl, collective bus bandwidth
against payload size per op and dtype, compile time against depth. Each
figure names the machine and date it was measured on."""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import pyplot, save

FIGURES = ("scaling", "collectives", "compile")


def read_bench(bench_dir: Path) -> dict:
    path = Path(bench_dir) / "bench.json"
    if not path.is_file():
        raise ValueError(f"{bench_dir}: no bench.json (write one with "
                         "`python -m jaxtp.bench --out DIR`)")
    return json.loads(path.read_text())


def _scaling(ax, rows):
    groups = {}
    for r in rows:
        preset = r["case"].split()[0]
        groups.setdefault((preset, r["impl"], r["sp"]), []).append((r["tp"], r["step_ms"]))
    for (preset, impl, sp), pts in sorted(groups.items()):
        pts.sort()
        ax.plot([t for t, _ in pts], [v for _, v in pts], "o-" if sp else "s--",
                label=f"{preset} {impl}, SP {'on' if sp else 'off'}")
    ax.set(xscale="log", xlabel="tp", ylabel="step time, ms (median)",
           title="train step time against tp")
    ax.set_xticks(sorted({r["tp"] for r in rows}), labels=sorted({r["tp"] for r in rows}))


def _collectives(ax, rows):
    groups = {}
    for r in rows:
        groups.setdefault((r["op"], r["dtype"], r["ranks"]), []).append(
            (r["bytes"], r["busbw_GBps"]))
    for (op, dtype, ranks), pts in sorted(groups.items()):
        pts.sort()
        ax.plot([b / 2**20 for b, _ in pts], [v for _, v in pts], "o-",
                label=f"{op} {dtype} over {ranks}")
    ax.set(xscale="log", xlabel="payload, MiB", ylabel="bus bandwidth, GB/s",
           title="collective bus bandwidth against payload")


def _compile(ax, rows):
    groups = {}
    for r in rows:
        depth = int(re.search(r"L=(\d+)", r["case"]).group(1))
        kind = "scanned" if "unscanned" not in r["case"] else "unscanned"
        groups.setdefault(kind, []).append((depth, r["compile_s"]))
    for kind, pts in sorted(groups.items()):
        pts.sort()
        ax.plot([d for d, _ in pts], [v for _, v in pts], "o-", label=kind)
    ax.set(xlabel="layers", ylabel="trace + compile, s", title="compile time against depth")


DRAW = {"scaling": _scaling, "collectives": _collectives, "compile": _compile}


def plot_bench(bench_dir, out_dir=None, log=print) -> list[Path]:
    """bench_<section>.png / .svg for each of FIGURES the report holds."""
    plt = pyplot()
    report = read_bench(bench_dir)
    meta = report["meta"]
    sections = {s["id"]: s for s in report["sections"]}
    where = (f"{meta['machine']}; {meta['device_count']} x {meta['device_kind']}"
             f"{' (fake devices)' if meta.get('fake_devices') else ''}; {meta['date']}; "
             f"jax {meta['versions'].get('jax', '?')}, mode {meta['mode']}")
    paths = []
    for sid in FIGURES:
        if sid not in sections or not sections[sid]["rows"]:
            log(f"bench: no {sid} section in {bench_dir}/bench.json: not drawn")
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        DRAW[sid](ax, sections[sid]["rows"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.suptitle(f"measured on {where}", fontsize=8)
        fig.tight_layout()
        paths += save(fig, out_dir or bench_dir, f"bench_{sid}")
        plt.close(fig)
    return paths
