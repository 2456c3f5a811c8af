"""What generation starts from: a model placed at any tp (from a run's
checkpoint or a Hugging Face directory) and the tokenizer its data used."""

from __future__ import annotations

import codecs
import dataclasses
import json
from pathlib import Path

from ..config import INFERENCE_IMPLS, Config, ConfigError, ParallelConfig, validate


class ByteTokenizer:
    """Byte-level text (vocab 256): the built-in corpus and plain text files."""

    name = "bytes"
    eos: frozenset = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self):
        """A function of new token ids -> the text they complete (UTF-8 split
        across tokens is held back until whole)."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids: dec.decode(bytes(ids))


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` package.

    `eos`: the end-of-text id(s); default: an HF checkpoint's `eos_token_id`
    (its config.json beside the tokenizer). `special`: whether encoding adds
    the tokenizer's special tokens (an HF checkpoint's BOS; not for a run
    trained on a token file, whose text was encoded without them)."""

    def __init__(self, path: str | Path, eos=None, special: bool = True):
        from ..data import load_tokenizer

        self.tok, file = load_tokenizer(path, "tokenizer")
        self.name, self.special = str(file), special
        self.eos = frozenset(hf_eos(file.parent) if eos is None else eos)

    def encode(self, text: str) -> list[int]:
        try:
            return self.tok.encode(text, add_special_tokens=self.special).ids
        except Exception as e:  # the Rust binding raises a bare Exception
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"the tokenizer {self.name} cannot encode {text[:40]!r} "
                             f"({reason}): use a prompt of its vocabulary") from None

    def decoder(self):
        """New ids -> the text they add (decoding the whole sequence so far, as
        byte-level BPE pieces join only in context)."""
        ids, said = [], ""

        def more(new):
            nonlocal said
            ids.extend(new)
            text = self.tok.decode(ids)
            if text.endswith("\ufffd"):  # a character still split across tokens
                return ""
            out, said = text[len(said):], text
            return out
        return more


def hf_eos(directory: str | Path) -> list[int]:
    """An HF checkpoint's end-of-text id(s): its config.json's `eos_token_id`."""
    config = Path(directory) / "config.json"
    eos = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
    return eos if isinstance(eos, list) else [] if eos is None else [eos]


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
    from flax import nnx

    from ..parallel import make_mesh
    from ..train.checkpoint import Checkpointer
    from ..train.rundir import RunDir
    from ..train.state import abstract_train_state, resolve_attention

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


def run_tokenizer(run_dir: str | Path, vocab_size: int, eos=None):
    """The tokenizer a run's data was made with: its tokenizer.json (encoding
    without special tokens, as a token file's text was), bytes for a
    byte-level model, else None (token ids without a tokenizer)."""
    tok = Path(run_dir) / "tokenizer.json"
    return (HFTokenizer(tok, eos=eos or [], special=False) if tok.is_file() else
            ByteTokenizer() if vocab_size == 256 else None)


def from_hf(path: str | Path, tp: int = 1, impl: str = "gspmd", attention: str | None = None,
            tokenizer: str | Path | None = None):
    """(model, mesh, tokenizer) of a Hugging Face Llama directory, at `tp`;
    the tokenizer is the directory's, or `tokenizer` (a tokenizer.json)."""
    from ..hf import load_hf

    # before loading: a missing or unreadable one is refused at once
    tok = HFTokenizer(tokenizer, eos=hf_eos(path)) if tokenizer else HFTokenizer(path)
    model = load_hf(path, tp=tp, impl=impl, **({"attention": attention} if attention else {}))
    return model, model.mesh, tok


class LoopSampler:
    """A short greedy continuation of a fixed prompt from the parameters being
    trained (`train.sample_every`): one Generator, compiled once, fed the
    loop's current parameters each time."""

    def __init__(self, cfg: Config, mesh, prompt: list[int], run_dir: Path, new: int = 64):
        from flax import nnx

        from ..generate import Generator
        from ..train.state import abstract_model

        from ..parallel import mesh_for

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
        import jax
        from jax.sharding import NamedSharding

        if jax.tree.leaves(params)[0].sharding.mesh != self.mesh:  # the same devices
            params = jax.tree.map(
                lambda x: jax.device_put(x, NamedSharding(self.mesh, x.sharding.spec)), params)
        self.gen.params = params
        with jax.set_mesh(self.mesh):  # not the loop's, when that one is Explicit
            ids = self.gen.generate(self.prompts, self.new)[0]
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decoder()(ids)
