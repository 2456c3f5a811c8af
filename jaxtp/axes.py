"""The axis table: each parallel dimension once, outermost first (tp
innermost, on the fastest links), with what the rest of jaxtp asks of it.

A row says whether the axis splits the batch (the "batch" rule of
`jaxtp.parallel.layout.RULES`: outside a MoE layer's experts ep's ranks take
rows as dp's do, and outside the pipeline pp's stages do too), whether a
run's mesh has it only where its degree is above 1, how `--plan --<name> N`
sweeps it, and the words the run's first line gives it. `Layout` (its axes,
the batch rule), the checks, the planner, the run's lines and `--check`'s
one-device replay read this table instead of naming the axes; the config's
`parallel.<name>` degree and the `--<name>` flag carry the same name
(`tests/parallel/test_axes.py` holds them to it). A new axis is one row here
plus its own modules (its collectives, its ledger rows) and its check
(`jaxtp.axis_checks.CHECKS`, keyed by the same names).

Pure Python, beside `jaxtp.config` rather than in `jaxtp.parallel`: the config's
checks read it, and `jaxtp.parallel` imports the config.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

PP_AXIS = "pp"  # the axis pipeline parallelism splits the layers over
DATA_AXIS = "dp"  # the axis data parallelism splits the batch over
EP_AXIS = "ep"  # the axis a MoE layer's experts are split over (the batch too, as dp)
CP_AXIS = "cp"  # the axis context parallelism splits the sequence over
TP_AXIS = "tp"  # the axis tensor parallelism splits


@dataclasses.dataclass(frozen=True)
class Axis:
    name: str  # the mesh axis, `parallel.<name>` and `--<name>`
    splits_batch: bool
    optional: bool  # on a run's mesh only where its degree is above 1
    # how `--plan --<name> N` sweeps it (`jaxtp.analysis.plan.sweep_cases`):
    # "alone": 1, 2, 4, ... N at the one tp; "devices": ep x tp devices fixed,
    # tp taking what it leaves; None: the tp sweep's own axes
    sweep: str | None
    what: str  # what it splits, in a few words
    # cfg -> the words after `name=degree` on the run's first line
    note: Callable | None = None


def _pp_note(cfg) -> str:
    m, p = cfg.model, cfg.parallel
    per = m.n_layers // p.pp
    chunks = f" in {p.pp_repeats} chunks" if p.pp_repeats > 1 else ""
    return f" ({p.pp_schedule}, {per} layer{'s' if per > 1 else ''} per stage{chunks})"


def _cp_note(cfg) -> str:
    p = cfg.parallel
    return f" ({p.cp_attention}{', balanced' if p.cp_balance else ''})"


TABLE: tuple[Axis, ...] = (
    Axis(PP_AXIS, True, True, "alone", "the layers, in stages", _pp_note),
    Axis(DATA_AXIS, True, False, None, "the batch"),
    Axis(EP_AXIS, True, True, "devices", "a MoE layer's experts (and the batch)"),
    Axis(CP_AXIS, False, True, "alone", "the sequence", _cp_note),
    Axis(TP_AXIS, False, False, None, "the heads, the MLP and the vocabulary"),
)
AXES = tuple(a.name for a in TABLE)
AXIS = {a.name: a for a in TABLE}
OPTIONAL = frozenset(a.name for a in TABLE if a.optional)
BATCH = tuple(a.name for a in TABLE if a.splits_batch)


def mesh_words(degrees: dict[str, int], cfg=None) -> str:
    """A mesh as the log says it: the axes every mesh has always, the others
    where their degree is above 1, each with its note where `cfg` is given.

    >>> mesh_words({"pp": 2, "dp": 1, "ep": 1, "cp": 1, "tp": 4})
    'pp=2 x dp=1 x tp=4'
    """
    return " x ".join(
        f"{a.name}={degrees.get(a.name, 1)}"
        + (a.note(cfg) if cfg is not None and a.note is not None else "")
        for a in TABLE if degrees.get(a.name, 1) > 1 or not a.optional)
