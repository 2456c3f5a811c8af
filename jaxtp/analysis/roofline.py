"""The ledger against an independent reader of the same program:
`jax.experimental.roofline` walks the jaxpr of the shard_map step's loss and
gradient and prices every collective written in it per mesh axis
(`ici_bytes`), with the same per-rank ring conventions as the budget
(all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n of the buffer).

What it cannot see, or prices by another model, is named, each with its bytes
(`crosscheck`):
- collectives GSPMD places outside the regions (the loss mean over dp; norm,
  bias and position gradients summed over dp, or under SP over tp; FSDP's
  gathers and reduce-scatters of those parameters): no collective in the
  jaxpr, so the budget's rows with `written=False`;
- a max over tp (the loss's running max, `pmax`): priced as one scalar
  of its dtype, itemsize * (n-1), whatever its size;
- a sum over dp and tp at once: booked to each axis by its two-phase model
  (half the buffer per phase), 7/8 of the buffer on each at dp=2 x tp=4 for
  the ledger's 2(n-1)/n on dp+tp;
- a permute on an axis of 2 ranks (the ring of cp = 2, of tp = 2 under the
  collective-matmul overlap): its pairs (0, 1) and (1, 0) cross the one link
  between the two ranks, and the roofline counts pairs per link, not per
  direction (`_ppermute_roofline`'s contention): 2x the buffer, where each
  rank sends it once (the ledger's, and what the roofline's own all-gather
  at cp = 2 books for the same exchange); on a ring of 3 or more ranks
  every pair has a link of its own, 1x;
- an all-to-all (ep's dispatch and combine, `jaxtp.parallel.ep`): the
  roofline's model is a bisection one (`_all_to_all_roofline`: half of the
  group's n buffers cross a bisection of 2 links, 1 where n = 2), so n/4 of
  a rank's buffer (n/2 at n = 2) where the ledger books the (n-1)/n each
  rank sends;
- a ragged all-to-all (the dropless ragged path): jax 0.10.2's roofline
  has no rule for it and books nothing; of the offsets its transposes
  exchange, the jaxpr has one more per layer than the HLO;
- under FSDP a tied table is gathered in the lookup's region and in the
  head's, twice in the jaxpr; XLA merges the equal gathers (the ledger's one).
Every remaining byte must agree. A loop's body is read once (no trip count),
so the check takes one batch, an unscanned stack and no remat.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
from jax.experimental.roofline import roofline

from ..config import Config
from ..model.build import abstract_model
from ..parallel import batch_shape, batch_sharding, inputs_targets
from .budget import expected_collectives
from ..model.vocab import loss_chunks
from .rows import Expected, decided, schedule_of


def unsupported(cfg: Config) -> str | None:
    """Why the roofline cannot read this step whole, or None."""
    m = cfg.model
    chunks = loss_chunks(m.loss_chunk, schedule_of(cfg).head_rows,
                         m.seq_len // cfg.parallel.cp)[0]
    if cfg.train.microbatches > 1 or m.scan_layers or m.remat != "none" or chunks > 1:
        return ("jax.experimental.roofline reads a loop's body once (no trip count): the "
                "cross-check takes train.microbatches=1, an unscanned stack, remat none and "
                "the loss in one chunk")
    return None


def roofline_bytes(cfg: Config, mesh) -> dict[str, int]:
    """`ici_bytes` per mesh axis of the shard_map loss-and-gradient of `cfg`."""
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, impl="shard_map"))
    mesh = decided(cfg)[0].on(mesh)
    graphdef, abstract = abstract_model(cfg, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract, nnx.get_named_sharding(abstract, mesh))
    m = cfg.model
    tokens = jax.ShapeDtypeStruct(batch_shape(cfg.train.batch_size, m.seq_len, mesh), jnp.int32,
                                  sharding=batch_sharding(mesh))
    # the loss and gradients of one whole batch (the train step's, `jaxtp.train.step.loss_fn`)
    step = jax.jit(jax.value_and_grad(
        lambda p, t: nnx.merge(graphdef, p).loss(*inputs_targets(t))))
    # it warns (on the root logger) for each primitive it has no rule for:
    # axis_index, iota, ... (no traffic)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with jax.set_mesh(mesh):
            _, result = roofline(step, mesh)(params, tokens)
    finally:
        root.setLevel(level)
    return {a: int(v) for a, v in result.ici_bytes.items() if v}


def _roofline_price(e: Expected, sizes: dict[str, int]) -> dict[str, float]:
    """What the roofline books for one budget row, per axis, where its model
    differs from the ledger's ring (see the module docstring)."""
    if e.role_label == "cross-entropy":  # max, sum of exp, target logit: the max a scalar
        n, scalar = sizes["tp"], e.bytes // e.elements
        return {"tp": e.count * (2 / 3 * e.ring_bytes + scalar * (n - 1) / 3)}
    if e.kind == "collective-permute" and sizes[e.axes[0]] == 2:  # both pairs on one link
        return {e.axes[0]: e.count * 2 * e.ring_bytes}
    if e.kind == "ragged-all-to-all":  # (no roofline rule in jax 0.10.2: it books 0)
        return {}
    if e.kind == "all-to-all":  # a row's operands: 1/n of a rank's buffer each
        n = sizes[e.axes[0]]
        return {e.axes[0]: e.count * e.bytes * n / (2 * (2 if n > 2 else 1))}
    if len(e.axes) > 1:  # two phases, half the buffer each, booked to every axis
        shard, booked = e.bytes / math.prod(sizes[a] for a in e.axes) / len(e.axes), 0.0
        for a in sorted(e.axes, key=lambda a: sizes[a], reverse=True):
            booked += shard * (sizes[a] - 1)
            shard *= sizes[a]
        return {a: e.count * 2 * booked for a in e.axes}
    return {e.axes[0]: e.count * e.ring_bytes}


