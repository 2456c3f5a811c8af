"""The mesh, the logical-axis rules, and the `Layout` of a run.

Model code names logical axes ("embed", "mlp", "heads", ...); `RULES` maps
each to a tuple of mesh axes (empty: not split; two: split over both, the
first outermost). Weights get their PartitionSpec at construction from
`Layout.param_spec`, so changing a table changes the layout without
touching the model. `Layout` is everything the model needs to know about
parallelism, decided once from the config; it builds the mesh, its axes in
the axis table's order (`jaxtp.axes`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

# every mesh axis, outermost first (tp innermost, on the fastest links); those
# in OPTIONAL are on a run's mesh only where their degree is above 1; those in
# BATCH split the batch: the axis table (`jaxtp.axes`)
from ..axes import AXES, BATCH, CP_AXIS, DATA_AXIS, EP_AXIS, OPTIONAL, PP_AXIS, TP_AXIS  # noqa: E402
from .distributed import check_device_count  # noqa: E402

# Megatron layout: the hidden dims of the MLP, the attention heads and the
# vocabulary are split over tp; the model dim stays whole on every tp rank;
# the batch is split over dp and the sequence over cp (context parallelism;
# a mesh without a cp axis leaves it whole: `spec`). Outside the pipeline
# (embedding, LM head, loss) pp splits the batch as dp does: every stage
# runs them on its own rows (`jaxtp.parallel.pipeline`).
RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH,  # (pp, dp, ep)
    "seq": (CP_AXIS,),
    # the residual stream's sequence under sequence parallelism: each cp
    # rank's part split again over tp (Korthikanti et al. 2022)
    "sp_seq": (CP_AXIS, TP_AXIS),
    "embed": (),
    "vocab": (TP_AXIS,),  # vocab-parallel embedding, LM head and cross-entropy
    "mlp": (TP_AXIS,),
    "heads": (TP_AXIS,),
    "kv_heads": (TP_AXIS,),  # when tp divides them; else the kv projection is replicated
    "head_dim": (),
    # a MoE layer's experts (`jaxtp.model.moe`): ep's ranks hold E/ep each, and
    # take the batch as dp does everywhere else (Megatron-Core's EP folded out
    # of DP; torchtitan's EP borrowed from the data ranks)
    "expert": (EP_AXIS,),
    # a MoE layer's routing groups [G]: the sequences, or under cp (and SP)
    # each rank's part of one, the parts major (`jaxtp.model.moe`): split as
    # the tokens are, ep last
    "groups": (CP_AXIS, PP_AXIS, DATA_AXIS, EP_AXIS),
    "sp_groups": (CP_AXIS, TP_AXIS, PP_AXIS, DATA_AXIS, EP_AXIS),
    # the groups of the experts' slots: the tokens' split without ep, which
    # holds experts there (and without SP's tp, which splits the experts' F)
    "expert_batch": (CP_AXIS, PP_AXIS, DATA_AXIS),
    # the experts' row-parallel output under SP, reduce-scattered over tp
    "sp_expert_batch": (CP_AXIS, TP_AXIS, PP_AXIS, DATA_AXIS),
}
# FSDP-style: parameters (and so the optimizer state, which mirrors them) are
# also split over dp along their model dim. Only parameters: an activation's
# model dim stays whole, its batch is what dp splits.
FSDP_PARAM_RULES = {**RULES, "embed": (DATA_AXIS,)}


def spec(*logical: str | None, rules: dict[str, tuple[str, ...]] | None = None) -> P:
    """PartitionSpec for a tensor whose dims carry these logical names (a dim
    over one mesh axis names it, over several a tuple of them).

    >>> spec("embed", "mlp")
    P(None, 'tp')
    """
    rules = RULES if rules is None else rules
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset() if mesh.empty else frozenset(mesh.manual_axes)
    # an axis of size 1 may be left off the mesh (`Layout.make`): not split
    absent = set() if mesh.empty else set(AXES) - set(mesh.axis_names)
    dims = []
    for name in logical:
        if name is not None and name not in rules:
            raise KeyError(f"unknown logical axis {name!r}; known: {sorted(rules)}")
        dims.append(() if name is None else tuple(rules[name]))
    used = [a for axes in dims for a in axes]
    if len(used) != len(set(used)):
        raise ValueError(
            f"logical axes {logical} map two dims to the same mesh axis ({dims}); "
            "a tensor can be split over a mesh axis only once"
        )
    # inside a shard_map manual over some axes, arrays are local over them
    dims = [tuple(a for a in axes if a not in manual and a not in absent) for axes in dims]
    return P(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in dims))


def manual_axes() -> frozenset:
    """The mesh axes the code in context is manual over (inside a shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset() if mesh.empty else frozenset(mesh.manual_axes)


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names (None, a name, a tuple)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run is split, decided once from the config and handed to every
    module: the mesh's axes and sizes, the implementation of the tp
    collectives, sequence parallelism (only where tp > 1) and its overlap
    with the matmuls, FSDP, and whether tp divides the kv heads (each rank
    holds K/tp of them) or not (the kv projection is replicated)."""

    # mesh axis -> size, outermost first: tp innermost, on the fastest links
    # (a tuple of pairs, so that a Layout is hashable)
    axes: tuple[tuple[str, int], ...] = ((DATA_AXIS, 1), (TP_AXIS, 1))
    # "gspmd": XLA places f and g; "shard_map": written out; "explicit": typed
    # shardings on a mesh of Explicit axes name each reduction
    impl: str = "gspmd"
    sp: bool = False
    fsdp: bool = False
    kv_sharded: bool = True
    # SP's entry all-gather and exit reduce-scatter overlapped with their
    # matmuls: collective-matmul rings (shard_map), XLA's windowed einsum
    # asked for (gspmd, explicit); only with sp. `bidi`: shard_map's rings
    # send each chunk's halves both ways
    overlap: bool = False
    bidi: bool = False
    # context parallelism (a cp axis): how the attention core sees the other
    # cp ranks' keys and values (jaxtp.config.CP_STRATEGIES), and whether rank r holds
    # the sequence's chunks r and 2cp-1-r (causal load balance) or chunk r
    cp_attention: str = "allgather"
    cp_balance: bool = True

    def __post_init__(self):
        axes = tuple(self.axes.items()) if isinstance(self.axes, dict) else tuple(self.axes)
        for name, size in axes:
            if not (isinstance(size, int) and size >= 1):
                raise ValueError(f"mesh axis {name!r} has size {size!r}: must be an int >= 1")
        object.__setattr__(self, "axes", axes)

    @classmethod
    def make(cls, **kw) -> "Layout":
        """A layout of these degrees (keywords named as `AXES`; 1 where not
        given) and fields: its mesh has the axes in `AXES` order, an
        `OPTIONAL` one only where its degree is above 1."""
        degrees = {a: kw.pop(a, 1) for a in AXES}
        return cls(axes=tuple((a, n) for a, n in degrees.items()
                              if n > 1 or a not in OPTIONAL), **kw)

    @classmethod
    def of(cls, cfg) -> "Layout":
        """The layout of a `jaxtp.config.Config` (its `parallel` degrees are
        named as the mesh axes)."""
        p, m = cfg.parallel, cfg.model
        sp = p.sp and p.tp > 1
        return cls.make(**{a: getattr(p, a) for a in AXES}, impl=p.impl, sp=sp, fsdp=p.fsdp,
                        kv_sharded=m.kv_heads % p.tp == 0,
                        overlap=sp and p.overlap != "none",
                        bidi=sp and p.overlap == "collective_matmul_bidi",
                        cp_attention=p.cp_attention, cp_balance=p.cp_balance)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    def rows(self, B: int, manual=frozenset()) -> int:
        """The rows one rank holds of an array of B rows laid out by the
        "batch" rule (`RULES`: pp, dp and ep split it), where the axes in
        `manual` (a shard_map's, over which the array is already this rank's
        part) split it no further.

        >>> Layout.make(pp=2, dp=2, ep=2, tp=2).rows(16)
        2
        """
        return B // math.prod(self.sizes.get(a, 1) for a in RULES["batch"] if a not in manual)

    @property
    def pp(self) -> int:
        return self.sizes.get(PP_AXIS, 1)

    @property
    def dp(self) -> int:
        return self.sizes.get(DATA_AXIS, 1)

    @property
    def tp(self) -> int:
        return self.sizes.get(TP_AXIS, 1)

    @property
    def ep(self) -> int:
        return self.sizes.get(EP_AXIS, 1)

    @property
    def cp(self) -> int:
        return self.sizes.get(CP_AXIS, 1)

    def positions(self, T: int) -> np.ndarray:
        """The original index of each of a placed sequence's T tokens
        (`cp_order`): RoPE and learned positions read these."""
        return cp_order(T, self.cp, self.cp_balance)

    @property
    def devices(self) -> int:
        """The mesh's device count: the product of its axes' sizes."""
        return math.prod(self.sizes.values())

    def _axis_types(self) -> tuple:
        kind = AxisType.Explicit if self.impl == "explicit" else AxisType.Auto
        return (kind,) * len(self.axes)

    def mesh(self, devices=None) -> Mesh:
        """The mesh of these axes over the first `self.devices` of `devices`
        (default: every device), with the impl's axis types: Auto, so GSPMD
        may insert collectives itself (gspmd, and shard_map, which is manual
        inside its regions only), or Explicit for impl="explicit", where every
        array's type carries its sharding and an ambiguous contraction must
        name its `out_sharding`. (jax.make_mesh defaults to Explicit axes; the
        Megatron GSPMD path wants Auto.)"""
        devices = jax.devices() if devices is None else devices
        check_device_count(self.sizes, len(devices), devices[0].platform)
        names, shape = zip(*self.axes)
        return jax.make_mesh(shape, names, axis_types=self._axis_types(),
                             devices=devices[: self.devices])

    def on(self, mesh: Mesh) -> Mesh:
        """`mesh`'s devices with this layout's axis types (Explicit for impl
        "explicit", else Auto)."""
        return mesh_for(mesh, self.impl)

    def abstract_mesh(self) -> AbstractMesh:
        """The mesh's shape, names and axis types, without devices (for
        tracing and analysis)."""
        names, shape = zip(*self.axes)
        return AbstractMesh(shape, names, axis_types=self._axis_types())

    def param_spec(self, *logical: str | None) -> P:
        """A parameter's PartitionSpec (FSDP also splits its "embed" dim over dp)."""
        return spec(*logical, rules=FSDP_PARAM_RULES if self.fsdp else RULES)

    @property
    def residual(self) -> tuple[str, str, str]:
        """Logical axes of the residual stream [B, T, D]: replicated over tp, or
        split along the sequence under SP (Korthikanti et al. 2022)."""
        return ("batch", "sp_seq" if self.sp else "seq", "embed")


