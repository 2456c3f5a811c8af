"""Where a train step's time goes, by kind of work, from a `jax.profiler` trace.

Each executed XLA op of the step (its events carry `hlo_op`) is put in one
category by reading the compiled HLO: its opcode, the ops of the fusion it
calls, and the `op_name` JAX wrote into its metadata (`jvp(...)`: forward,
`transpose(jvp(...))`: backward, neither: the optimizer; jaxtp's named
scopes `attention`, `mlp`, `cross_entropy`, `embed`; the norms and residual
adds carry no scope). The suite's `cpu_profile` section prints the shares
for the tiny step at tp=1 and tp=8 (`python -m jaxtp.bench --only cpu_profile`).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from .. import hlo
from .collectives import collective_names, op_events, trace
from .report import section

CATEGORIES = ("matmuls", "attention: mask, softmax and its backward", "norms, residual adds",
              "MLP: bias, GELU", "embedding, loss", "optimizer update", "copies, transposes",
              "collectives", "other")
_MOVES = {"parameter", "copy", "transpose", "bitcast", "reshape", "broadcast", "tuple",
          "get-tuple-element", "slice", "concatenate", "pad"}


def _ops(comps: dict, comp: str, depth: int = 0) -> set[str]:
    out = set()
    for _, _, opcode, rest in comps.get(comp, []):
        out.add(opcode)
        if depth < 3:
            for called in re.findall(r"calls=%?([\w.\-]+)", rest):
                out |= _ops(comps, called, depth + 1)
    return out


def categories(hlo_text: str) -> dict[str, str]:
    """{instruction name: category} for every instruction of compiled HLO text."""
    comps, _ = hlo._parse(hlo_text)
    colls = collective_names(hlo_text)
    out = {}
    for instrs in comps.values():
        for name, _, opcode, rest in instrs:
            calls = re.findall(r"calls=%?([\w.\-]+)", rest)
            inner = set().union(*(_ops(comps, c) for c in calls)) if calls else set()
            kind = re.search(r'"kind":"([^"]*)"', rest)
            op_name = (re.search(r'op_name="([^"]*)"', rest) or [None, ""])[1]
            if name in colls:
                cat = "collectives"
            elif {"dot", "convolution"} & ({opcode} | inner) or (
                    kind and re.search("xnn|ynn|onednn", kind[1])):
                cat = "matmuls"
            elif opcode in _MOVES or (inner and inner <= _MOVES):
                cat = "copies, transposes"
            elif "jvp(" not in op_name:
                cat = "optimizer update" if op_name else "other"
            elif re.search(r"[/(]attention[/)]", op_name):
                cat = "attention: mask, softmax and its backward"
            elif re.search(r"[/(]mlp[/)]", op_name):
                cat = "MLP: bias, GELU"
            elif re.search(r"[/(](cross_entropy|embed|jit\(_take\))[/)]", op_name):
                cat = "embedding, loss"
            else:
                cat = "norms, residual adds"
            out[name] = cat
    return out


def breakdown(run_step, hlo_text: str, steps: int = 2) -> dict:
    """{"ms": {category: ms per step, summed over devices}, "share": {category:
    fraction}, "ops_ms": total}, from a trace of `steps` calls of the step
    whose compiled text is `hlo_text` (the trace's busiest module)."""
    data = trace(run_step, steps)
    if data is None:
        return {"ms": {}, "share": {}, "ops_ms": 0.0}
    by_module = defaultdict(Counter)
    for _, _, e, st in op_events(data):
        by_module[st.get("hlo_module")][str(st["hlo_op"])] += e.duration_ns
    ops = max(by_module.values(), key=lambda c: sum(c.values()))
    cats = categories(hlo_text)
    ms = Counter()
    for op, ns in ops.items():
        ms[cats.get(op, "other")] += ns / 1e6 / steps
    total = sum(ms.values())
    return {"ms": dict(ms), "share": {k: v / total for k, v in ms.items()}, "ops_ms": total}


def bench_cpu_profile(cases: list[tuple[str, object]], steps: int = 2) -> dict:
    """The section: for each (case name, built step), each category's ms per
    step and share of the op time."""
    rows = []
    for case, run in cases:
        run()  # compiled and warm
        b = breakdown(run, run.step.as_text(), steps)
        for cat in sorted(b["ms"], key=b["ms"].get, reverse=True):
            rows.append({"case": case, "measured": cat, "value": 100 * b["share"][cat],
                         "unit": "%", "ms": b["ms"][cat], "ops_ms": b["ops_ms"]})
    return section("cpu_profile", "Where the train step's time goes, by kind of work", [
        ("case", "case"), ("measured", "category"), ("value", "share"), ("unit", "unit"),
        ("ms", "ms per step"), ("ops_ms", "all ops ms")], rows, [
        "XLA's per-op durations from a jax.profiler trace of 2 steps, summed over devices "
        "(at tp=8 the 8 fake devices' ops run concurrently on the cores: ops ms exceeds "
        "the step's wall time); each op's category read from the compiled HLO "
        "(jaxtp.bench.cpu_profile): a fusion holding a dot is a matmul",
        "forward and backward together; the norms' and residual adds' ops carry no "
        "named scope"])
