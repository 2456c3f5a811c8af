"""The context-parallel ledger of a train step: the attention core's
collectives over cp (`jaxtp.parallel.context`), per layer and microbatch,
that `jaxtp.analysis.budget.expected_collectives` adds at cp > 1. (The
weight gradients' sums over dp x cp and the loss mean are the gradient
ledger's, `jaxtp.analysis.grads`; the tp rows are Megatron's on each rank's
s/cp positions, `jaxtp.analysis.budget`.)

Per layer, with b the rows of one dp rank per microbatch, s the sequence,
Kl the kv heads one tp rank holds and H the head dim, K and V travel as one
array of 2*b*(s/cp)*Kl*H elements per rank (only K heads: GQA moves K/N of
what the queries would):

- allgather (the Llama 3 paper's CP, Grattafiori et al. 2024, Sec. 3.3.2;
  Megatron-Core's `cp_comm_type=all_gather`): forward, one all-gather over
  cp whose result is the whole sequence's 2*b*s*Kl*H; backward, its
  transpose, one reduce-scatter of dK/dV to 2*b*(s/cp)*Kl*H; under remat
  "full", which keeps only the region outputs, the recomputed forward
  gathers again (the other policies keep the gathered K/V, "cp_kv").
  Ring bytes per rank: (cp-1)/cp of the gathered buffer each.
- ring (Liu et al. 2023, Ring Attention, Sec. 3; Megatron-Core's
  `cp_comm_type=p2p`): forward, cp-1 collective-permutes of one chunk; the
  backward pass, the reverse ring's cp-1 permutes of the dK/dV partial sums;
  under remat "full" the forward ring's cp-1 again (its received chunks are
  not kept). Each permute sends its whole buffer once per rank: the ring
  moves (cp-1)/cp of the K/V the all-gather does, the same bytes, in cp-1
  steps that can overlap the chunk pairs' attention.

Kl is K/tp where tp divides the kv heads; with fewer kv heads than tp
(the replicated kv projection) it is the one kv head a rank's queries use,
except under gspmd, whose layout repeats the kv heads once per query head
(`jaxtp.parallel.GSPMD.kv_for_heads`): its ranks send N/tp copies.
"""

from __future__ import annotations

import numpy as np

from ..config import Config
from ..parallel import CP_AXIS
from .rows import HLO_DTYPES, Expected, microbatch_rows


def kv_heads_per_rank(cfg: Config, impl: str) -> int:
    """The kv heads a tp rank's K/V hold as they travel over cp (Kl)."""
    m, tp = cfg.model, cfg.parallel.tp
    if m.kv_heads % tp == 0:
        return m.kv_heads // tp
    return m.n_heads // tp if impl == "gspmd" else 1


def expected_cp(cfg: Config, impl: str) -> list[Expected]:
    """The attention core's collectives over cp (see the module docstring)."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return []
    b = microbatch_rows(cfg)
    chunk = 2 * b * (m.seq_len // p.cp) * kv_heads_per_rank(cfg, impl) * m.head_dim
    again = m.remat == "full"  # the only policy that does not keep "cp_kv"
    dt = HLO_DTYPES[m.dtype]
    # counted per layer and microbatch (`jaxtp.analysis.rows.per_step`)
    E = lambda name, kind, pass_, elements, count, group=p.cp: Expected(
        "cp: " + name, kind, pass_, "attention", elements, dt, group, count, "cp",
        (CP_AXIS,), per="layer")
    if p.cp_attention == "allgather":
        rows = [E("K/V all-gathered over cp", "all-gather", "forward", chunk * p.cp, 1),
                E("dK/dV reduce-scattered over cp", "reduce-scatter", "backward", chunk, 1)]
        if again:
            rows.append(E("remat 'full': K/V all-gathered again for the backward",
                          "all-gather", "backward", chunk * p.cp, 1))
        return rows
    hops = p.cp - 1
    # a permute's source-target pairs span the whole mesh (each cp ring of it)
    rows = [E(f"K/V chunk passed {hops} hops around the cp ring", "collective-permute",
              "forward", chunk, hops, p.devices),
            E("dK/dV partial sums passed back around the reverse ring", "collective-permute",
              "backward", chunk, hops, p.devices)]
    if again:
        rows.append(E("remat 'full': the forward ring again for the backward",
                      "collective-permute", "backward", chunk, hops, p.devices))
    return rows


def cp_intensity(cfg: Config) -> float:
    """Attention flops per byte of K/V a rank receives over cp, per layer
    forward (MaxText's rule: it grows as s*N/(K*cp)). A rank's s/cp causal
    queries see s/2 keys on average over N/tp heads: 2*b*s^2*N*H/(cp*tp)
    flops (two matmuls); the all-gather (or the ring, the same bytes) brings
    (cp-1)/cp of the sequence's K and V, 2*b*s*Kl*H elements: the ratio is
    s*N/(tp*Kl*bytes*(cp-1)), s*N/(K*bytes*(cp-1)) where tp divides K (Kl as
    `jaxtp.analysis.cp.kv_heads_per_rank`: gspmd with K < tp sends N/tp). The
    cp traffic hides behind the attention while it exceeds C/W of the link
    cp crosses. inf at cp=1 (nothing moves)."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return float("inf")
    Kl = kv_heads_per_rank(cfg, p.impl)  # gspmd with K < tp sends N/tp copies
    return m.seq_len * m.n_heads / (p.tp * Kl * np.dtype(m.dtype).itemsize * (p.cp - 1))