def cp_order(T: int, cp: int, balance: bool = True) -> np.ndarray:
    """The original index of each position of a sequence of T tokens as it is
    placed over cp: rank r's contiguous T/cp are chunks r and 2cp-1-r of
    2cp chunks under causal load balance (the dual-chunk swap of
    Megatron-LM's context parallelism; "zigzag"), so that every rank's
    queries see as many keys; chunk r of cp without it. The identity at
    cp = 1. Batches are reordered by it once, when placed
    (`jaxtp.train.data.to_mesh`).

    >>> cp_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if cp == 1 or not balance:
        return np.arange(T)
    c = T // (2 * cp)
    chunks = [(r, 2 * cp - 1 - r) for r in range(cp)]
    return np.concatenate([np.arange(i * c, (i + 1) * c) for pair in chunks for i in pair])


def keep_axes(s: P, axes) -> P:
    """`s` naming only the mesh axes in `axes` (the others: not split)."""
    kept = [tuple(a for a in spec_axes(entry) if a in axes) for entry in s]
    return P(*(None if not k else k[0] if len(k) == 1 else k for k in kept))


def split_over_tp(s: P) -> bool:
    """Whether a PartitionSpec splits a dim over the tp axis."""
    return any(TP_AXIS in spec_axes(entry) for entry in s)


def make_mesh(dp: int = 1, tp: int = 1, devices=None, *, impl: str = "gspmd",
              cp: int = 1) -> Mesh:
    """`Layout.make(dp=dp, tp=tp, cp=cp, impl=impl).mesh(devices)`: a (dp, [cp,] tp) mesh
    for `impl`."""
    return Layout.make(dp=dp, tp=tp, cp=cp, impl=impl).mesh(devices)


def mesh_for(mesh: Mesh, impl: str) -> Mesh:
    """`mesh`'s devices as the mesh `impl` wants (its axis types)."""
    kind = AxisType.Explicit if impl == "explicit" else AxisType.Auto
    if all(t == kind for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(kind,) * len(mesh.axis_names))


