"""A row of a communication budget (`Expected`) and the check of compiled
HLO's collectives against a list of rows: kind, pass, scope, elements, dtype,
group and (given the mesh) the mesh axes the group spans must match exactly,
and every collective must be budgeted. The budgets themselves:
`jaxtp.analysis.budget` (train step), `.decode`."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

from .. import hlo
from ..parallel import DATA_AXIS, EP_AXIS, TP_AXIS, Layout, Schedule

HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
ANY_SCOPE = "(any)"  # a budget row matched by total elements, whatever the scopes
ANY_PASS = "forward or backward"  # an any-scope row whose collectives may be in either pass


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
    axes: tuple[str, ...] = (TP_AXIS,)  # the mesh axes its groups span
    # under shard_map: written in its code (a collective in the jaxpr), or
    # placed by GSPMD outside the regions (False: `jaxtp.analysis.roofline`)
    written: bool = True
    # what `count` is counted per: "layer" (one layer's, one loop trip's),
    # "tick" (a loop trip's), "microbatch" or "step"; "wlayer", "wtick": a
    # weight gradient's sum in a layer, in a loop trip, of the pass that
    # makes it (zb's weight gradients run v*M trips: `Schedule.weight_ticks`);
    # `per_step` multiplies it out, once (`PER`)
    per: str = "step"

    @property
    def key(self) -> tuple:
        return (self.kind, self.pass_, self.scope, self.elements, self.dtype, self.group,
                self.axes)

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


PER = ("layer", "tick", "microbatch", "step", "wlayer", "wtick")


def per_step(rows: list[Expected], schedule: Schedule) -> list[Expected]:
    """The rows' counts per step: a "layer" row's times the layers a rank
    runs per loop trip and the trips it runs (`Schedule.ticks`: M without a
    pipeline), a "tick" row's times the trips, a "microbatch" row's times
    the head's trips (M; 1F1B's head runs in each tick of its steady loop);
    "wlayer" and "wtick" rows as "layer" and "tick" over the weight
    gradients' trips (v*M under zb, whose W never runs on dropped data);
    the one place a ledger multiplies by the layer count and the schedule."""
    times = {"layer": schedule.layers_per_tick * schedule.ticks, "tick": schedule.ticks,
             "microbatch": schedule.head_trips, "step": 1,
             "wlayer": schedule.layers_per_tick * schedule.weight_ticks,
             "wtick": schedule.weight_ticks}
    for r in rows:
        if r.per not in times:
            raise ValueError(f"budget row {r.name!r} is counted per {r.per!r}: one of {PER}")
    again = lambda r: 1 + (schedule.recomputes and r.per in ("layer", "tick")  # (the
                           and r.pass_ == "forward")  # stage's forward again in a backward)
    return [dataclasses.replace(r, count=r.count * times[r.per] * again(r), per="step")
            for r in rows]


@functools.lru_cache(maxsize=512)
def decided(cfg) -> tuple[Layout, Schedule]:
    """`cfg`'s `Layout` and `Schedule`, decided once per config for every
    ledger, the planner and the comparison (a Config is frozen: its own key)."""
    layout = Layout.of(cfg)
    return layout, Schedule.of(cfg, layout)


def schedule_of(cfg) -> Schedule:
    """`cfg`'s `jaxtp.parallel.Schedule` (`decided`)."""
    return decided(cfg)[1]


def moe_per_tick(cfg) -> int:
    """The MoE layers a loop trip runs: the MoE layers' share of the
    layers it runs (`Schedule.layers_per_tick`) among those its loop holds
    (a pipeline's stack, whose leading dense run, `model.moe_first_dense`,
    runs before the stages; every layer without one)."""
    m, s = cfg.model, schedule_of(cfg)
    return s.layers_per_tick * m.n_moe_layers // (m.stacked_layers if s.stages > 1
                                                   else m.n_layers)


def runs_head(cfg) -> bool:
    """`cfg`'s `Schedule.runs_head` (1F1B, interleaved: the head in the loop)."""
    return schedule_of(cfg).runs_head


def on(cfg, *axes: str) -> tuple[str, ...]:
    """The mesh axes among `axes` whose degree is above 1."""
    return tuple(a for a in axes if cfg.parallel.degrees[a] > 1)


def batch_axes(cfg) -> tuple[str, ...]:
    """The axes that split the batch outside a pipeline's stages and a MoE
    layer's experts: dp, ep."""
    return on(cfg, DATA_AXIS, EP_AXIS)


def batch_ranks(cfg) -> int:
    """The ranks the batch is split over within a pipeline stage: dp x ep."""
    return cfg.parallel.dp * cfg.parallel.ep


