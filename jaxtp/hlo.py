"""Read collectives out of compiled (post-SPMD-partitioning) HLO text.

`collectives(text)` lists every all-reduce, all-gather, reduce-scatter,
all-to-all, ragged-all-to-all (its result: the receive buffer, sized for the worst
case) and collective-permute that will run, with its dtype, shape, bytes,
replica groups (and so the mesh axes it spans, `Collective.axes`), pass and
named scope:

- an async pair (`*-start` / `*-done`) is one collective;
- a combined (tuple-shaped) collective, as XLA's combiner passes make, is
  listed element by element, each with its own metadata where a
  `get-tuple-element` user carries it;
- a collective in a `while` body counts `known_trip_count` times (a scanned
  layer stack), through any nesting of calls.

The pass comes from the op_name metadata JAX writes: `transpose(jvp(...))`
is backward, `jvp(...)` forward, anything else (the optimizer update, the
gradient norm, or a function not under autodiff) is "other".
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict

from .groups import axes_of, replica_groups

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all")

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"(to_apply|calls|body|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_NUM_PARTITIONS = re.compile(r"num_partitions=(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective as it runs, `count` times per call of the function."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    group_size: int | None
    pass_: str  # "forward", "backward" or "other"
    scope: str  # named scope(s), e.g. "attention" or "mlp"
    op_name: str
    name: str  # HLO instruction name (with "#i" for an element of a tuple)
    count: int = 1  # trip count of enclosing while loops
    combined: int = 1  # how many tensors the HLO instruction carries
    # its device groups (partition ids; a permute's source-target pairs)
    groups: tuple | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        """Bytes of the full buffer: the result, or for reduce-scatter its input."""
        full = self.elements * ((self.group_size or 1) if self.kind == "reduce-scatter" else 1)
        return full * DTYPE_BYTES.get(self.dtype, 0)

    def axes(self, mesh: dict[str, int]) -> tuple[str, ...]:
        """The mesh axes this collective spans (`axes_of`)."""
        return axes_of(self.groups, mesh)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("groups")
        d["pass"] = d.pop("pass_")
        d["shape"] = list(self.shape)
        return d | {"elements": self.elements, "bytes": self.bytes}


def pass_of(op_name: str) -> str:
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "other"


# names that lowering adds around a scope: shard_map, and a scanned layer
# stack's loop (`while/body/closed_call/mlp/...`) or rematerialised body;
# and the zero-bubble pipeline's around its weight gradients
# (`jaxtp.parallel.vjp_split.WGRAD`, which `jaxtp.analysis.pp` reads)
_WRAPPERS = {"shard_map", "while", "body", "cond", "closed_call", "checkpoint", "remat",
             "rematted_computation", "pp_wgrad"}


def scope_of(op_name: str) -> str:
    """`jit(step)/transpose(jvp(attention))/dot_general` -> "attention"."""
    parts = op_name.split("/")[1:-1]  # drop the jit(...) root and the op itself
    names = []
    for p in parts:
        while True:
            m = re.fullmatch(r"[\w\-]+\((.*)\)", p)
            if not m:
                break
            p = m.group(1)
        # keep named scopes; drop transform wrappers and jnp's internal names
        # (`_take`, einsum specs) so scopes read the same under both impls
        # (a rematerialised matmul's backward repeats its scope:
        # `transpose(jvp(mlp))/jvp(mlp)/checkpoint/...` is the MLP's)
        if re.fullmatch(r"[A-Za-z][\w.\-]*", p) and p not in _WRAPPERS and \
                names[-1:] != [p]:
            names.append(p)
    return "/".join(names)


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(type_text)]


def by_axis(colls: list[Collective], mesh: dict[str, int]) -> dict[str, dict]:
    """{"tp": {"collectives": n, "bytes": b}, "dp": ..., "dp+tp": ...}: the
    collectives per step and their full-buffer bytes, by the mesh axes each
    spans ("?" where its groups are not in the text)."""
    out: dict[str, dict] = {}
    for c in colls:
        key = "+".join(c.axes(mesh)) or "?" if c.groups is not None else "?"
        row = out.setdefault(key, {"collectives": 0, "bytes": 0})
        row["collectives"] += c.count
        row["bytes"] += c.count * c.bytes
    return dict(sorted(out.items()))


def _parse(text: str):
    """-> computations {name: [(instr_name, type_text, opcode, rest)]}, entry name."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        if current is None:
            m = _COMP_HEADER.match(line.strip())
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(m.groups())
    if entry is None and comps:
        entry = list(comps)[-1]
    return comps, entry


