"""The decode step's collectives against its budget (`generate.py --compare-hlo`).

One decode step moves one token per row through the model. Megatron's
budget for it is the forward half of training's at T = 1: per block 2
all-reduces of B x 1 x D (attention's g, the MLP's g), and one for the
vocab-parallel lookup; no backward pass. Choosing the token over the vocab
shards (greedy, or Gumbel-max at a temperature) adds B-sized reductions and
never gathers the [B, V] logits:
- shard_map (written out): a max of the B best scores (f32) and a min of
  the B token ids holding it (s32);
- GSPMD (from the [B, tp, V/tp] layout `jaxtp.parallel.GSPMD.vocab_argmax`
  pins): an all-gather of each shard's best score and its position, B x tp
  each, then an all-reduce of B ids for the chosen shard's position (XLA's
  select of the sharded dim).
top-k / top-p gather each shard's candidates instead; the budget covers the
greedy and temperature step.

A mixture of experts decodes at ep 1, dropless (`jaxtp.generate.engine`):
every rank holds every expert, tp inside each, so no all-to-all. The dense
dispatch gives each of the E experts one slot per row (C = the step's one
token), and the experts' g (row-parallel down projection) sums those slots:
E x B x 1 x D per layer, E/k times the k slots a token fills; the ragged
dispatch sums after the weighted combine, B x D, as the dense MLP's g.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import hlo
from ..config import INFERENCE_IMPLS, Config
from ..generate import Generator
from ..parallel import cache_spec, make_mesh, spec
from ..model.build import abstract_model
from .backends import widened
from .picture import format_table
from .rows import HLO_DTYPES, Expected, check


def decode_budget(cfg: Config, batch: int, impl: str) -> list[Expected]:
    m, tp, L = cfg.model, cfg.parallel.tp, cfg.model.n_layers
    if tp == 1:
        return []
    act, dt = batch * m.d_model, HLO_DTYPES[m.dtype]
    rows = [Expected("embed: g of the vocab-parallel lookup", "all-reduce", "other", "embed",
                     act, dt, tp, 1),
            Expected("attention: g", "all-reduce", "other", "attention", act, dt, tp, L),
            *_mlp_g(cfg, act, dt)]
    if impl == "shard_map":
        return widened(rows + [
            Expected("sample: max of the shards' best", "all-reduce", "other", "sample", batch,
                     "f32", tp, 1),
            Expected("sample: min of the ids holding it", "all-reduce", "other", "sample",
                     batch, "s32", tp, 1)], m.dtype)
    return widened(rows + [
        Expected("sample: each shard's best score", "all-gather", "other", "sample",
                 batch * tp, "f32", tp, 1),
        Expected("sample: each shard's best position", "all-gather", "other", "sample",
                 batch * tp, "s32", tp, 1),
        Expected("sample: the chosen shard's position", "all-reduce", "other",
                 "sample/take_along_axis", batch, "s32", tp, 1)], m.dtype)


def _mlp_g(cfg: Config, act: int, dt: str) -> list[Expected]:
    """The MLP's g, or a MoE layer's (its experts' or after the combine, and
    a shared expert's: a dense MLP's)."""
    m, tp = cfg.model, cfg.parallel.tp
    M = m.n_moe_layers  # (the others dense: `model.moe_every`)
    if not m.n_experts:
        return [Expected("mlp: g", "all-reduce", "other", "mlp", act, dt, tp, m.n_layers)]
    # the dense layers' MLPs, and a shared expert's in the MoE layers
    mlps = m.n_layers - M + (M if m.moe_shared_d_ff else 0)
    dense = [Expected("mlp: g", "all-reduce", "other", "mlp", act, dt, tp, mlps)] if mlps else []
    if m.moe_dispatch == "ragged":
        return dense + [Expected("moe: g after the combine", "all-reduce", "other", "moe", act,
                                 dt, tp, M)]
    return dense + [Expected("moe: the experts' g over their slots (E x B x 1 x D)",
                             "all-reduce", "other", "moe", m.n_experts * act, dt, tp, M)]


def decode_hlo(cfg: Config, batch: int, length: int) -> str:
    """The compiled decode step (greedy) of `cfg` on abstract parameters."""


    mesh = make_mesh(1, cfg.parallel.tp)
    graphdef, params = abstract_model(cfg, mesh)
    gen = Generator(nnx.merge(graphdef, params), mesh)
    with jax.set_mesh(mesh):
        k = jax.eval_shape(lambda: gen.empty_cache(batch, length))[0]
        cache = jax.ShapeDtypeStruct(k.shape, k.dtype,
                                     sharding=NamedSharding(mesh, P(None, *cache_spec())))
        rows = jax.ShapeDtypeStruct((batch,), jnp.int32,
                                    sharding=NamedSharding(mesh, spec("batch")))
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))
        return gen._decode.lower(gen.params, rows, rows, cache, cache, key).compile().as_text()


def compare_decode(cfg: Config, batch: int, length: int,
                   log: Callable[[str], None] = print) -> bool:
    """Print both impls' decode-step collectives against the budget; True if
    both match."""

    colls, expected, ok = {}, {}, True
    for impl in INFERENCE_IMPLS:
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, impl=impl))
        log(f"compiling the {impl} decode step (tp={c.parallel.tp}, batch {batch}, cache "
            f"{length}) ...")
        colls[impl] = hlo.collectives(decode_hlo(c, batch, length))
        expected[impl] = decode_budget(c, batch, impl)
        diff = check(colls[impl], expected[impl])
        ok &= diff is None
        expected[impl + " verdict"] = "matches budget" if diff is None else diff
    for line in format_table(colls, {i: expected[i] for i in INFERENCE_IMPLS}):
        log(line)
    m = cfg.model
    log(f"analytic (Megatron, one token per row): per block 2 all-reduces of B*1*D = "
        f"{batch}*{m.d_model}, {2 * m.n_layers + 1} with the lookup's")
    if m.n_experts and m.moe_dispatch != "ragged":
        log(f"mixture of experts at ep 1, dropless: each block's experts' g sums E*B*1*D = "
            f"{m.n_experts}*{batch}*{m.d_model} (one slot per expert per row)")
    for impl in INFERENCE_IMPLS:
        log(f"{impl}: {expected[impl + ' verdict']}")
    return ok
