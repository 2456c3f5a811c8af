"""The suite's building blocks: a preset as the bench runs it (reduced for
CPU), the tps it allows, a built case cached per layout, and a paired row
timing one case against another."""

from __future__ import annotations

import jax
import numpy as np

from ..config import Config, apply_overrides, load_config, validate
from .report import RATIO_COLUMNS
from .timing import build, paired_ratio, time_alternating

# A full GPT-2-small step (8 x 1024 tokens) takes minutes on a few CPU cores.
CPU_REDUCED = {"gpt2-small": ("model.n_layers=2", "train.batch_size=2", "model.seq_len=256")}
# a timed ratio, with the spread of its per-round values
PAIRED = RATIO_COLUMNS + [("ratio_min", "min ratio"), ("ratio_max", "max ratio")]


def preset(name: str, *overrides: str) -> tuple[Config, list[str]]:
    """(config, the CPU reductions applied): on CPU, CPU_REDUCED shrinks big presets."""
    cut = list(CPU_REDUCED.get(name, ())) if jax.default_backend() == "cpu" else []
    return validate(apply_overrides(load_config(name), cut + list(overrides))), cut


def _case(name: str, cfg: Config, cut: list[str]) -> str:
    m, t = cfg.model, cfg.train
    shape = f"L={m.n_layers} B={t.batch_size} T={m.seq_len}"
    return f"{name} ({shape}{', reduced for CPU' if cut else ''})"


def valid_tps(name: str, tps) -> tuple[list[int], list[str]]:
    """The tps (up to the device count) that the preset's sizes allow, and why the others
    are left out (GPT-2 small's 12 heads do not split over 8)."""
    ok, why = [], []
    for tp in tps:
        try:
            if tp > jax.device_count():
                raise ValueError(f"only {jax.device_count()} devices")
            preset(name, f"parallel.tp={tp}")
            ok.append(tp)
        except ValueError as e:  # ConfigError
            why.append(f"{name} tp={tp} left out: {str(e).split(';')[0]}")
    return ok, why


def _get(plan: dict, cache: dict, preset_name: str, tp: int, impl: str = "gspmd",
         sp: bool = False, overlap: str = "none", cp: int = 1, cp_attention: str = "allgather"):
    cp_text = f" cp={cp} {cp_attention}" if cp > 1 else ""
    key = (f"{preset_name} {impl}{cp_text} tp={tp}{' sp' if sp else ''}"
           f"{' ' + overlap if overlap != 'none' else ''}")
    if key not in cache:
        cfg, cut = preset(preset_name, f"parallel.tp={tp}", f"parallel.impl={impl}",
                          f"parallel.sp={str(sp).lower()}", f"parallel.overlap={overlap}",
                          f"parallel.cp={cp}", f"parallel.cp_attention={cp_attention}",
                          *plan["small"])
        cache[key] = (build(key, cfg), cut)
    return cache[key]


def _paired(plan: dict, base, run, base_ms: str, run_ms: str, **fields) -> dict:
    """A row timing `run` against `base` alternately: the paired ratio, its
    spread, and each one's median step time in ms (under `base_ms`, `run_ms`)."""
    t = time_alternating([base, run], plan["warmup"], plan["steps"])
    ratio, lo, hi = paired_ratio(t, run.name, base.name)
    return {"case": fields.pop("case"), "measured": fields.pop("measured"), "value": ratio,
            "unit": "ratio", "ratio_min": lo, "ratio_max": hi,
            base_ms: np.median(t[base.name]) * 1e3, run_ms: np.median(t[run.name]) * 1e3,
            **fields}
