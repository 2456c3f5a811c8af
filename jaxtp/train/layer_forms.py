"""A checkpoint's blocks in either form: a list of L layers
(`['blocks'][i]`) or one stack of them [L, ...] (scanned, and always under
pp), or where the stack's unit is a group of k layers
(`jaxtp.model.block.Group`) k stacks [L/k, ...], position j
(`['blocks']['layers'][j]`) holding layers j, j + k, ... A step saved in
one form is read in that form, each layer whole over the stack's axis,
checked, then restacked or sliced into the form the model wants
(`jaxtp.train.checkpoint`)."""

from __future__ import annotations

import re
from typing import Callable

import jax
import jax.numpy as jnp

_LAYER = re.compile(r"\['blocks'\]\[(\d+)\]")
_POSITION = re.compile(r"\['blocks'\]\['layers'\]\[(\d+)\]")


def _period(names) -> int:
    """The layers of a stack's unit, read off its names (1: no groups)."""
    return 1 + max((int(m.group(1)) for n in names if (m := _POSITION.search(n))), default=0)


def _in_stack(name: str, m: re.Match, k: int) -> tuple[str, int]:
    """(the stacked name, the index on its leading axis) of list layer
    `m.group(1)`'s array `name`, in a stack of units of k layers."""
    i = int(m.group(1))
    unit = f"['layers'][{i % k}]" if k > 1 else ""
    return name[:m.start()] + "['blocks']" + unit + name[m.end():], i // k


def layer_plan(saved: dict, target: dict) -> tuple[dict, Callable]:
    """(what to read, how to turn it into `target`): the target itself, or,
    where the step holds the blocks in the other form (a list of layers
    `['blocks'][i]` against one stack `['blocks']` [L, ...], or the other
    way round), those arrays in the step's form, each layer whole over the
    stack's axis, then stacked or sliced and placed as the target's."""
    if all(name in saved for name in target):
        return target, lambda arrays: arrays
    layers: dict[str, list[str]] = {}  # a stacked name -> its per-layer names, in order
    k_target, k_saved = _period(target), _period(saved)
    for name in saved:
        m = _LAYER.search(name)
        if m:
            stacked, i = _in_stack(name, m, k_target)
            layers.setdefault(stacked, []).append((i, name))
    layers = {k: [n for _, n in sorted(v)] for k, v in layers.items()}
    read, built = {}, {}
    whole = lambda x, spec: jax.sharding.NamedSharding(x.sharding.mesh, spec)
    for name, x in target.items():
        if name in saved:
            read[name] = x
        elif name in layers:  # a stacked target from a list of layers
            rest = jax.sharding.PartitionSpec(*x.sharding.spec[1:])
            for n in layers[name]:
                read[n] = jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=whole(x, rest))
            built[name] = lambda a, x=x, names=layers[name]: jax.device_put(
                jnp.stack([a[n] for n in names]), x.sharding)
        elif (m := _LAYER.search(name)) and (
                unit := _in_stack(name, m, k_saved))[0] in saved:
            # a layer of a list target from a stack
            stacked, i = unit
            if stacked not in read:
                L = saved[stacked]["shape"][0]
                spec = jax.sharding.PartitionSpec(None, *x.sharding.spec)
                read[stacked] = jax.ShapeDtypeStruct((L, *x.shape), x.dtype,
                                                     sharding=whole(x, spec))
            built[name] = lambda a, x=x, i=i, n=stacked: jax.device_put(a[n][i], x.sharding)
        else:
            read[name] = x  # not in the step: `_check_arrays` names it
    return read, lambda arrays: {name: built[name](arrays) if name in built else arrays[name]
                                 for name in target}
