"""Generation at each tp: prefill time and decode tokens/s against tp=1, and
the KV cache's bytes per device against the analytic formula."""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from ..config import apply_overrides, load_config
from ..generate import Generator, cache_bytes_per_device
from ..generate.load import generation_config
from ..parallel import make_mesh
from ..train.data import builtin_corpus
from ..train.state import init_params
from .report import RATIO_COLUMNS, section


def _timed(gen: Generator, prompts, new: int, reps: int) -> tuple[float, float]:
    """(median prefill seconds, median decode tokens/s over the batch)."""
    B = len(prompts)
    prefill, rates = [], []
    for _ in range(reps + 1):  # the first compiles
        t0 = time.perf_counter()
        stream = gen.stream(prompts, new)
        next(stream)  # the prefill's token is on the host
        t1 = time.perf_counter()
        for _ in stream:
            pass
        prefill.append(t1 - t0)
        rates.append(B * (new - 1) / (time.perf_counter() - t1))
    return float(np.median(prefill[1:])), float(np.median(rates[1:]))


def bench_decode(plan: dict) -> dict:
    tps = [t for t in plan["tps"] if t <= jax.device_count()]
    B, P, new = plan["decode_batch"], plan["decode_prompt"], plan["decode_tokens"]
    text = builtin_corpus(B * P)
    prompts = [list(map(int, text[b * P:(b + 1) * P])) for b in range(B)]
    rows, base = [], None
    for tp in tps:
        cfg = generation_config(apply_overrides(load_config("tiny"), plan["small"]), tp,
                                "gspmd", "xla")
        mesh = make_mesh(1, tp)
        graphdef, params, _ = init_params(cfg, mesh)
        gen = Generator(nnx.merge(graphdef, params), mesh)
        prefill_s, tok_s = _timed(gen, prompts, new, plan["decode_reps"])
        with jax.set_mesh(mesh):
            k, v = gen.empty_cache(B, P + new)
        held = sum(s.data.nbytes for a in (k, v) for s in a.addressable_shards) / tp
        base = base or (prefill_s, tok_s)
        rows.append({"case": f"tiny tp={tp} (L={cfg.model.n_layers} B={B}, prompt {P}, {new} new)",
                     "measured": "decode tokens/s, against tp=1", "value": tok_s / base[1],
                     "unit": "ratio", "prefill_ms": prefill_s * 1e3,
                     "prefill_ratio": prefill_s / base[0], "decode_tok_s": tok_s,
                     "cache_bytes_per_device": held,
                     "formula_bytes": cache_bytes_per_device(cfg, B, P + new)})
    return section("decode", "Generation: prefill and decode against tp=1, KV cache bytes",
                   RATIO_COLUMNS + [("prefill_ms", "prefill ms"),
                                    ("prefill_ratio", "prefill vs tp=1"),
                                    ("decode_tok_s", "decode tok/s"),
                                    ("cache_bytes_per_device", "cache B/device"),
                                    ("formula_bytes", "2*L*B*S*max(K/tp,1)*H*bytes")], rows, [
        "one process; every decode step returns its tokens to the host (streaming), "
        "so a step's time includes that sync; medians of the repetitions after a compile",
        "the cache bytes are what the allocated k and v caches hold per device; the "
        "formula counts K/tp kv heads per device, or one when K < tp"])
