"""Every op of a compiled (optimized, scheduled) HLO module, with what it
computes and moves: the input of the op-by-op step price
(`jaxtp.analysis.price`).

`program(text)` reads each computation's instructions in schedule order (a
scheduled module prints them in the order they run) into `Op`s:

- matmul: a dot, a fusion holding dots (XLA:GPU's Triton and cuBLAS gemm
  fusions), a cuBLAS custom call; flops 2 x output elements x contracted
  elements, bytes its operands and result;
- attention: cuDNN's fused attention (`__cudnn$fmha*`); flops those of its
  two matmuls, 4 * B * H * Sq * Sk * D, x 2.5 for the backward's five
  (Dao 2023, FlashAttention-2, Sec. 4: the backward is 2.5 forwards), half
  of both under a causal mask;
- memory: any other fusion or op that runs (a copy, a reduce, a scatter),
  bytes read and written: an operand read only through slices counts the
  slices, a dynamic-update-slice writes its update in place;
- collective (sync), start and done (an async pair), with the full buffer's
  bytes (as `jaxtp.hlo`: a reduce-scatter's input) and device groups;
- loop (a while: its body and condition, `trip` times), call and
  conditional (the computations they run);
- free: parameters, tuples, bitcasts, constants.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from .groups import replica_groups
from .hlo import _BRANCHES, _CALLS, _NUM_PARTITIONS, _OP_NAME, _TRIP, DTYPE_BYTES, \
    KINDS, _arrays, _loop_bound, _parse

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
        "replica-id", "after-all", "opt-barrier", "add-dependency", "iota"}
SLICES = {"slice", "dynamic-slice", "gather"}
# a memory-bound op's class, by the first of these its ops hold (priced by
# the class's rate: on a CPU a tanh or a transpose moves bytes far slower)
MEMORY_CLASSES = (("transcendental", {"tanh", "exponential", "log", "rsqrt", "sqrt", "logistic",
                                      "erf", "power", "exponential-minus-one", "log-plus-one",
                                      "sine", "cosine", "atan2", "cbrt"}),
                  ("transpose", {"transpose", "copy", "gather", "scatter", "sort"}),
                  ("reduce", {"reduce", "reduce-window", "select-and-scatter"}))
# elementwise ops XLA's cost analysis counts one flop an element (its
# transcendentals it counts apart, as here: not flops)
ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
               "compare", "select", "clamp", "convert", "and", "or", "xor", "not", "sign",
               "floor", "ceil", "round-nearest-even", "remainder"}
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_DIMS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CUBLAS_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_ATTN_SHAPE = re.compile(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]')


@dataclasses.dataclass
class Op:
    """One instruction as it runs, per call of its computation."""

    name: str
    opcode: str
    cls: str  # matmul | attention | memory | collective | start | done | loop | call | free
    flops: float = 0.0
    dot_flops: float = 0.0  # of `flops`, its matmuls'
    bytes: float = 0.0
    dtype: str = ""
    seq: int = 0  # attention: the key length
    kind: str = ""  # a collective's kind
    groups: tuple | None = None
    calls: tuple[str, ...] = ()
    trip: int = 1
    src: str = ""  # a done: its start
    op_name: str = ""
    sync: bool = False  # an async collective XLA runs on the compute stream
    mem: str = "elementwise"  # a memory-bound op's class (`MEMORY_CLASSES`)

    @property
    def group(self) -> int:
        """Devices in one of its groups (a permute: its pairs)."""
        if not self.groups:
            return 1
        return len(self.groups) if self.kind == "collective-permute" else len(self.groups[0])


def nbytes(type_text: str) -> int:
    return sum(math.prod(s) * DTYPE_BYTES.get(dt, 0) for dt, s in _arrays(type_text))


def operands(rest: str) -> list[str]:
    """Operand names of an instruction (`rest`: its text after "opcode(")."""
    return re.findall(r"%([\w.\-]+)", rest.split(")")[0])


def _dot_flops(rest: str, type_text: str, types: dict) -> tuple[float, str]:
    lhs = operands(rest)[0]
    lhs_arrays = _arrays(types.get(lhs, ""))
    dims = _DIMS.search(rest)
    if not lhs_arrays:
        return 0.0, ""
    dtype, shape = lhs_arrays[0]
    k = math.prod(shape[int(d)] for d in dims.group(1).split(",") if d) if dims else 1
    out = sum(math.prod(s) for _, s in _arrays(type_text))
    return 2.0 * out * k, dtype


class _Reader:
    """Reads ops out of parsed computations (`jaxtp.hlo._parse`)."""

    def __init__(self, comps: dict, num_partitions: int | None):
        self.comps, self.np = comps, num_partitions
        self.types = {c: {n: t for n, t, _, _ in instrs} for c, instrs in comps.items()}

    def opcodes(self, callee: str, depth: int = 0) -> set[str]:
        out = set()
        for _, _, opcode, rest in self.comps.get(callee, []):
            out.add(opcode)
            m = re.search(r"calls=%?([\w.\-]+)", rest) if depth < 3 else None
            if m:
                out |= self.opcodes(m.group(1), depth + 1)
        return out

    def fused(self, callee: str) -> tuple[float, float, str]:
        """(its dots' flops, its elementwise ops' flops, the dots' dtype) of
        a fused computation."""
        dots, elementwise, dtype = 0.0, 0.0, ""
        for _, t, opcode, rest in self.comps.get(callee, []):
            if opcode in ELEMENTWISE or opcode == "reduce":
                elementwise += sum(math.prod(s) for _, s in _arrays(
                    t if opcode != "reduce" else self.types[callee].get(operands(rest)[0], "")))
            elif opcode in ("dot", "convolution"):
                f, dt = _dot_flops(rest, t, self.types[callee])
                dots, dtype = dots + f, dtype or dt
            elif opcode == "fusion":  # a nested gemm fusion
                m = re.search(r"calls=%?([\w.\-]+)", rest)
                if m:
                    d, e, dt = self.fused(m.group(1))
                    dots, elementwise, dtype = dots + d, elementwise + e, dtype or dt
        return dots, elementwise, dtype

    def fusion_bytes(self, comp: str, type_text: str, rest: str, callee: str) -> float:
        """Bytes a fusion reads and writes: operands read through slices
        only count the slices; a dynamic-update-slice root writes its update."""
        instrs = self.comps.get(callee, [])
        params, users, by_name = {}, {}, {}
        for n, t, opcode, r in instrs:
            by_name[n] = (t, opcode, r)
            if opcode == "parameter":
                params[int(r.split(")")[0])] = n
            for o in operands(r):
                users.setdefault(o, []).append(n)
        root = instrs[-1] if instrs else None
        out = nbytes(type_text)
        in_place = None
        if root is not None and root[2] == "dynamic-update-slice":
            ops = operands(root[3])
            in_place = ops[0]
            out = nbytes(self.types[callee].get(ops[1], ""))
        total = out
        types = self.types[comp]
        for i, name in enumerate(operands(rest)):
            p = params.get(i)
            if p is not None and p == in_place:
                continue
            us = users.get(p, []) if p else []
            if us and all(by_name[u][1] in SLICES for u in us):
                total += sum(nbytes(by_name[u][0]) for u in us)
            else:
                total += nbytes(types.get(name, ""))
        return float(total)

    def op(self, comp: str, name: str, type_text: str, opcode: str, rest: str) -> Op:
        m = _OP_NAME.search(rest)
        op = Op(name, opcode, "memory", op_name=m.group(1) if m else "")
        base = opcode.removesuffix("-start").removesuffix("-done")
        if opcode in FREE:
            op.cls = "free"
        elif base in KINDS or opcode in ("async-start", "async-done"):
            self._collective(op, base, type_text, rest)
        elif opcode == "while":
            found = dict(_CALLS.findall(rest))
            trip = _TRIP.search(rest)
            op.cls, op.calls = "loop", (found.get("condition", ""), found.get("body", ""))
            op.trip = int(trip.group(1)) if trip else _loop_bound(self.comps.get(op.calls[0], []))
        elif opcode in ("call", "conditional"):
            op.cls = "call"
            op.calls = tuple(c for k, c in _CALLS.findall(rest) if k != "to_apply"
                             or opcode == "call")
            for group in _BRANCHES.findall(rest):
                op.calls += tuple(c.strip().lstrip("%") for c in group.split(","))
        elif opcode in ("dot", "convolution"):
            op.cls = "matmul"
            op.flops, op.dtype = _dot_flops(rest, type_text, self.types[comp])
            op.dot_flops = op.flops
            op.bytes = nbytes(type_text) + sum(nbytes(self.types[comp].get(o, ""))
                                               for o in operands(rest))
        elif opcode == "fusion":
            callee = re.search(r"calls=%?([\w.\-]+)", rest).group(1)
            dots, elementwise, dtype = self.fused(callee)
            op.bytes = self.fusion_bytes(comp, type_text, rest, callee)
            op.flops, op.dot_flops = dots + elementwise, dots
            if dtype:
                op.cls, op.dtype = "matmul", dtype
            op.mem = memory_class(self.opcodes(callee))
        elif opcode == "custom-call":
            self._custom(op, comp, type_text, rest)
        else:
            op.bytes = float(nbytes(type_text) + sum(nbytes(self.types[comp].get(o, ""))
                                                     for o in operands(rest)))
            op.mem = memory_class({opcode})
            if opcode in ELEMENTWISE:
                op.flops = float(sum(math.prod(s) for _, s in _arrays(type_text)))
        return op

    def _custom(self, op: Op, comp: str, type_text: str, rest: str) -> None:
        target = (_TARGET.search(rest) or [None, ""])[1]
        types = self.types[comp]
        op.bytes = float(nbytes(type_text) + sum(nbytes(types.get(o, "")) for o in operands(rest)))
        if target.startswith("__cudnn$fmha"):
            dims = _ATTN_SHAPE.search(rest)
            b, h, sq, sk = (int(d.strip().strip('"')) for d in dims.group(1).split(",")) \
                if dims else (0, 0, 0, 0)
            dtype, shape = _arrays(type_text)[0]
            flops = 4.0 * b * h * sq * sk * shape[-1]
            flops *= 2.5 if "Backward" in target else 1.0
            flops *= 0.5 if '"CAUSAL' in rest or "causal" in rest.lower() else 1.0
            op.cls, op.flops, op.dtype, op.seq = "attention", flops, dtype, sk
        elif target.startswith("__cublas"):
            dims = _CUBLAS_DIMS.search(rest)
            lhs = _arrays(types.get(operands(rest)[0], ""))
            if lhs:
                dtype, shape = lhs[0]
                k = math.prod(shape[int(d.strip().strip('"'))] for d in dims.group(1).split(",")
                              if d.strip()) if dims else 1
                op.cls, op.dtype = "matmul", dtype
                op.flops = op.dot_flops = 2.0 * math.prod(_arrays(type_text)[0][1]) * k

    def _collective(self, op: Op, base: str, type_text: str, rest: str) -> None:
        if op.opcode == "async-start":
            callee = re.search(r"calls=%?([\w.\-]+)", rest)
            inner = self.comps.get(callee.group(1), []) if callee else []
            if not inner or inner[-1][2] not in KINDS:
                op.cls = "memory"  # an async op that is not a collective: priced as moved bytes
                op.bytes = float(nbytes(type_text))
                return
            _, type_text, base, rest = inner[-1]
        if op.opcode.endswith("-done"):  # its start takes the result's bytes (`program`)
            op.cls, op.src, op.bytes = "done", operands(rest)[0], float(nbytes(type_text))
            return
        op.kind = base
        op.sync = '"is_sync":true' in rest
        op.groups = replica_groups(rest, self.np)
        op.bytes = float(nbytes(type_text) * (op.group if base == "reduce-scatter" else 1))
        op.cls = "start" if op.opcode.endswith("-start") else "collective"
        if base == "collective-permute" and "source_target_pairs={}" in rest or op.group <= 1 \
                and base != "collective-permute":
            op.cls = "free"  # moves nothing


def memory_class(opcodes: set[str]) -> str:
    return next((c for c, ops in MEMORY_CLASSES if opcodes & ops), "elementwise")


def _pair(ops: list[Op]) -> None:
    """An async pair: the start carries the result's bytes (a start's type
    holds its operands too); one XLA runs synchronously is a collective."""
    by_name = {o.name: o for o in ops}
    for o in ops:
        start = by_name.get(o.src) if o.cls == "done" else None
        if start is None:
            continue
        if start.cls == "free":
            o.cls = "free"
            continue
        start.bytes = o.bytes * (start.group if start.kind == "reduce-scatter" else 1)
        o.bytes = 0.0
        if start.sync:
            start.cls, o.cls = "collective", "free"


@functools.lru_cache(maxsize=4)
def program(text: str) -> tuple[dict[str, list[Op]], str]:
    """({computation: its ops in schedule order}, the entry computation);
    the last few texts' read kept (a plan, a price and the matmul count read
    one program; its ops are not to be changed)."""
    comps, entry = _parse(text)
    m = _NUM_PARTITIONS.search(text)
    reader = _Reader(comps, int(m.group(1)) if m else None)
    out = {c: [reader.op(c, *ins) for ins in instrs] for c, instrs in comps.items()}
    for ops in out.values():
        _pair(ops)
    return out, entry


def executed(comps: dict[str, list[Op]], entry: str):
    """(op, its runs per call of the entry) for every op of the computations
    that run (the entry, loop bodies and conditions at their trip counts,
    called computations; a conditional's branches each once); not the
    computations fusions or reducers hold."""
    def walk(comp: str, mult: int, depth: int):
        for op in comps.get(comp, []) if depth < 64 else []:
            yield op, mult
            for c in op.calls if op.cls in ("loop", "call") else ():
                yield from walk(c, mult * (op.trip if op.cls == "loop" else 1), depth + 1)

    yield from walk(entry, 1, 0)


def flops(text: str, classes=("matmul", "attention", "memory")) -> float:
    """Flops a call of the program runs: its dots', attention's and
    elementwise ops' (those of ops of `classes`), loops at their trip
    counts (XLA's cost analysis reads a loop's body once)."""
    return sum(op.flops * m for op, m in executed(*program(text)) if op.cls in classes)
