"""The matmuls of compiled HLO text and their FLOPs at the loops' trip
counts (`cost_analysis` counts a loop body once on CPU): what a pipeline
schedule's compiled work is read from (`jaxtp.analysis.pp.block_flops`)."""

from __future__ import annotations

import dataclasses

from .hlo import _OpNames, _parse, pass_of, scope_of
from .hlo_ops import executed, program


@dataclasses.dataclass(frozen=True)
class Dot:
    """One `dot` of compiled HLO: its FLOPs (2 x the result's elements x the
    contracted size) times the runs of its computation per call (loops at
    their trip counts; `cost_analysis` counts a loop body once)."""

    op_name: str
    flops: int  # per call of the function, trip counts applied

    @property
    def scope(self) -> str:
        return scope_of(self.op_name)

    @property
    def pass_(self) -> str:
        return pass_of(self.op_name)


def dots(text: str) -> list[Dot]:
    """Every matmul of compiled HLO text that runs (a `dot`, a fusion of
    dots, a cuBLAS call: `jaxtp.hlo_ops`), with its dots' FLOPs at its
    runs per call, in program order."""
    comps, entry = program(text)
    if entry is None:
        return []
    ran = [(op, m) for op, m in executed(comps, entry) if op.dot_flops]
    names = _OpNames(_parse(text)[0]) if any(not op.op_name for op, _ in ran) else None
    return [Dot(op.op_name or names.inherited(op.name), int(op.dot_flops) * m) for op, m in ran]
