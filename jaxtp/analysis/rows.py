"""A row of a communication budget (`Expected`) and the check of compiled
HLO's collectives against a list of rows: kind, pass, scope, elements, dtype
and group must match exactly, and every collective must be budgeted. The
budgets themselves: `jaxtp.analysis.budget` (train step), `.decode`."""

from __future__ import annotations

import dataclasses
from collections import Counter

from .. import hlo

HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
ANY_SCOPE = "(any)"  # a budget row matched by total elements, whatever the scopes


@dataclasses.dataclass(frozen=True)
class Expected:
    """One line of the budget: `count` collectives of `elements` each per step."""

    name: str
    kind: str
    pass_: str
    scope: str
    elements: int
    dtype: str
    group: int
    count: int
    role: str = ""  # what the row is for, so a backend's rules can find it

    @property
    def key(self) -> tuple:
        return (self.kind, self.pass_, self.scope, self.elements, self.dtype, self.group)

    @property
    def role_label(self) -> str:
        """The row's role in a word or two: its name up to the colon ("f",
        "g_sp ring", "cross-entropy")."""
        return self.name.split(":")[0]

    @property
    def bytes(self) -> int:
        """Bytes of the full buffer, as `hlo.Collective.bytes`: a reduce-scatter
        returns `elements` per rank from a group-times larger input."""
        full = self.elements * (self.group if self.kind == "reduce-scatter" else 1)
        return full * hlo.DTYPE_BYTES[self.dtype]

    @property
    def ring_bytes(self) -> float:
        """Per rank, per collective: 2(g-1)/g x bytes for all-reduce, (g-1)/g
        for all-gather and reduce-scatter; a collective-permute sends its
        whole buffer once."""
        if self.kind == "collective-permute":
            return float(self.bytes)
        share = (self.group - 1) / self.group
        return (2 if self.kind == "all-reduce" else 1) * share * self.bytes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d | {"bytes": self.bytes}


def collective_key(c: hlo.Collective) -> tuple:
    return (c.kind, c.pass_, c.scope, c.elements, c.dtype, c.group_size)


def check(colls: list[hlo.Collective], expected: list[Expected]) -> str | None:
    """None if the collectives are exactly the budget, else the first difference."""
    got = Counter()
    for c in colls:
        got[collective_key(c)] += c.count
    merged: dict[tuple, Expected] = {}  # rows of one key (e.g. after on_backend) add up
    for e in expected:
        if e.scope != ANY_SCOPE and e.key in merged:
            merged[e.key] = dataclasses.replace(merged[e.key],
                                                count=merged[e.key].count + e.count)
        else:
            merged[e.key if e.scope != ANY_SCOPE else id(e)] = e
    expected = list(merged.values())
    for e in expected:
        if e.scope == ANY_SCOPE:
            continue
        have = got.pop(e.key, 0)
        # a surplus of the same kind, size and group size may belong to an
        # any-scope row (a dp gradient as big as a tp activation); if not, it is
        # reported as unexpected below
        if have > e.count and any(x.scope == ANY_SCOPE for x in expected):
            got[e.key], have = have - e.count, e.count
        if have != e.count:
            return (f"{e.name}: expected {e.count} x {e.kind} of {e.elements} {e.dtype} over "
                    f"{e.group} devices ({e.pass_}, {e.scope or '-'}), found {have}")
    for e in expected:
        if e.scope != ANY_SCOPE:
            continue
        same = [k for k in got if (k[0], k[1], k[4], k[5]) ==
                (e.kind, e.pass_, e.dtype, e.group)]
        have = sum(k[3] * got.pop(k) for k in same)
        if have != e.elements * e.count:
            return (f"{e.name}: expected {e.elements * e.count} {e.dtype} elements in "
                    f"{e.kind}s over {e.group} devices ({e.pass_}), found {have}")
    for (kind, pass_, scope, n, dt, group), count in got.items():
        return (f"unexpected {kind} of {n} {dt} over {group} devices x{count} "
                f"({pass_}, scope {scope or '-'})")
    return None
