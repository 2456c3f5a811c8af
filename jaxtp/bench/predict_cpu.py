"""The op-by-op predictor proven on this machine (`python -m jaxtp.bench
--only predict_cpu`): each round calibrates the op classes from
micro-benchmarks (`jaxtp.bench.calibrate`, which never run a layout), prices
every layout's compiled step with them (`jaxtp.analysis.price`, the code
that prices an H100) and times the steps, alternated; predicted / measured
per layout and round.

The fake CPU devices share the machine's cores: each calibration runs on as
many devices at once as the layout uses, so an op's measured time is the
time it takes while the other devices run theirs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import jax
import numpy as np

from ..analysis.price import price
from ..hlo_ops import program
from ..config import apply_overrides, load_config, validate
from .calibrate import calibrate
from .report import format_section, section
from .timing import build, time_alternating

# (name, preset, overrides): every axis, on 1 or 8 devices
LAYOUTS = (
    ("tiny tp=1", "tiny", ()),
    ("tiny tp=8", "tiny", ("parallel.tp=8",)),
    ("tiny dp=2 x tp=4", "tiny", ("parallel.dp=2", "parallel.tp=4")),
    ("tiny cp=2 x tp=4", "tiny", ("parallel.cp=2", "parallel.tp=4")),
    ("tiny pp=2 x tp=4, M=2", "tiny", ("parallel.pp=2", "parallel.tp=4",
                                       "train.microbatches=2")),
    ("llama-tiny tp=1", "llama-tiny", ()),
    ("llama-tiny dp=2 x tp=4", "llama-tiny", ("parallel.dp=2", "parallel.tp=4")),
    ("moe-tiny tp=1", "moe-tiny", ()),
    ("moe-tiny ep=4 x tp=2", "moe-tiny", ("parallel.ep=4", "parallel.tp=2")),
)


def predicted_vs_measured(layouts=LAYOUTS, rounds: int = 5, steps: int = 2,
                          quick: bool = False, log=print) -> list[dict]:
    """Per layout: predicted and measured seconds a step in each round."""
    runs = [build(name, validate(apply_overrides(load_config(p), list(ov))))
            for name, p, ov in layouts]
    texts = {r.name: r.step.as_text() for r in runs}
    rows = {r.name: {"layout": r.name, "devices": r.mesh.size, "predicted": [],
                     "measured": []} for r in runs}
    wanted = {n: collectives_in([texts[r.name] for r in runs if r.mesh.size == n])
              for n in {r.mesh.size for r in runs}}
    for i in range(rounds):
        log(f"round {i + 1}/{rounds}")
        costs = {n: calibrate(n, reps=3 if quick else 5, quick=quick, log=log,
                              collectives=wanted[n]) for n in sorted(wanted)}
        times = time_alternating(runs, 1, steps)
        for r in runs:
            p = price(texts[r.name], costs[r.mesh.size], dict(r.mesh.shape))
            rows[r.name]["predicted"].append(p["step_s"])
            rows[r.name]["measured"].append(statistics.median(times[r.name]))
            rows[r.name]["comm_s"] = p["comm_s"]
    out = list(rows.values())
    for row in out:
        ratios = np.asarray(row["predicted"]) / np.asarray(row["measured"])
        row |= {"predicted_ms": 1e3 * statistics.median(row["predicted"]),
                "measured_ms": 1e3 * statistics.median(row["measured"]),
                "ratio": float(np.median(ratios)), "ratio_min": float(ratios.min()),
                "ratio_max": float(ratios.max())}
    return out


def collectives_in(texts) -> set[str]:
    """The "kind/group" of every collective the programs run: the ones to calibrate."""
    out = set()
    for text in texts:
        for ops in program(text)[0].values():
            out |= {f"{o.kind}/{o.group}" for o in ops if o.cls in ("collective", "start")}
    return out


def calibrate_here(out: str, rounds: int = 2, log=print) -> list[dict]:
    """`--plan --calibrate`: this machine's costs on 1 device and on all at
    once, written to OUT/costs-<n>.json; then the layouts that fit its
    devices, predicted against measured (`predicted_vs_measured`)."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    for n in sorted({1, jax.device_count()}):
        (path / f"costs-{n}.json").write_text(calibrate(n, log=log).to_json() + "\n")
        log(f"wrote {path / f'costs-{n}.json'}")
    layouts = [x for x in LAYOUTS if _devices(x) <= jax.device_count()]
    rows = predicted_vs_measured(layouts, rounds=rounds, log=log)
    log(format_section(_section(rows, rounds)))
    return rows


def _devices(layout) -> int:
    return validate(apply_overrides(load_config(layout[1]), list(layout[2]))).parallel.devices


def bench_predict_cpu(rounds: int = 5, log=print, quick: bool = False) -> dict:
    """`quick`: tiny at tp 1 and 8 alone, a quick calibration."""
    layouts = LAYOUTS[:2] if quick else LAYOUTS
    layouts = [x for x in layouts if _devices(x) <= jax.device_count()]
    return _section(predicted_vs_measured(layouts, rounds=rounds, quick=quick, log=log),
                    rounds)


def _section(rows: list[dict], rounds: int) -> dict:
    err = [abs(r["ratio"] - 1) for r in rows]
    return section("predict_cpu", "Op-by-op prediction against measured CPU steps", [
        ("layout", "layout"), ("devices", "fake devices"),
        ("predicted_ms", "predicted (ms a step)"), ("measured_ms", "measured (ms a step)"),
        ("ratio", "predicted / measured (median of rounds)"), ("ratio_min", "min"),
        ("ratio_max", "max")], rows, [
        f"mean |error| {np.mean(err):.1%}, max {np.max(err):.1%} over {len(rows)} layouts, "
        f"{rounds} rounds; each round calibrates anew, then times the steps alternated",
        "calibration: jaxtp.bench.calibrate's micro-benchmarks on 1 and on 8 devices at once "
        "(matmuls in three orientations, four memory-bound classes, loops, dispatch, each "
        "collective kind by group and size); no layout's step is run for it",
        "prediction: jaxtp.analysis.price over the compiled step's HLO; XLA:CPU's "
        "collectives are synchronous, so charged whole"])
