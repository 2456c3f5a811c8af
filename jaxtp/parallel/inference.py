"""Inference regions per impl: a region that reads and extends a KV cache,
and the next token chosen over the vocab shards. Like `regions`, the model
supplies local math (`cached_region`, `sample`) and this decides how it
reaches the other tp ranks."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from .collectives import g
from .layout import DATA_AXIS, IMPL_AXIS, constrain
from .locals import GSPMD, ShardMap
from .regions import act_spec, run_sharded


def cached_region(module, x_BTD, k_BSKH, v_BSKH, pos_BT, prefill: bool):
    """`module.cached_region`: a region that reads and extends a KV cache
    (inference: no SP, no backward pass). The output is summed over tp (g);
    the caches stay split over tp by kv head (`cache_spec`)."""
    layout = module.layout
    spec = cache_spec()
    if layout.impl == "shard_map":
        local = ShardMap(layout)

        def fn(m, x, k, v, pos):
            y, k, v = m.cached_region(x, k, v, pos, prefill, local)
            return g(y), k, v

        return run_sharded(module, fn, x_BTD, k_BSKH, v_BSKH, pos_BT,
                           arg_specs=(act_spec(), spec, spec, act_spec()),
                           out_specs=(act_spec(), spec, spec))
    y, k_BSKH, v_BSKH = module.cached_region(x_BTD, k_BSKH, v_BSKH, pos_BT, prefill,
                                             GSPMD(layout))
    pin = lambda c: jax.lax.with_sharding_constraint(c, spec)
    return constrain(y, *layout.residual), pin(k_BSKH), pin(v_BSKH)


def vocab_sample(module, x_BD, key, *, temperature: float, top_k: int, top_p: float):
    """`module.sample(x, key, ..., local)`: the next token [B] of each row
    from vocab-sharded logits, with no rank holding all of them."""
    layout = module.layout
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    if layout.impl == "shard_map":
        local = ShardMap(layout)
        return run_sharded(module, lambda m, x, k: m.sample(x, k, local=local, **kw), x_BD,
                           key, arg_specs=(P(DATA_AXIS), P()), out_specs=P(DATA_AXIS))
    return module.sample(x_BD, key, local=GSPMD(layout), **kw)


def cache_spec() -> P:
    """A KV cache [B, S, Kc, H]: batch over dp, its kv heads over tp."""
    return P(DATA_AXIS, None, IMPL_AXIS, None)
