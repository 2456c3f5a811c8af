"""jaxtp against steps written without it: two independent plain-JAX GPT-2
steps (`peer`, `peer_alt`), a tuned one (`peer_alt` with custom VJPs), and,
where torch is importable, PyTorch eager (`torch_peer`). Each is timed
alternately with jaxtp's tiny step at tp=1 in one process."""

from __future__ import annotations

import jax
import numpy as np

from . import peer, peer_alt, torch_peer
from ..model.build import resolve_attention
from .cases import PAIRED, _case, _get
from .report import section
from .timing import paired_ratio, time_alternating


class Plain:
    """A (step, params, opt_state) triple from a peer's make_step, callable like a Run."""

    def __init__(self, name: str, made, tokens):
        self.name, (self.step, self.params, self.opt_state) = name, made
        self.tokens = tokens

    def __call__(self):
        self.params, self.opt_state, loss = self.step(self.params, self.opt_state, self.tokens)
        return jax.block_until_ready(loss)


def bench_peer(plan: dict, cache: dict) -> dict:
    """jaxtp's tiny train step at tp=1 against the plain-JAX peers."""
    run, cut = _get(plan, cache, "tiny", 1)
    cfg = run.cfg
    m = resolve_attention(cfg, jax.devices()[0]).model  # what auto ran
    tokens = jax.device_put(np.asarray(run.tokens), jax.devices()[0])
    plain = Plain("peer", peer.make_step(cfg), tokens)
    alt = Plain("peer_alt", peer_alt.make_step(cfg), tokens)
    tuned = Plain("peer_alt tuned", peer_alt.make_step(cfg, tuned=True), tokens)
    t = time_alternating([run, plain, alt, tuned], plan["warmup"], plan["steps"] + 2)
    ms = {k: float(np.median(v)) * 1e3 for k, v in t.items()}
    rows = []
    for num, den, what in ((run.name, "peer", "jaxtp / plain JAX (peer.py)"),
                           ("peer_alt", "peer", "second plain JAX (peer_alt.py) / peer.py"),
                           (run.name, "peer_alt tuned", "jaxtp / tuned plain JAX (peer_alt.py, "
                                                         "custom VJPs)")):
        ratio, lo, hi = paired_ratio(t, num, den)
        rows.append({"case": _case("tiny tp=1", cfg, cut), "measured": f"train step time, {what}",
                     "value": ratio, "unit": "ratio", "ratio_min": lo, "ratio_max": hi,
                     "ms": ms[num], "base_ms": ms[den]})
    return section("peer", "jaxtp against plain JAX GPT-2 steps of the same shape", PAIRED + [
        ("ms", "numerator ms (median)"), ("base_ms", "denominator ms (median)")], rows, [
        "peer.py: a dict of arrays, 2-D matmuls, causal attention in query blocks of 32 rows "
        "(keys past a block's end skipped) with an added finite mask, optax clip + AdamW; "
        "peer_alt.py, written independently: a flat dict, attention in 4 causal query chunks; "
        "tuned: the same with hand-written attention and LayerNorm backward passes",
        f"jaxtp attention: {m.attention} (block {m.attention_block}); jaxtp "
        "adds the guarded update, the vocab-parallel loss and its logged gradient norm",
        "timed alternately in one process; value: median over rounds of the paired ratio"])


def bench_torch_peer(plan: dict, cache: dict) -> dict:
    """jaxtp's tiny step at tp=1 against PyTorch eager, where torch imports."""
    run, cut = _get(plan, cache, "tiny", 1)
    columns = PAIRED + [("jaxtp_ms", "jaxtp ms (median)"), ("torch_ms", "PyTorch ms (median)"),
                        ("reason", "reason")]
    case = _case("tiny tp=1", run.cfg, cut)
    why = torch_peer.available()
    if why:
        return section("torch-peer", "jaxtp against PyTorch eager", columns, [
            {"case": case, "measured": "train step time, jaxtp / PyTorch", "value": None,
             "unit": "ratio", "ratio_min": None, "ratio_max": None, "jaxtp_ms": None,
             "torch_ms": None, "reason": why}], ["skipped: torch is not a dependency of jaxtp"])
    step = torch_peer.make_step(run.cfg)

    class Torch:
        name = "PyTorch eager"

        def __call__(self):
            return step()

    t = time_alternating([run, Torch()], plan["warmup"], plan["steps"] + 2)
    ratio, lo, hi = paired_ratio(t, run.name, Torch.name)
    rows = [{"case": case, "measured": "train step time, jaxtp / PyTorch", "value": ratio,
             "unit": "ratio", "ratio_min": lo, "ratio_max": hi,
             "jaxtp_ms": float(np.median(t[run.name])) * 1e3,
             "torch_ms": float(np.median(t[Torch.name])) * 1e3, "reason": None}]
    return section("torch-peer", "jaxtp against PyTorch eager", columns, rows, [
        f"{torch_peer.describe()}, fp32 "
        "(jaxtp/bench/torch_peer.py: the same GPT-2 shapes, init scheme and AdamW with "
        "global-norm clipping; attention by scaled_dot_product_attention)",
        "timed alternately in one process; < 1: jaxtp faster"])
