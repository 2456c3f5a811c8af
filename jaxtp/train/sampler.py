"""The loop's sample (`train.sample_every`): a short greedy continuation of
a fixed prompt from the parameters being trained, printed in the log."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import NamedSharding

from ..config import INFERENCE_IMPLS, Config
from ..data.tokenizer import run_tokenizer
from ..generate import Generator
from ..parallel import mesh_for
from ..model.build import abstract_model


class LoopSampler:
    """A short greedy continuation of a fixed prompt from the parameters being
    trained (`train.sample_every`): one Generator, compiled once, fed the
    loop's current parameters each time."""

    def __init__(self, cfg: Config, mesh, prompt: list[int], run_dir: Path, new: int = 64):
        parallel = cfg.parallel.without_sp()  # no SP: one token per step
        if parallel.impl not in INFERENCE_IMPLS:  # explicit: generated under gspmd
            parallel = dataclasses.replace(parallel, impl="gspmd")
        self.mesh = mesh_for(mesh, parallel.impl)
        graphdef, abstract = abstract_model(dataclasses.replace(cfg, parallel=parallel),
                                            self.mesh)
        self.gen = Generator(nnx.merge(graphdef, abstract), self.mesh)
        self.prompts = [prompt] * cfg.parallel.dp  # a row per dp rank
        self.new = min(new, cfg.model.seq_len - len(prompt))
        self.tokenizer = run_tokenizer(run_dir, cfg.model.vocab_size)

    def __call__(self, params) -> str:
        if jax.tree.leaves(params)[0].sharding.mesh != self.mesh:  # the same devices
            params = jax.tree.map(
                lambda x: jax.device_put(x, NamedSharding(self.mesh, x.sharding.spec)), params)
        self.gen.params = params
        with jax.set_mesh(self.mesh):  # not the loop's, when that one is Explicit
            ids = self.gen.generate(self.prompts, self.new)[0]
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decoder()(ids)
