"""The mesh, the logical-axis rules, and the `Layout` of a run.

Model code names logical axes ("embed", "mlp", "heads", ...); `RULES` maps
them to the two mesh axes `dp` and `tp`. Weights get their PartitionSpec at
construction from `Layout.param_spec`, so changing a table changes the
layout without touching the model. `Layout` is everything the model needs
to know about parallelism, decided once from the config.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "dp"  # the axis data parallelism splits the batch over
IMPL_AXIS = "tp"  # the axis tensor parallelism splits
MESH_AXES = (DATA_AXIS, IMPL_AXIS)

# Megatron layout: the hidden dims of the MLP, the attention heads and the
# vocabulary are split over tp; the model dim and sequence stay whole on every
# tp rank; the batch is split over dp.
RULES: dict[str, str | None] = {
    "batch": "dp",
    "seq": None,
    "sp_seq": "tp",  # the residual stream's sequence under sequence parallelism
    "embed": None,
    "vocab": "tp",  # vocab-parallel embedding, LM head and cross-entropy
    "mlp": "tp",
    "heads": "tp",
    "kv_heads": "tp",  # when tp divides them; else the kv projection is replicated
    "head_dim": None,
}
# FSDP-style: parameters (and so the optimizer state, which mirrors them) are
# also split over dp along their model dim. Only parameters: an activation's
# model dim stays whole, its batch is what dp splits.
FSDP_PARAM_RULES = {**RULES, "embed": "dp"}


def spec(*logical: str | None, rules: dict[str, str | None] | None = None) -> P:
    """PartitionSpec for a tensor whose dims carry these logical names.

    >>> spec("embed", "mlp")
    PartitionSpec(None, 'tp')
    """
    rules = RULES if rules is None else rules
    axes = []
    for name in logical:
        if name is not None and name not in rules:
            raise KeyError(f"unknown logical axis {name!r}; known: {sorted(rules)}")
        axes.append(None if name is None else rules[name])
    used = [a for a in axes if a is not None]
    if len(used) != len(set(used)):
        raise ValueError(
            f"logical axes {logical} map two dims to the same mesh axis ({axes}); "
            "a tensor can be split over a mesh axis only once"
        )
    return P(*axes)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run is split, decided once from the config and handed to every
    module: the mesh shape, the implementation of the tp collectives, sequence
    parallelism (only where tp > 1) and its overlap with the matmuls, FSDP,
    and whether tp divides the kv heads
    (each rank holds K/tp of them) or not (the kv projection is replicated)."""

    dp: int = 1
    tp: int = 1
    # "gspmd": XLA places f and g; "shard_map": written out; "explicit": typed
    # shardings on a mesh of Explicit axes name each reduction
    impl: str = "gspmd"
    sp: bool = False
    fsdp: bool = False
    kv_sharded: bool = True
    # SP's entry all-gather and exit reduce-scatter overlapped with their
    # matmuls: collective-matmul rings (shard_map), XLA's windowed einsum
    # asked for (gspmd, explicit); only with sp
    overlap: bool = False

    @classmethod
    def of(cls, cfg) -> "Layout":
        """The layout of a `jaxtp.config.Config`."""
        p, m = cfg.parallel, cfg.model
        sp = p.sp and p.tp > 1
        return cls(dp=p.dp, tp=p.tp, impl=p.impl, sp=sp, fsdp=p.fsdp,
                   kv_sharded=m.kv_heads % p.tp == 0,
                   overlap=sp and p.overlap == "collective_matmul")

    def param_spec(self, *logical: str | None) -> P:
        """A parameter's PartitionSpec (FSDP also splits its "embed" dim over dp)."""
        return spec(*logical, rules=FSDP_PARAM_RULES if self.fsdp else RULES)

    @property
    def residual(self) -> tuple[str, str, str]:
        """Logical axes of the residual stream [B, T, D]: replicated over tp, or
        split along the sequence under SP (Korthikanti et al. 2022)."""
        return ("batch", "sp_seq" if self.sp else "seq", "embed")


def split_over_tp(s: P) -> bool:
    """Whether a PartitionSpec splits a dim over the tp axis."""
    return IMPL_AXIS in jax.tree.leaves(tuple(s))


def make_mesh(dp: int = 1, tp: int = 1, devices=None, *, impl: str = "gspmd") -> Mesh:
    """A (dp, tp) mesh for `impl`: Auto axes, so GSPMD may insert collectives
    itself (gspmd, and shard_map, which is manual inside its regions only), or
    Explicit axes for impl="explicit", where every array's type carries its
    sharding and an ambiguous contraction must name its `out_sharding`.

    jax.make_mesh defaults to Explicit axes; the Megatron GSPMD path wants Auto.
    """
    devices = jax.devices() if devices is None else devices
    check_device_count(dp * tp, len(devices), devices[0].platform, dp=dp, tp=tp)
    kind = AxisType.Explicit if impl == "explicit" else AxisType.Auto
    return jax.make_mesh((dp, tp), MESH_AXES, axis_types=(kind, kind),
                         devices=devices[: dp * tp])


def mesh_for(mesh: Mesh, impl: str) -> Mesh:
    """`mesh`'s devices as the mesh `impl` wants (its axis types)."""
    kind = AxisType.Explicit if impl == "explicit" else AxisType.Auto
    if all(t == kind for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(kind,) * len(mesh.axis_names))


def explicit_mesh() -> bool:
    """Whether the mesh in context has Explicit axes (sharding in types)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.are_all_axes_explicit


def check_device_count(needed: int, available: int, platform: str, *, dp: int, tp: int):
    if needed > available:
        hint = ("lower --tp/--dp" if platform == "cpu" else
                "lower --tp/--dp, or simulate on CPU with JAX_PLATFORMS=cpu")
        raise ValueError(
            f"dp*tp = {dp}*{tp} = {needed} devices requested but this machine has "
            f"{available} {platform} device(s); {hint}")


def ensure_devices(n: int) -> str:
    """Give a CPU-only process `n` fake CPU devices; call before JAX starts.

    On a GPU/TPU machine this changes nothing (the CPU client is not the default
    backend); `make_mesh` then checks the real device count. Returns a one-line
    description of what was done.
    """
    try:
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    except RuntimeError:
        pass  # backend already started (e.g. under pytest): keep what it has
    backend = jax.default_backend()
    count = jax.device_count()
    if backend == "cpu":
        return (f"no accelerator: using {count} CPU devices "
                f"(fake devices via jax_num_cpu_devices={count})")
    return f"using {count} {backend} device(s)"


def mesh_size(name: str) -> int:
    """Size of a mesh axis of the mesh in context (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(name, 1)


def named(mesh: Mesh, *logical: str | None) -> NamedSharding:
    return NamedSharding(mesh, spec(*logical))


def in_region() -> bool:
    """True inside a shard_map manual over tp (per-shard arrays)."""
    return IMPL_AXIS in jax.sharding.get_abstract_mesh().manual_axes


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """Pin an activation's layout: a constraint for GSPMD, a `reshard` of its
    type on an Explicit mesh (where a constraint may only restate the type);
    a no-op inside shard_map or without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or in_region():
        return x
    if mesh.are_all_axes_explicit:
        return jax.sharding.reshard(x, spec(*logical))
    return jax.lax.with_sharding_constraint(x, spec(*logical))