def microbatch_rows(cfg) -> int:
    """The rows one rank holds of a microbatch: B/(M x dp x ep) (a pipeline's
    microbatch holds every stage's rows: `Schedule.rows`)."""
    return schedule_of(cfg).rows


def reduces_once(cfg) -> bool:
    """Whether `cfg`'s step reduces its gradients over dp once per step (its
    `jaxtp.parallel.Schedule`; attention resolved for the device)."""
    return schedule_of(cfg).reduces_once


def counts_local(cfg) -> bool:
    """Whether the MoE layers run manual over the axes that split the tokens
    (a pipeline's stages, slices reduced once over dp): there each rank's
    bias gradient holds its own counts, summed with the other gradients;
    elsewhere GSPMD sums the counts in the forward."""
    return cfg.parallel.pp > 1 or reduces_once(cfg)


def collective_key(c: hlo.Collective, mesh: dict[str, int] | None = None) -> tuple:
    """A collective as a budget row's key; without a mesh its axes are not
    known (None), and a row's are then not compared (`_key`)."""
    return (c.kind, c.pass_, c.scope, c.elements, c.dtype, c.group_size,
            c.axes(mesh) if mesh else None)


def _key(e: Expected, mesh) -> tuple:
    return e.key if mesh else e.key[:-1] + (None,)


def check(colls: list[hlo.Collective], expected: list[Expected],
          mesh: dict[str, int] | None = None) -> str | None:
    """None if the collectives are exactly the budget, else the first
    difference. With `mesh` (axis -> size, in the mesh's order) each
    collective must also span the mesh axes its row names."""
    got = Counter()
    for c in colls:
        got[collective_key(c, mesh)] += c.count
    expected = [dataclasses.replace(e, axes=None) if not mesh else e for e in expected]
    merged: dict[tuple, Expected] = {}  # rows of one key (e.g. after on_backend) add up
    for e in expected:
        if e.scope != ANY_SCOPE and e.key in merged:
            merged[e.key] = dataclasses.replace(merged[e.key],
                                                count=merged[e.key].count + e.count)
        elif e.scope == ANY_SCOPE and _total_key(e) in merged:
            # any-scope rows that the same collectives answer: one total
            had = merged[_total_key(e)]
            merged[_total_key(e)] = dataclasses.replace(
                had, name=f"{had.name}; {e.name}", elements=had.elements * had.count +
                e.elements * e.count, count=1)
        else:
            merged[e.key if e.scope != ANY_SCOPE else _total_key(e)] = e
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
                    f"{e.group} devices{_over(e.axes)} ({e.pass_}, {e.scope or '-'}), found {have}")
    for e in sorted(expected, key=lambda e: e.pass_ == ANY_PASS):
        if e.scope != ANY_SCOPE:
            continue
        same = [k for k in got if (k[0], k[4], k[5], k[6]) == (e.kind, e.dtype, e.group, e.axes)
                and e.pass_ in (k[1], ANY_PASS)]
        have = sum(k[3] * got.pop(k) for k in same)
        if have != e.elements * e.count:
            return (f"{e.name}: expected {e.elements * e.count} {e.dtype} elements in "
                    f"{e.kind}s over {e.group} devices ({e.pass_}), found {have}")
    for (kind, pass_, scope, n, dt, group, axes), count in got.items():
        return (f"unexpected {kind} of {n} {dt} over {group} devices{_over(axes)} x{count} "
                f"({pass_}, scope {scope or '-'})")
    return None


def _total_key(e: Expected) -> tuple:
    """What an any-scope row is matched on: its total over these."""
    return (ANY_SCOPE, e.kind, e.pass_, e.dtype, e.group, e.axes)


def _over(axes) -> str:
    return f" ({'+'.join(axes) or 'no axis'})" if axes is not None else ""


def size_text(b: float) -> str:
    return f"{b / 2**20:.3f} MiB" if b >= 2**10 else f"{b:.0f} B"