def crosscheck(cfg: Config, mesh) -> dict:
    """Per mesh axis: the roofline's bytes, the ledger's (all its rows, and
    those written in the jaxpr priced the roofline's way), the named
    differences, their ratio and whether they agree to the byte."""
    sizes = dict(mesh.shape)
    rows = [e for e in expected_collectives(
        dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, impl="shard_map")),
        "shard_map") if e.pass_ != "other"]  # the gradient norm is not in the gradient
    got = roofline_bytes(cfg, mesh)
    ledger: dict[str, float] = {}
    priced: dict[str, float] = {}
    unseen: dict[str, float] = {}
    for e in rows:
        key = "+".join(e.axes)
        ledger[key] = ledger.get(key, 0.0) + e.count * e.ring_bytes
        if not e.written:
            unseen[key] = unseen.get(key, 0.0) + e.count * e.ring_bytes
            continue
        for a, b in _roofline_price(e, sizes).items():
            priced[a] = priced.get(a, 0.0) + b
    m, p = cfg.model, cfg.parallel
    named_ = {}
    if p.fsdp and p.dp > 1 and m.tie_embeddings:
        # the lookup's and the head's regions each gather the tied table; XLA
        # merges the two equal gathers into one (the ledger's count)
        table = m.padded_vocab // p.tp * m.d_model * np.dtype(m.dtype).itemsize
        named_["tied table gathered in both regions (XLA merges the two)"] = (
            "dp", (p.dp - 1) / p.dp * table)
    if m.n_experts and m.moe_dispatch == "ragged" and p.ep > 1:
        # the jaxpr's transposes exchange 4 offset vectors [ep] per layer; XLA
        # computes one of them once with the forward's (`jaxtp.analysis.ep`)
        n = p.ep
        named_["a transpose's offsets, the forward's own (XLA computes it once)"] = (
            "ep", m.n_moe_layers * 4 * n * n / (2 * (2 if n > 2 else 1)))
    for a, b in named_.values():
        priced[a] = priced.get(a, 0.0) + b
    axes = sorted(set(got) | set(priced) | set(ledger))
    out = {}
    for a in axes:
        r, p_ = got.get(a, 0), priced.get(a, 0.0)
        out[a] = {"roofline": r, "ledger": ledger.get(a, 0.0),
                  "ledger_written_roofline_priced": p_,
                  "placed_by_gspmd": unseen.get(a, 0.0),
                  "ratio_roofline_to_ledger": r / ledger[a] if ledger.get(a) else None,
                  # a group over several axes: its bytes are checked on each of them
                  "agree": None if "+" in a else bool(abs(r - p_) < 1)}
    return {"axes": out, "named": {k: {"axis": a, "bytes": b} for k, (a, b) in named_.items()},
            "agree": all(v["agree"] is not False for v in out.values())}


def lines(check: dict) -> list[str]:
    """The cross-check as printed lines."""
    out = ["jax.experimental.roofline on the shard_map loss and gradient, per mesh axis "
           "(ring bytes per rank):"]
    for a, v in check["axes"].items():
        ratio = v["ratio_roofline_to_ledger"]
        if "+" in a:
            out.append(f"  {a}: ledger {v['ledger']:.0f} B, which the roofline books to each "
                       f"of {' and '.join(a.split('+'))} (its two-phase model)")
            continue
        # the two price some collectives by different models (an all-to-all,
        # a ring): the check is the ledger's rows priced the roofline's way
        same = ratio is None or abs(ratio - 1) < 1e-6
        verdict = ("DIFFER" if not v["agree"] else "agree" if same else
                   "agree, priced the roofline's way (the totals differ by model)")
        out.append(
            f"  {a}: roofline {v['roofline']:.0f} B, ledger {v['ledger']:.0f} B"
            + ("" if same else f" (ratio {ratio:.4f}: "
               f"{'differs by model' if v['agree'] else 'differ'})")
            + f"; GSPMD places {v['placed_by_gspmd']:.0f} B the jaxpr lacks; the rest priced "
            f"the roofline's way {v['ledger_written_roofline_priced']:.0f} B: {verdict}")
    for name, v in check["named"].items():
        out.append(f"  named on {v['axis']}: {name}, {v['bytes']:.0f} B")
    return out
