"""Every parameter of a config's model as the ledgers need it (`ParamShard`):
the elements one rank holds, whether FSDP splits it over dp, where it is
used; read from abstract shapes, nothing allocated."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from ..config import Config
from ..model import Transformer
from ..parallel import DATA_AXIS, spec_axes
from .rows import HLO_DTYPES, decided


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """One parameter as the ledgers need it: its path, the elements one rank
    holds of it over the axes other than dp, whether FSDP splits it over dp,
    where it is used."""

    path: str
    elements: int  # a stacked parameter's: all its layers'
    dp_split: bool
    in_stack: bool  # a block's (under a scanned stack: one layer per loop trip)
    # "column" (kernel or bias, and the per-head q/k norms' scales, applied to
    # the column-parallel q and k) / "row" kernel or "vocab" table: used inside
    # a region (shard_map gathers it there); "": on global arrays (norms,
    # row-parallel biases, positions)
    region: str
    # the MLP's down-projection bias: added last, its value feeds only the
    # block's output, so a remat's recompute never needs it
    block_output: bool


def param_shards(cfg: Config) -> list[ParamShard]:
    """Every parameter of `cfg`'s model as a `ParamShard`, from abstract shapes."""
    # Auto axes whatever the impl: shapes only, no contraction is typed
    layout, schedule = decided(cfg)
    layout = dataclasses.replace(layout, impl="gspmd")
    # a stack is built with the fewest layers it splits into and its
    # elements scaled: building every layer of a 405B model takes minutes
    # (flax reads each initial value's sharding, and under eval_shape JAX
    # builds an error message from the whole trace for each)
    L = cfg.model.n_layers
    # (the leading dense run, `moe_first_dense`, whole: it is no stack)
    S, lead = cfg.model.stacked_layers, L - cfg.model.stacked_layers
    L0 = schedule.stages * schedule.repeats * schedule.period if schedule.stacked else S
    model = dataclasses.replace(cfg.model, attention="xla", n_layers=lead + L0)  # shapes only
    with jax.sharding.use_abstract_mesh(layout.abstract_mesh()):
        params = nnx.state(nnx.eval_shape(
            lambda: Transformer(model, layout, rngs=nnx.Rngs(0), schedule=dataclasses.replace(
                schedule, layers=lead + L0))), nnx.Param)
    out = []
    flat = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, v in flat:
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        spec = v.get_metadata().get("out_sharding") or ()
        module, leaf = names[-2], names[-1]
        # a column-parallel bias is added inside the region; a row-parallel
        # one after g, outside it
        # (a MoE layer's experts run in their own region: up, down)
        region = ("vocab" if leaf == "embedding" and module in ("wte", "lm_head") else
                  "column" if module in ("q", "kv", "up", "q_norm", "k_norm") else
                  "row" if leaf == "kernel" and module in ("out", "down") else
                  {"up": "column", "down": "row"}.get(leaf, "") if module == "experts" else "")
        split = {a for e in spec for a in spec_axes(e)} - {DATA_AXIS}
        layers = S // L0 if names[0] == "blocks" else 1
        out.append(ParamShard(
            "/".join(names), int(np.prod(v.shape)) * layers // int(np.prod(
                [layout.sizes.get(a, 1) for a in split])),
            any(DATA_AXIS in spec_axes(e) for e in spec), names[0] == "blocks", region,
            module == "down" and leaf == "bias"))
    return out


def part_dtypes(cfg: Config, impl: str, path: str, sums: int) -> tuple[str, ...]:
    """The dtype each of a gradient's `sums` parts is summed in (module
    docstring): the compute dtype for a weight cast to it where it is used,
    else its own; a vocab table's head part is the compute dtype's under
    shard_map (summed in its region) but fp32 where GSPMD places the sum (on
    the head's fp32 dot, `jaxtp.model.vocab`). (Accumulated over slices reduced
    once, or over a pipeline's ticks, every gradient is in its own dtype: the
    rows of those sums say so.)"""
    m = cfg.model
    pd, cd = HLO_DTYPES[m.param_dtype], HLO_DTYPES[m.dtype]
    if path.endswith("/router_bias"):  # (kept wide, `jaxtp.model.moe.MoE`)
        return ("f64" if "float64" in (m.param_dtype, m.dtype) else "f32",) * sums
    if pd == cd:
        return (pd,) * sums
    module = path.split("/")[-2]
    if path in ("wte/embedding", "lm_head/embedding"):  # the lookup's, then the head's
        lookup = int(path == "wte/embedding")
        head = cd if impl == "shard_map" else pd
        return (pd,) * lookup + (head,) * (sums - lookup)
    own = module.startswith("ln") or "norm" in module or path.endswith("/router")
    return ((pd if own else cd),) * sums