def _loop_bound(cond: list) -> int:
    """Trip count of a while loop from its condition `counter < N` (a scan's
    counter starts at 0, steps by 1), for HLO without known_trip_count; 1 if
    the condition has another form."""
    consts = {name: int(m.group(1)) for name, _, opcode, rest in cond
              if opcode == "constant" and (m := re.match(r"(-?\d+)\)", rest))}
    for _, _, opcode, rest in cond:
        if opcode == "compare" and "direction=LT" in rest:
            args = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
            if len(args) == 2 and args[1] in consts:
                return consts[args[1]]
    return 1


def _multipliers(comps: dict, entry: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry."""
    calls = defaultdict(list)  # caller -> [(callee, factor)]
    for comp, instrs in comps.items():
        for _, _, opcode, rest in instrs:
            trip = _TRIP.search(rest)
            if opcode.endswith("-done"):
                continue  # an async pair names its wrapped computation twice
            found = dict((k, c) for k, c in _CALLS.findall(rest))
            if opcode == "while" and not trip:  # libtpu drops known_trip_count
                bound = _loop_bound(comps.get(found.get("condition"), []))
            else:
                bound = int(trip.group(1)) if trip else 1
            for key, callee in _CALLS.findall(rest):
                if key == "to_apply" and opcode != "call":
                    continue  # reducers and comparators hold no collectives
                calls[comp].append((callee, bound if key == "body" else 1))
            for group in _BRANCHES.findall(rest):
                calls[comp] += [(c.strip().lstrip("%"), 1) for c in group.split(",")]
    mult = Counter({entry: 1})

    def visit(comp, factor, depth=0):
        for callee, f in calls.get(comp, []):
            if callee in comps and depth < 64:
                mult[callee] += factor * f
                visit(callee, factor * f, depth + 1)

    visit(entry, 1)
    return mult


def collectives(text: str) -> list[Collective]:
    """Every collective in compiled HLO text, in program order."""
    comps, entry = _parse(text)
    if entry is None:
        return []
    np_m = _NUM_PARTITIONS.search(text)
    num_partitions = int(np_m.group(1)) if np_m else None
    mult = _multipliers(comps, entry)
    names = _OpNames(comps)
    starts = {}
    out = []
    for comp, instrs in comps.items():
        count = mult.get(comp, 0)
        if not count:
            continue
        for name, type_text, opcode, rest in instrs:
            base = opcode.removesuffix("-start").removesuffix("-done")
            if base not in KINDS:
                continue
            if opcode.endswith("-start"):
                starts[name] = rest
                continue
            attrs = rest
            if opcode.endswith("-done"):
                src = re.match(r"%?([\w.\-]+)", rest)
                attrs = starts.get(src.group(1), rest) if src else rest
            if base == "collective-permute" and "source_target_pairs={}" in attrs:
                continue  # no pairs, moves nothing (XLA's GPU pipeline leaves some)
            op = _OP_NAME.search(attrs)
            op_name = op.group(1) if op else names.inherited(name)
            groups = replica_groups(attrs, num_partitions)
            # a permute's group: its pairs; else the devices of one group
            group = None if groups is None else \
                len(groups) if base == "collective-permute" else len(groups[0])
            if group == 1 and (base != "collective-permute" or groups[0][0] == groups[0][1]):
                # over one device (a psum over a mesh axis of size 1): moves
                # nothing; a permute's one pair between two devices does
                continue
            arrays = _arrays(type_text)
            for i, (dtype, shape) in enumerate(arrays):
                elem_op = names.of_element(name, i, op_name) if len(arrays) > 1 else op_name
                out.append(Collective(
                    kind=base, dtype=dtype, shape=shape, group_size=group,
                    pass_=pass_of(elem_op), scope=scope_of(elem_op), op_name=elem_op,
                    name=name if len(arrays) == 1 else f"{name}#{i}",
                    count=count, combined=len(arrays), groups=groups))
    return out


_WINDOWED_BODY = re.compile(r"body=%?[\w.\-]*windowed_dot_general_body_(ag|rs)")


def windowed_loops(text: str) -> Counter:
    """XLA's windowed-einsum loops in compiled HLO (the SPMD partitioner's
    `windowed_dot_general_body_ag` / `_rs` while bodies; XLA's GPU pipeline
    prefixes `unrolled_`, the CPU one suffixes clones): {(kind, pass, scope):
    loops per call}, kind "all-gather" or "reduce-scatter", a loop inside a
    scanned layer stack counted per trip."""
    comps, entry = _parse(text)
    if entry is None:
        return Counter()
    mult = _multipliers(comps, entry)
    out = Counter()
    for comp, instrs in comps.items():
        for _, _, opcode, rest in instrs:
            m = _WINDOWED_BODY.search(rest) if opcode == "while" else None
            if m and mult.get(comp):
                op = _OP_NAME.search(rest)
                op_name = op.group(1) if op else ""
                kind = "all-gather" if m.group(1) == "ag" else "reduce-scatter"
                out[(kind, pass_of(op_name), scope_of(op_name))] += mult[comp]
    return out


class _OpNames:
    """Where a collective's op_name comes from when it has none of its own."""

    PASSTHROUGH = {"bitcast", "copy", "reshape", "transpose"}

    def __init__(self, comps: dict):
        # get-tuple-element users carry per-element metadata of combined collectives
        self.elements, self.op_names, self.operands, self.opcodes = {}, {}, {}, {}
        for instrs in comps.values():
            for name, _, opcode, rest in instrs:
                self.opcodes[name] = opcode
                op = _OP_NAME.search(rest)
                if op:
                    self.op_names[name] = op.group(1)
                first = re.match(r"[^%]*%([\w.\-]+)", rest)
                if first:
                    self.operands[name] = first.group(1)
                if opcode == "get-tuple-element":
                    m = re.match(r"%?([\w.\-]+)\),\s*index=(\d+)", rest)
                    if m and op:
                        self.elements[(m.group(1), int(m.group(2)))] = op.group(1)

    def of_element(self, name: str, i: int, default: str) -> str:
        """The op_name of element i of a combined (tuple) collective."""
        return self.elements.get((name, i), default)

    def inherited(self, name: str) -> str:
        """XLA passes that create a collective (the GPU pipeline's reduce-scatter
        creator) may drop its metadata; it then takes the op_name of the value
        it reduces: its operand, followed through unnamed layout-only ops."""
        name = self.operands.get(name)  # a -done's operand is its -start
        if name is not None and self.opcodes.get(name, "").endswith("-start"):
            name = self.operands.get(name)
        for _ in range(8):
            if name is None:
                return ""
            if name in self.op_names:
                return self.op_names[name]
            if self.opcodes.get(name) not in self.PASSTHROUGH:
                return ""
            name = self.operands.get(name)
        return ""


def compiled_text(fn, *args, **kwargs) -> str:
    """Optimized HLO of `fn` (jitted or not) for these (possibly abstract) arguments."""
    import jax  # the HLO reader itself needs no JAX (it reads text)

    lowerable = fn if hasattr(fn, "lower") else jax.jit(fn)
    return lowerable.lower(*args, **kwargs).compile().as_text()


def summarize(colls: list[Collective], mesh: dict[str, int] | None = None) -> list[dict]:
    """Group by (kind, pass, dtype, shape, scope; with `mesh`, the mesh axes
    spanned): one row each with its count and bytes."""
    rows: dict[tuple, dict] = {}
    for c in colls:
        axes = c.axes(mesh) if mesh else None
        key = (c.kind, c.pass_, c.dtype, c.shape, c.scope, axes)
        row = rows.setdefault(key, {"kind": c.kind, "pass": c.pass_, "scope": c.scope,
                                    "count": 0, "shape": list(c.shape), "dtype": c.dtype,
                                    "bytes": c.bytes, "group_size": c.group_size,
                                    **({"axes": list(axes)} if mesh else {})})
        row["count"] += c.count
    return list(rows.values())
