"""The matmuls of compiled HLO text and their FLOPs at the loops' trip
counts (`cost_analysis` counts a loop body once on CPU): what a pipeline
schedule's compiled work is read from (`jaxtp.analysis.pp.block_flops`)."""

from __future__ import annotations

import dataclasses
import math
import re

from .hlo import _OP_NAME, _arrays, _multipliers, _OpNames, _parse, pass_of, scope_of


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


_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def dots(text: str) -> list[Dot]:
    """Every `dot` in compiled HLO text (XLA:CPU's; a GPU's cuBLAS calls are
    custom calls, not read here), in program order."""
    comps, entry = _parse(text)
    if entry is None:
        return []
    mult, names, out = _multipliers(comps, entry), _OpNames(comps), []
    for comp, instrs in comps.items():
        count = mult.get(comp, 0)
        shapes = {name: _arrays(type_text) for name, type_text, _, _ in instrs}
        for name, type_text, opcode, rest in instrs:
            if opcode != "dot" or not count:
                continue
            lhs = re.match(r"\s*(?:[a-z]\w*\[[\d,]*\]\S*\s+)?%?([\w.\-]+)", rest)
            (_, result), = _arrays(type_text)
            (_, lhs_shape), = shapes[lhs.group(1)] if lhs.group(1) in shapes else \
                _arrays(rest.split("%")[0])
            dims = _CONTRACTING.search(rest).group(1)
            contracted = math.prod(lhs_shape[int(d)] for d in dims.split(",") if d)
            op = _OP_NAME.search(rest)
            out.append(Dot(op.group(1) if op else names.inherited(name),
                           2 * math.prod(result) * contracted * count))
    return out
