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
    """jaxtp's tiny step against PyTorch eager's, where torch imports: at
    tp=1 on one device (a process of its own), at tp=1 among this process's
    8 fake devices, and the tp=8 step (the README's first command), each
    alternated with PyTorch's, `plan["rounds"]` rounds."""
    columns = PAIRED + [("jaxtp_tokens_per_s", "jaxtp tokens/s"),
                        ("torch_tokens_per_s", "PyTorch tokens/s"), ("reason", "reason")]
    why = torch_peer.available()
    rows = []
    for tp, where in ((1, "one device"), (1, "8 fake devices"), (8, "8 fake devices")):
        run, cut = _get(plan, cache, "tiny", tp)
        row = {"case": _case(f"tiny tp={tp}, {where}", run.cfg, cut),
               "measured": "tokens/s, jaxtp / PyTorch eager", "unit": "ratio",
               "value": None, "ratio_min": None, "ratio_max": None,
               "jaxtp_tokens_per_s": None, "torch_tokens_per_s": None, "reason": why}
        if why is None:
            got = (torch_peer.one_device(run.cfg, plan["warmup"], plan["rounds"])
                   if where == "one device" else
                   torch_peer.timed(run, run.cfg, plan["warmup"], plan["rounds"]))
            row.update(got)
        rows.append(row)
    notes = ["skipped: torch is not a dependency of jaxtp"] if why else [
        f"{torch_peer.describe()}, fp32 (jaxtp/bench/torch_peer.py: the same GPT-2 shapes, "
        "init scheme and AdamW with global-norm clipping; attention by "
        "scaled_dot_product_attention), the same batch of tokens",
        "alternated step by step in one process, the order reversed every other round; "
        "value: the median over rounds of the paired ratio of tokens/s; > 1: jaxtp faster",
        "tp=8 is the README's first command's step (8 fake CPU devices sharing the cores); "
        "PyTorch runs one process on all cores"]
    return section("torch-peer", "jaxtp against PyTorch eager", columns, rows, notes)
