"""Which devices a collective's groups hold, in any form XLA's HLO text
prints them, and which mesh axes those groups span (a collective's
communication group: tp stays on the fast links inside a node, dp may cross
nodes). `jaxtp.hlo` reads the collectives; this reads their groups."""

from __future__ import annotations

import math
import re


def replica_groups(attrs: str, num_partitions: int | None) -> tuple[tuple[int, ...], ...] | None:
    """A collective's device groups (partition ids), in any form XLA prints
    them: explicit `{{0,1},{2,3}}` (`{}`: every partition), iota
    `[2,4]<=[8]` and its transposed form `[4,2]<=[2,4]T(1,0)`, `mesh[...]`
    with the axes it spans, and a permute's `source_target_pairs` (each
    pair a group). None where the text names none."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\],?\s*(?:device_ids=\((\[[\d,]+\]"
                  r"(?:T\([\d,]+\))?|[\d,\s]*)\),?\s*)?\{([^}]*)\}", attrs)
    if m:  # mesh['a'=2,'b'=4] {'b'}: the devices of the mesh, grouped over the named axes;
        # device_ids: the mesh's devices in order, listed or as an iota ([2,4]T(1,0))
        sizes = {k.strip().strip("'"): int(v) for k, v in
                 (kv.split("=") for kv in m.group(1).split(","))}
        ids = _device_ids(m.group(2), math.prod(sizes.values()))
        return _group_over(ids, sizes, {a.strip().strip("'") for a in m.group(3).split(",")
                                        if a.strip()})
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:  # iota: arange(prod(dims)) reshaped to dims, transposed, reshaped to [groups, size]
        shape, dims = [int(d) for d in m.group(1).split(",")], [int(d) for d in m.group(2).split(",")]
        perm = [int(d) for d in m.group(3).split(",")] if m.group(3) else list(range(len(dims)))
        ids = _transposed(list(range(math.prod(dims))), dims, perm)
        size = shape[-1]
        return tuple(tuple(ids[i:i + size]) for i in range(0, len(ids), size))
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m and m.group(1):
        return tuple(tuple(int(i) for i in g.split(",") if i)
                     for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    if m and num_partitions:  # {}: one group of every partition
        return (tuple(range(num_partitions)),)
    m = re.search(r"source_target_pairs=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m:
        return tuple(tuple(int(i) for i in g.split(","))
                     for g in re.findall(r"\{([\d,]*)\}", m.group(1)) if g)
    return None


def _device_ids(text: str | None, n: int) -> list[int]:
    """A mesh form's device_ids: none (0..n-1), a list, or an iota `[d0,d1]T(p)`."""
    if not text:
        return list(range(n))
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if not iota:
        return [int(i) for i in text.split(",")]
    dims = [int(d) for d in iota.group(1).split(",")]
    perm = [int(d) for d in iota.group(2).split(",")] if iota.group(2) else list(range(len(dims)))
    return _transposed(list(range(math.prod(dims))), dims, perm)


def _transposed(ids: list[int], dims: list[int], perm: list[int]) -> list[int]:
    """`ids` laid out row-major in `dims`, read back row-major after
    permuting the dims by `perm` (numpy's reshape(dims).transpose(perm).ravel())."""
    strides = [math.prod(dims[k + 1:]) for k in range(len(dims))]
    out_dims = [dims[k] for k in perm]
    out = []
    for flat in range(len(ids)):
        index, rest = [], flat
        for d in reversed(out_dims):
            index.append(rest % d)
            rest //= d
        index.reverse()
        out.append(ids[sum(index[i] * strides[perm[i]] for i in range(len(perm)))])
    return out


def _group_over(ids: list[int], sizes: dict[str, int], over: set[str]):
    """The devices `ids` of a row-major mesh of `sizes`, in groups that vary
    over the axes `over` (one group per coordinate of the other axes)."""
    names = list(sizes)
    groups: dict[tuple, list[int]] = {}
    for flat, device in enumerate(ids):
        coords = _coords(flat, [sizes[a] for a in names])
        key = tuple(c for a, c in zip(names, coords) if a not in over)
        groups.setdefault(key, []).append(device)
    return tuple(tuple(g) for g in groups.values())


def _coords(flat: int, shape: list[int]) -> list[int]:
    out = []
    for d in reversed(shape):
        out.append(flat % d)
        flat //= d
    return out[::-1]


def axes_of(groups, mesh: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes a collective spans: those whose coordinate differs
    between two devices of one group (for a permute, between a source and its
    target). `mesh`: axis -> size in the mesh's order, partition p at its
    row-major position p (JAX numbers the partitions by mesh.devices.flat)."""
    names, shape = list(mesh), list(mesh.values())
    varying = set()
    for group in groups or ():
        coords = [_coords(d, shape) for d in group]
        varying |= {names[k] for k in range(len(names)) if len({c[k] for c in coords}) > 1}
    return tuple(a for a in names if a in varying)


def hops_on(pairs, mesh: dict[str, int], axis: str) -> frozenset[int]:
    """The steps along `axis` a permute's (source, target) pairs take
    (target's coordinate minus source's): {1} for a shift to the next
    stage, {-1} for one back, {1, 1 - p} for a ring of p."""
    names, shape = list(mesh), list(mesh.values())
    k = names.index(axis)
    return frozenset(_coords(b, shape)[k] - _coords(a, shape)[k] for a, b in pairs or ())


__all__ = ["axes_of", "hops_on", "replica_groups"]
