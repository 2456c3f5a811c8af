"""Mesh creation and the logical-axis -> mesh-axis rules.

Model code names logical axes ("embed", "mlp", "heads", ...); `RULES` maps them
to the two mesh axes `dp` and `tp`. Weights get their PartitionSpec at
construction from `spec(...)`, so changing this one table changes the layout
without touching the model.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("dp", "tp")

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


# FSDP-style: parameters (and so the optimizer state, which mirrors them) are
# also split over dp along their model dim. Only parameters: an activation's
# model dim stays whole, its batch is what dp splits.
FSDP_PARAM_RULES = {**RULES, "embed": "dp"}
_param_rules: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "jaxtp_param_rules", default=None)


@contextlib.contextmanager
def param_layout(fsdp: bool):
    """Parameters created inside take FSDP_PARAM_RULES if `fsdp`, else RULES."""
    token = _param_rules.set(FSDP_PARAM_RULES if fsdp else None)
    try:
        yield
    finally:
        _param_rules.reset(token)


def param_spec(*logical: str | None) -> P:
    """PartitionSpec of a parameter: `spec` under the current `param_layout`."""
    return spec(*logical, rules=_param_rules.get())


def tp_only(s: P) -> P:
    """The tp part of a PartitionSpec (what a shard_map manual over tp sees)."""
    return P(*(a if a == "tp" else None for a in s))


def make_mesh(dp: int = 1, tp: int = 1, devices=None) -> Mesh:
    """A (dp, tp) mesh with Auto axes, so GSPMD may insert collectives itself.

    jax.make_mesh defaults to Explicit axes, under which a row-parallel matmul
    needs an explicit out_sharding; the Megatron GSPMD path wants Auto.
    """
    devices = jax.devices() if devices is None else devices
    check_device_count(dp * tp, len(devices), devices[0].platform, dp=dp, tp=tp)
    return jax.make_mesh(
        (dp, tp), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices[: dp * tp],
    )


def check_device_count(needed: int, available: int, platform: str, *, dp: int, tp: int):
    if needed > available:
        hint = (
            "lower --tp/--dp" if platform == "cpu" else
            "lower --tp/--dp, or simulate on CPU with JAX_PLATFORMS=cpu"
        )
        raise ValueError(
            f"dp*tp = {dp}*{tp} = {needed} devices requested but this machine has "
            f"{available} {platform} device(s); {hint}"
        )


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


def mesh_axis_size(name: str) -> int:
    """Size of a mesh axis of the mesh in context (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(name, 1)


def residual_axes(sp: bool) -> tuple[str, str, str]:
    """Logical axes of the residual stream [B, T, D]: replicated over tp, or
    split along the sequence under sequence parallelism (Korthikanti et al. 2022)."""
    return ("batch", "sp_seq" if sp else "seq", "embed")


def named(mesh: Mesh, *logical: str | None) -> NamedSharding:
    return NamedSharding(mesh, spec(*logical))


def _tp_is_manual() -> bool:
    return "tp" in jax.sharding.get_abstract_mesh().manual_axes


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """Pin an activation's layout for GSPMD (no-op inside shard_map or without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or _tp_is_manual():
        return x
    return jax.lax.with_sharding_constraint(x, spec(*logical))


__all__ = ["MESH_AXES", "RULES", "FSDP_PARAM_RULES", "spec", "param_spec", "param_layout",
           "tp_only", "make_mesh", "ensure_devices", "named",
           "constrain", "check_device_count"]
