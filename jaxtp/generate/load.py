"""What generation starts from: a model placed at any tp, from a run's
checkpoint or a Hugging Face directory (the tokenizers: `jaxtp.data.tokenizer`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flax import nnx

from ..config import INFERENCE_IMPLS, Config, ConfigError, ParallelConfig, validate
from ..data.tokenizer import HFTokenizer, hf_eos, run_tokenizer
from ..hf import load_hf
from ..parallel import make_mesh
from ..train.checkpoint import Checkpointer
from ..train.rundir import RunDir
from ..model.build import resolve_attention
from ..train.state import abstract_train_state


def generation_config(cfg: Config, tp: int | None, impl: str | None,
                      attention: str | None) -> Config:
    """A run's config as generation uses it: one dp rank, tp (default the
    run's), no SP or FSDP (the checkpoint reshards into this layout). A run
    trained under impl explicit generates under gspmd (`INFERENCE_IMPLS`)."""
    p = cfg.parallel
    model = dataclasses.replace(cfg.model, attention=attention or cfg.model.attention)
    impl = impl or (p.impl if p.impl in INFERENCE_IMPLS else "gspmd")
    if impl not in INFERENCE_IMPLS:
        raise ConfigError(f"generation runs under impl {' or '.join(INFERENCE_IMPLS)}, not "
                          f"{impl!r} (a run trained under explicit generates under gspmd)")
    return validate(Config(model, cfg.train, ParallelConfig(dp=1, tp=tp or p.tp, impl=impl)))


def from_run(run_dir: str | Path, tp: int | None = None, impl: str | None = None,
             step: int | None = None, attention: str | None = None, log=print):
    """(model, mesh, tokenizer) of a training run's checkpoint (the latest
    complete step, or `step`), at `tp`."""


    run = RunDir(run_dir)
    if not run.has_run():
        raise ConfigError(f"--run {run_dir}: no training run there (no config.json)")
    cfg = generation_config(run.config(), tp, impl, attention)
    mesh = make_mesh(1, cfg.parallel.tp)
    cfg = resolve_attention(cfg, mesh.devices.flat[0])
    target = abstract_train_state(cfg, mesh)
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", log=log)
    try:
        got, params, _, _ = ckpt.restore(target.params, target.opt_state,
                                         model=dataclasses.asdict(cfg.model), step=step)
    finally:
        ckpt.close()
    log(f"loaded {run_dir} step {got} at tp={cfg.parallel.tp} ({cfg.parallel.impl})")
    model = nnx.merge(target.graphdef, params)
    return model, mesh, run_tokenizer(run.path, cfg.model.vocab_size, run.launch().get("eos"))


def from_hf(path: str | Path, tp: int = 1, impl: str = "gspmd", attention: str | None = None,
            tokenizer: str | Path | None = None):
    """(model, mesh, tokenizer) of a Hugging Face directory (Llama, Mixtral,
    Qwen3-MoE), at `tp`; the tokenizer is the directory's, or `tokenizer` (a
    tokenizer.json)."""

    # before loading: a missing or unreadable one is refused at once
    tok = HFTokenizer(tokenizer, eos=hf_eos(path)) if tokenizer else HFTokenizer(path)
    model = load_hf(path, tp=tp, impl=impl, **({"attention": attention} if attention else {}))
    return model, model.mesh, tok
