"""The expert-parallel ledger's all-to-alls (`jaxtp.model.moe` over an ep axis).

Per MoE layer and microbatch each rank routes the T_r = B/(dp*ep) * s tokens
of its G_r = B/(dp*ep) groups (sequences of s tokens). Its dispatch builds
every expert's slots for those groups, a buffer of E * G_r * C * D elements
(C = ceil(cf * s * k / E) slots per expert and group: about cf * T_r * k * D,
GShard's expert capacity, Lepikhin et al. 2020, Sec. 2.2; dropless, C = s:
E/k times cf = 1's). The buffer is resharded from the tokens' split (groups
over dp x ep) to the experts' (E over ep): one all-to-all over ep, which
keeps 1/ep of it and sends (ep-1)/ep; the combine brings the experts'
outputs back by the same all-to-all reversed. Forward: 2 all-to-alls
(dispatch, combine); backward: their transposes, 2 more (Fedus et al. 2021,
Switch, Sec. 2.2, counts the same two per layer).

On XLA:CPU (jax 0.10.2) an all-to-all is one instruction with one operand
per peer (`jaxtp.hlo` reads each as a collective of its own): a row here
counts ep operands of 1/ep of the buffer each.
"""

from __future__ import annotations

from ..config import Config
from ..model.moe import capacity
from ..parallel import EP_AXIS
from .rows import HLO_DTYPES, Expected


def slots(cfg: Config) -> int:
    """Elements of one rank's slot buffer per MoE layer and microbatch:
    E * G_r * C * D."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    groups = t.batch_size // (t.microbatches * p.pp * p.dp * p.ep)
    C = capacity(m.seq_len, m.moe_top_k, m.n_experts, m.capacity_factor)
    return m.n_experts * groups * C * m.d_model


def expected_ep(cfg: Config) -> list[Expected]:
    """The all-to-alls over ep, per MoE layer and microbatch (see the
    module docstring), as XLA:CPU's operands."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1 or not m.n_experts:
        return []
    part = slots(cfg) // p.ep
    E = lambda name, pass_: Expected(f"ep: {name}", "all-to-all", pass_, "moe", part,
                                     HLO_DTYPES[m.dtype], p.ep, 2 * p.ep, "ep", (EP_AXIS,),
                                     per="layer")
    return [E("dispatch and combine (the slots to their experts' ranks and back)", "forward"),
            E("their transposes (the slots' gradients back and forth)", "backward")]


def ring_bytes_per_layer(cfg: Config) -> float:
    """What one rank sends over ep per MoE layer and microbatch, forward and
    backward: 4 all-to-alls of (ep-1)/ep of its slot buffer."""
    p = cfg.parallel
    return 4 * slots(cfg) * (p.ep - 1) / p.ep * _bytes(cfg)


def _bytes(cfg: Config) -> int:
    import numpy as np

    return np.dtype(cfg.model.dtype).itemsize
