"""The training loop: data onto the mesh, jitted steps, logs and run files.

Every run writes into its output directory (which must not already hold a
run: nothing saved is overwritten):
- `config.json`: the resolved config;
- `metrics.jsonl`: one JSON object per logged step (step 1, then every
  `log_every`): `step`, `loss` (mean train loss since the previous row),
  `grad_norm` (pre-clip, this step), `lr` (this step's), `tokens_per_sec`
  (null for step 1, which includes compilation), and `eval_loss` on
  evaluation steps;
- `run.json`: the TP record (`jaxtp.record.run_record`): mesh and device order,
  shapes, the layout of every linear, the collectives per layer read from the
  compiled step, and with `check=True` the comparison against a single
  device after the first step that updates the parameters.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx

from .config import Config
from .data import Dataset, load_tokens, to_mesh
from .record import run_record
from .sharding import make_mesh
from .train_lib import (abstract_model, compile_train_step, init_train_state, lr_schedule,
                        make_eval_step, single_device_check)


def count_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def evaluate(eval_step, params, batches, mesh) -> float:
    losses = [eval_step(params, to_mesh(b, mesh)) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def prepare_out_dir(out_dir: str | Path) -> Path:
    """Create `out_dir`, refusing one that already holds a run."""
    out = Path(out_dir)
    taken = [n for n in ("metrics.jsonl", "config.json", "run.json") if (out / n).exists()]
    if taken:
        raise FileExistsError(f"--out {out} already holds a run ({', '.join(taken)}); "
                              "choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def train(cfg: Config, out_dir: str | Path, data_path: str | None = None,
          log: Callable[[str], None] = print, check: bool = False,
          init_params=None) -> dict:
    """Train `cfg` and return a summary; see the module docstring for the files.

    `init_params`: starting values (an nnx.State or nested dict, e.g. from
    `jaxtp.convert.read_hf`) instead of a fresh initialisation.
    """
    m, t, p = cfg.model, cfg.train, cfg.parallel
    data = Dataset(load_tokens(data_path), m.seq_len, m.vocab_size)  # fail before writing
    mesh = make_mesh(p.dp, p.tp)
    out = prepare_out_dir(out_dir)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    state = init_train_state(cfg, mesh, params=init_params)
    log(f"model: {m.style}, {count_params(state.params):,} params, {m.n_layers} layers, "
        f"d_model={m.d_model}, heads={m.n_heads}/{m.kv_heads} kv, d_ff={m.d_ff}, "
        f"seq={m.seq_len} | mesh dp={p.dp} x tp={p.tp}, impl={p.impl} | "
        f"data: {len(data.train):,} train / {len(data.val):,} val tokens")
    t0 = time.perf_counter()
    train_step = compile_train_step(state, t.batch_size, m.seq_len, use_dropout=m.dropout > 0)
    log(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
    structure = nnx.merge(*abstract_model(cfg, mesh))  # no buffers: step 1 donates them
    record = run_record(cfg, mesh, structure, train_step.as_text())

    eval_step = make_eval_step(state)
    eval_set = data.eval_batches(t.batch_size, t.eval_batches)
    schedule = lr_schedule(t)
    batches = data.train_batches(t.batch_size, t.seed)
    base_key = jax.random.key(t.seed)
    tokens_per_step = t.batch_size * m.seq_len

    params, opt_state = state.params, state.opt_state
    params0 = jax.device_get(params) if check else None
    # the check replays up to the first step that moves the parameters (step 1
    # runs at lr 0 when there is a warmup)
    check_at = next((s for s in range(1, t.steps + 1) if schedule(s - 1) > 0), t.steps)
    replay = []
    pending, history, rates = [], [], []
    eval_loss = None
    t_start = time.perf_counter()
    t_last, last_logged = t_start, 0
    with open(out / "metrics.jsonl", "w") as f, jax.set_mesh(mesh):
        for step in range(1, t.steps + 1):
            tokens = to_mesh(next(batches), mesh)
            key = jax.random.fold_in(base_key, step)
            params, opt_state, metrics = train_step(params, opt_state, tokens, key)
            pending.append(metrics["loss"])
            if check and step <= check_at:
                replay.append((jax.device_get(tokens), key))
            if check and step == check_at:
                record["check"] = single_device_check(
                    cfg, params0, *zip(*replay), float(metrics["loss"]),
                    float(metrics["grad_norm"]), jax.device_get(params))
                log(f"check against one device after step {step}: " + ", ".join(
                    f"{k} {v:.2e}" for k, v in record["check"].items() if k != "after_step"))
            is_eval = step % t.eval_every == 0 or step == t.steps
            if step > 1 and step % t.log_every and not is_eval:
                continue
            loss = float(np.mean(jax.device_get(pending)))
            now = time.perf_counter()
            rate = None if step == 1 else tokens_per_step * (step - last_logged) / (now - t_last)
            row = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                   "lr": float(schedule(step - 1)), "tokens_per_sec": rate}
            if is_eval:
                eval_loss = row["eval_loss"] = evaluate(eval_step, params, eval_set, mesh)
            f.write(json.dumps(row) + "\n")
            f.flush()
            history.append(row)
            if rate is not None:
                rates.append(rate)
            log(f"step {step:>5}/{t.steps} | loss {loss:.4f} | grad_norm "
                f"{row['grad_norm']:.3f} | lr {row['lr']:.2e} | "
                + (f"{rate:,.0f} tok/s" if rate else "first step")
                + (f" | eval_loss {eval_loss:.4f}" if is_eval else ""))
            pending, last_logged = [], step
            t_last = time.perf_counter()  # eval time is not counted in tok/s

    (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    summary = {
        "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"],
        "final_eval_loss": eval_loss,
        "tokens_per_sec": float(np.median(rates)) if rates else None,
        "wall_s": time.perf_counter() - t_start,
        "out_dir": str(out),
    }
    log(f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, eval_loss "
        f"{eval_loss:.4f}, median {summary['tokens_per_sec'] or 0:,.0f} tok/s, "
        f"{summary['wall_s']:.0f}s; wrote {out}")
    return summary | {"params": params, "history": history}