def table_rows(colls_by_impl: dict, expected_by_impl: dict,
               mesh: dict[str, int] | None = None) -> list[dict]:
    """Every collective (kind, pass, scope, dtype, shape, devices, bytes; with
    `mesh`, the mesh axes it spans) with its count per impl (`counts`) and in
    each impl's budget (`budget`), and the budget's roles for it (Megatron's f
    or g, their SP forms and rings, the loss's reductions): the data of the
    table and of the picture. Rows are grouped by axes, then pass.

    An any-scope budget row (matched by total elements: `check`) is one row
    per total, whose `total` is [elements found, elements booked] per impl;
    a collective it counts names it in its roles and the impls in `in_total`."""
    cells: dict[tuple, dict] = {}
    for impl in colls_by_impl:
        for c in colls_by_impl[impl]:
            cell = cells.setdefault(collective_key(c, mesh),
                                    {"shape": c.shape, "bytes": c.bytes})
            cell.setdefault("counts", {})[impl] = cell.get("counts", {}).get(impl, 0) + c.count
        for e in expected_by_impl[impl]:
            key = _key(e, mesh)
            if e.scope == ANY_SCOPE:  # one row per total, as `check` merges them
                key = key[:3] + (0,) + key[4:]
                cell = cells.setdefault(key, {"shape": None, "bytes": 0, "elements": 0})
                total = cell.setdefault("total", {}).setdefault(impl, [0, 0])
                total[1] += e.elements * e.count
                cell["elements"] = max(cell["elements"], total[1])
                cell["bytes"] = cell["elements"] * hlo.DTYPE_BYTES[e.dtype]
            else:
                cell = cells.setdefault(key, {"shape": None, "bytes": e.bytes})
            cell.setdefault("budget", {})[impl] = cell.get("budget", {}).get(impl, 0) + e.count
            roles = cell.setdefault("roles", [])
            if e.role_label not in roles:
                roles.append(e.role_label)
    for impl in expected_by_impl:
        _take_into_totals(cells, impl)
    order = {"forward": 0, "backward": 1, "other": 2, ANY_PASS: 3}
    rows = []
    # (an any-scope total after the collectives it counts)
    for key in sorted(cells, key=lambda k: (k[6] or (), order.get(k[1], 3), k[2] == ANY_SCOPE,
                                            k[2], k[0], -k[3])):
        kind, pass_, scope, n, dt, group, axes = key
        cell = cells[key]
        rows.append({"kind": kind, "pass": pass_, "scope": scope,
                     "elements": cell.get("elements", n), "dtype": dt,
                     "devices": group, "bytes": cell["bytes"],
                     "axes": list(axes) if axes is not None else None,
                     "shape": list(cell["shape"]) if cell["shape"] is not None else None,
                     "counts": {i: cell.get("counts", {}).get(i, 0) for i in colls_by_impl},
                     "budget": {i: cell.get("budget", {}).get(i, 0) for i in colls_by_impl},
                     "roles": cell.get("roles", []),
                     "total": cell.get("total", {}),
                     "in_total": sorted(cell.get("in_total", ()))})
    return rows


def _take_into_totals(cells: dict, impl: str) -> None:
    """Count into each any-scope total of `impl`'s budget what the
    collectives it may hold have beyond their own rows (`table_rows`)."""
    # what each collective has beyond its own rows, taken by the totals in
    # `check`'s order (those of one pass before "forward or backward")
    left = {key: max(cell.get("counts", {}).get(impl, 0)
                     - cell.get("budget", {}).get(impl, 0), 0)
            for key, cell in cells.items() if key[2] != ANY_SCOPE}
    for any_key in sorted((k for k, cell in cells.items() if impl in cell.get("total", {})),
                          key=lambda k: k[1] == ANY_PASS):
        total = cells[any_key]
        for key, cell in cells.items():
            if not left.get(key) or not _in_total(key, any_key):
                continue
            total["total"][impl][0] += key[3] * left.pop(key)
            cell.setdefault("in_total", set()).add(impl)
            label = f"{total['roles'][0]}, in its (any) total"
            if not cell.get("budget") and label not in cell.setdefault("roles", []):
                cell["roles"].append(label)


def _in_total(key: tuple, total: tuple) -> bool:
    """Whether a collective of `key` is one the any-scope total of key
    `total` counts (`check`)."""
    return (key[0], key[4], key[5]) == (total[0], total[4], total[5]) and \
        (key[6] is None or key[6] == total[6]) and total[1] in (key[1], ANY_PASS)


def row_cells(row: dict, impl: str) -> tuple[str, str, bool]:
    """(compiled, budget, whether they agree) of a table row for `impl`: counts;
    an any-scope row's element totals; "(any)" as the budget of a collective
    an any-scope row counts."""
    # (a report written before these fields: counts alone)
    if row["scope"] == ANY_SCOPE and impl in row.get("total", {}):
        found, booked = row["total"][impl]
        return f"{found} el", f"{booked} el", found == booked
    got, want = row["counts"][impl], row["budget"][impl]
    if impl in row.get("in_total", ()) and got > want:
        return str(got), f"{want} + (any)" if want else "(any)", True
    return str(got), str(want), got == want


def role_text(row: dict) -> str:
    return " / ".join(row["roles"]) or "(not in the budget)"


def shape_text(row: dict) -> str:
    shape = row["shape"] if row["shape"] is not None else f"[{row['elements']} elements]"
    return f"{row['dtype']}{shape}"
