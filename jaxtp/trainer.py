"""The training loop: data onto the mesh, jitted steps, logs and run files.

Every run writes into its output directory:
- `config.json`: the resolved config;
- `run.json`: the TP record (`jaxtp.comm.run_record`): mesh and device order,
  shapes, the layout of every linear, the collectives per layer read from the
  compiled step, and with `check=True` the comparison of step 1 against a
  single device;
- `metrics.jsonl`: one JSON object per logged step (`step`, `loss` = mean
  train loss since the previous log, `grad_norm` (pre-clip, this step), `lr`,
  `tokens_per_sec`, and `eval_loss` on evaluation steps).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from .comm import run_record
from .config import Config
from .data import Dataset, load_tokens, to_mesh
from .sharding import make_mesh
from .train_lib import (compile_train_step, init_train_state, lr_schedule, make_eval_step,
                        single_device_check)


def count_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def evaluate(eval_step, params, batches, mesh) -> float:
    losses = [eval_step(params, to_mesh(b, mesh)) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def train(cfg: Config, out_dir: str | Path, data_path: str | None = None,
          log: Callable[[str], None] = print, check: bool = False) -> dict:
    """Train `cfg` and return a summary; see the module docstring for the files."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    data = Dataset(load_tokens(data_path), m.seq_len, m.vocab_size)
    mesh = make_mesh(p.dp, p.tp)
    state = init_train_state(cfg, mesh)
    log(f"model: {count_params(state.params):,} params, {m.n_layers} layers, "
        f"d_model={m.d_model}, heads={m.n_heads}, d_ff={m.d_ff}, seq={m.seq_len} | "
        f"mesh dp={p.dp} x tp={p.tp}, impl={p.impl} | "
        f"data: {len(data.train):,} train / {len(data.val):,} val tokens")

    t0 = time.perf_counter()
    train_step = compile_train_step(state, t.batch_size, m.seq_len, use_dropout=m.dropout > 0)
    hlo_text = train_step.as_text()
    log(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
    eval_step = make_eval_step(state)
    eval_set = data.eval_batches(t.batch_size, t.eval_batches)
    schedule = lr_schedule(t)
    batches = data.train_batches(t.batch_size, t.seed)
    base_key = jax.random.key(t.seed)
    tokens_per_step = t.batch_size * m.seq_len

    params, opt_state = state.params, state.opt_state
    pending, history, rates, check_result = [], [], [], None
    first_loss = eval_loss = None
    t_start = time.perf_counter()
    t_last = None
    with open(out / "metrics.jsonl", "w") as f, jax.set_mesh(mesh):
        for step in range(1, t.steps + 1):
            tokens = to_mesh(next(batches), mesh)
            params, opt_state, metrics = train_step(
                params, opt_state, tokens, jax.random.fold_in(base_key, step))
            pending.append(metrics["loss"])
            if step == 1:
                first_loss = float(metrics["loss"])
                log(f"step 1: loss {first_loss:.4f}")
                if check:
                    check_result = single_device_check(
                        cfg, jax.device_get(tokens), jax.random.fold_in(base_key, 1),
                        first_loss, float(metrics["grad_norm"]), jax.device_get(params))
                    log("check against one device after step 1: " + ", ".join(
                        f"{k} {v:.2e}" for k, v in check_result.items()))
                t_last, pending, last_logged = time.perf_counter(), [], 1
                continue
            is_eval = step % t.eval_every == 0 or step == t.steps
            if step % t.log_every and not is_eval:
                continue
            loss = float(np.mean(jax.device_get(pending)))
            now = time.perf_counter()
            rate = tokens_per_step * (step - last_logged) / (now - t_last)
            rates.append(rate)
            row = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                   "lr": float(schedule(step - 1)), "tokens_per_sec": rate}
            if is_eval:
                eval_loss = row["eval_loss"] = evaluate(eval_step, params, eval_set, mesh)
            f.write(json.dumps(row) + "\n")
            f.flush()
            history.append(row)
            log(f"step {step:>5}/{t.steps} | loss {loss:.4f} | grad_norm "
                f"{row['grad_norm']:.3f} | lr {row['lr']:.2e} | {rate:,.0f} tok/s"
                + (f" | eval_loss {eval_loss:.4f}" if is_eval else ""))
            pending, last_logged = [], step
            t_last = time.perf_counter()  # eval time is not counted in tok/s

    record = run_record(cfg, mesh, state.model(), hlo_text, check_result)
    (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    summary = {
        "first_loss": first_loss,
        "final_loss": history[-1]["loss"] if history else first_loss,
        "final_eval_loss": eval_loss,
        "tokens_per_sec": float(np.median(rates)) if rates else None,
        "wall_s": time.perf_counter() - t_start,
        "out_dir": str(out),
    }
    log(f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, eval_loss "
        f"{eval_loss if eval_loss is None else round(eval_loss, 4)}, median "
        f"{summary['tokens_per_sec'] or 0:,.0f} tok/s, {summary['wall_s']:.0f}s; wrote {out}")
    return summary | {"params": params, "history": history}
