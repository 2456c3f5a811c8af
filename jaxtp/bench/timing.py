"""Train steps compiled side by side and timed alternately: the suite's clock."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from ..config import Config, ModelConfig, TrainConfig
from ..parallel import Schedule, make_mesh, named
from ..train.data import to_mesh
from ..train.state import decide, init_params, init_train_state
from ..train.step import compile_train_step, step_controls


@dataclasses.dataclass
class Run:
    """A compiled train step and its live state; calling it runs one step."""

    name: str
    cfg: Config
    mesh: Any
    step: Callable
    params: Any
    opt_state: Any
    tokens: Any
    compile_s: float
    key: Any
    controls: Any

    def __call__(self):
        with jax.set_mesh(self.mesh):
            self.params, self.opt_state, m = self.step(
                self.params, self.opt_state, self.tokens, self.key, self.controls)
        return jax.block_until_ready((self.params, self.opt_state, m))[2]


@functools.cache
def initial_values(model: ModelConfig, seed: int) -> dict:
    """A model's initial parameters as host arrays, drawn once on one device.
    They are the same in every layout (tests/model/test_transformer.py::
    test_init_is_the_same_in_every_layout), so each case of the suite places
    them (`place_params`) instead of compiling its own sharded init: 1-2 s a
    layout on 2 cores, a third of the quick suite's time."""
    _, params, _ = init_params(Config(model, TrainConfig(seed=seed)), make_mesh(1, 1))
    return nnx.to_pure_dict(jax.device_get(params))


def build(name: str, cfg: Config) -> Run:
    """`cfg`'s initial parameters on its own mesh, its train step compiled,
    a batch of random tokens placed (the step's time does not depend on
    their values)."""
    m, t = cfg.model, cfg.train
    _, layout, mesh = decide(cfg)
    # a pipeline's blocks are stacked, in model order as a scanned stack's; on
    # an accelerator the sharded init (a preset may fit only when split)
    stacked = dataclasses.replace(m, scan_layers=Schedule.of(cfg, layout).stacked)
    state = init_train_state(cfg, mesh, initial_values(stacked, t.seed) if
                             mesh.devices.flat[0].platform == "cpu" else None)
    t0 = time.perf_counter()
    step = compile_train_step(state, t.batch_size, m.seq_len)
    compile_s = time.perf_counter() - t0
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (t.batch_size, m.seq_len + 1))
    tokens = to_mesh(tokens.astype(np.int32), mesh, cfg.parallel.cp_balance)
    key, controls = jax.device_put((jax.random.key(0), step_controls()), named(mesh))
    return Run(name, cfg, mesh, step, state.params, state.opt_state, tokens, compile_s, key,
                controls)


def time_alternating(runs: list[Run], warmup: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each run, the runs interleaved step by step (order
    reversed every other round, so no run always follows the same one)."""
    for r in runs:
        for _ in range(warmup):
            r()
    times = {r.name: [] for r in runs}
    for i in range(steps):
        for r in (runs if i % 2 == 0 else runs[::-1]):
            t0 = time.perf_counter()
            r()
            times[r.name].append(time.perf_counter() - t0)
    return times


def paired_ratio(times: dict, run: str, base: str) -> tuple[float, float, float]:
    """(median, min, max) over rounds of time(run) / time(base), both timed in
    the same round: a paired ratio, immune to the machine slowing between rounds."""
    r = np.asarray(times[run]) / np.asarray(times[base])
    return float(np.median(r)), float(r.min()), float(r.max())