def explicit_mesh() -> bool:
    """Whether the mesh in context has Explicit axes (sharding in types)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and explicit_axes(mesh)


def explicit_axes(mesh) -> bool:
    """Every axis Explicit, but those a shard_map in context is manual over."""
    return all(t == AxisType.Explicit for a, t in zip(mesh.axis_names, mesh.axis_types)
               if a not in mesh.manual_axes) and len(mesh.manual_axes) < len(mesh.axis_names)


def mesh_size(name: str) -> int:
    """Size of a mesh axis of the mesh in context (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(name, 1)


def cache_spec() -> P:
    """A KV cache [B, S, Kc, H]: batch over dp, its kv heads over tp."""
    return spec("batch", None, "kv_heads", None)


def named(mesh: Mesh, *logical: str | None) -> NamedSharding:
    return NamedSharding(mesh, keep_axes(spec(*logical), mesh.axis_names))


def in_region() -> bool:
    """True inside a shard_map manual over tp (per-shard arrays)."""
    return TP_AXIS in jax.sharding.get_abstract_mesh().manual_axes


def first_row(B: int):
    """The global index of the first of an array's B batch rows: 0 on global
    arrays, rank * B inside a shard_map manual over dp (where each rank holds
    its own rows: `jaxtp.train.step`'s slices)."""
    return jax.lax.axis_index(DATA_AXIS) * B if DATA_AXIS in manual_axes() else 0


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """Pin an activation's layout: a constraint for GSPMD, a `reshard` of its
    type on an Explicit mesh (where a constraint may only restate the type);
    a no-op inside shard_map or without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or in_region():
        return x
    if explicit_axes(mesh):
        return jax.sharding.reshard(x, spec(*logical))
    return jax.lax.with_sharding_constraint(x, spec(*logical))
