"""Generate text from a trained run or a Hugging Face checkpoint, tensor-parallel:
`python generate.py --run runs/tiny-dp1-tp8-... --prompt "def "`.

A thin CLI over `jaxtp.generate`: the KV cache is split over tp by kv heads,
one prefill call fills it, then one jitted decode step per token; each token
is chosen over the vocab shards (greedy at --temperature 0), so tp changes no
token. Prompts of one batch are left-aligned (see jaxtp/generate/engine.py).
The text goes to stdout alone; what the tool says of its work (devices,
the checkpoint loaded) goes to stderr. Exit status: 0 done, 2 a usage or
input error, 130 stopped by Ctrl-C (the text so far is kept).
"""

from __future__ import annotations

# the library's heavy parts (JAX and all that uses it) are imported inside the
# functions that need them: --help and a usage error answer before JAX loads

import argparse
import signal
import sys
import threading
from pathlib import Path

from jaxtp.cli import Parser, positive
from jaxtp.config import ATTENTIONS, INFERENCE_IMPLS


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog="generate.py", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--run", metavar="DIR", help="a train.py run directory (any tp/dp)")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face Llama, Mixtral or Qwen3-MoE "
                                                 "directory (save_pretrained, with "
                                                 "tokenizer.json)")
    ap.add_argument("--step", type=int, help="--run: this checkpoint step (default: latest)")
    ap.add_argument("--prompt", action="append", default=[],
                    help="a prompt (repeat for a batch)")
    ap.add_argument("--prompts", metavar="FILE", help="a batch of prompts, one per line")
    ap.add_argument("--max-new-tokens", type=int, default=100, help="(default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="0: greedy (default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="keep the smallest set with this probability (1: off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    ap.add_argument("--tp", type=positive(int),
                    help="tensor-parallel degree (default: the run's; 1 for --hf)")
    ap.add_argument("--impl", choices=INFERENCE_IMPLS,
                    help="gspmd or shard_map (default: the run's; gspmd for a run trained "
                         "under explicit)")
    ap.add_argument("--attention", choices=ATTENTIONS, help="the prefill's attention kernel")
    ap.add_argument("--tokenizer", metavar="PATH",
                    help="tokenizer.json (or a directory holding one), where the run has none")
    ap.add_argument("--compare-hlo", action="store_true",
                    help="no generation: compile the decode step of --config (or --run) "
                         "under gspmd and shard_map and hold its collectives against the "
                         "budget; exit 1 on a deviation")
    ap.add_argument("--config", default="tiny",
                    help="--compare-hlo without --run: a preset or .json (default: tiny)")
    ap.add_argument("--batch", type=int, default=8, help="--compare-hlo: rows (default: 8)")
    return ap.parse_args(argv)


def compare(args) -> int:
    from jaxtp.config import load_config
    from jaxtp.generate.load import generation_config
    from jaxtp.parallel import ensure_devices
    from jaxtp.train.rundir import RunDir

    base = RunDir(args.run).config() if args.run else load_config(args.config)
    cfg = generation_config(base, args.tp or 8, None, args.attention)
    x64_for(cfg)
    print(ensure_devices(cfg.parallel.tp), file=sys.stderr)
    from jaxtp.analysis.decode import compare_decode

    return 0 if compare_decode(cfg, args.batch, cfg.model.seq_len) else 1


def prompts_of(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("give --prompt TEXT (repeatable) or --prompts FILE")
    return prompts


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.compare_hlo:
            return compare(args)
        if not (args.run or args.hf):
            raise ValueError("give --run DIR or --hf DIR (or --compare-hlo)")
        prompts = prompts_of(args)
        from jaxtp.generate import Generator, Sampling

        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
        tokenizer = tokenizer_of(args)  # before the checkpoint: a bad prompt is refused at once
        ids = [tokenizer.encode(p) for p in prompts]
        model, mesh = load(args)
        gen = Generator(model, mesh, sampling)
        if stream(gen, ids, prompts, tokenizer, args):
            raise KeyboardInterrupt
    except (ValueError, OSError, ImportError, KeyError, RuntimeError) as e:
        # ConfigError is a ValueError, CheckpointError a RuntimeError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped by Ctrl-C", file=sys.stderr)
        return 130
    return 0


def tokenizer_of(args):
    """--tokenizer, else the run's (or the HF directory's) tokenizer."""
    from jaxtp.data.tokenizer import HFTokenizer, hf_eos, run_tokenizer
    from jaxtp.train.rundir import RunDir

    if args.hf:
        # the checkpoint first: a wrong path is said as one, not as a missing tokenizer
        if not Path(args.hf).is_dir():
            raise FileNotFoundError(f"--hf {args.hf}: no such directory (expected a "
                                    "save_pretrained directory: config.json, *.safetensors)")
        if not (Path(args.hf) / "config.json").is_file():
            raise FileNotFoundError(f"--hf {args.hf} has no config.json (expected a "
                                    "save_pretrained directory)")
        return HFTokenizer(args.tokenizer or args.hf, eos=hf_eos(args.hf))
    run = RunDir(args.run)
    if not run.has_run():
        raise ValueError(f"--run {args.run}: no training run there (no config.json)")
    vocab = run.config().model.vocab_size
    tokenizer = (HFTokenizer(args.tokenizer) if args.tokenizer else
                 run_tokenizer(run.path, vocab, run.launch().get("eos")))
    if tokenizer is None:
        raise ValueError(f"the run's data has no tokenizer (token ids, vocab {vocab:,}): "
                         "pass --tokenizer PATH")
    return tokenizer


def x64_for(cfg) -> None:
    """A --float64 run's (or config's) weights and decode step need
    jax_enable_x64, turned on before any array is made."""
    if cfg is not None and cfg.model.dtype == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)


def load(args):
    """(model, mesh) at --tp (default: the run's; 1 for --hf)."""
    from jaxtp.generate.load import from_hf, from_run
    from jaxtp.parallel import ensure_devices
    from jaxtp.train.rundir import RunDir

    cfg = None if args.hf else RunDir(args.run).config()
    tp = args.tp or (1 if args.hf else cfg.parallel.tp)
    x64_for(cfg)
    print(ensure_devices(tp), file=sys.stderr)
    if args.hf:
        return from_hf(args.hf, tp, args.impl or "gspmd", args.attention,
                       tokenizer=args.tokenizer)[:2]
    return from_run(args.run, tp, args.impl, args.step, args.attention,
                    log=lambda line: print(line, file=sys.stderr))[:2]


def stream(gen, ids, prompts, tokenizer, args) -> bool:
    """Print each prompt's completion; a single prompt as its tokens come.
    Ctrl-C ends it with the text so far printed, and returns True. The
    signal sets a flag read after each token: a KeyboardInterrupt raised
    where it lands could fall in a callback that swallows it (JAX's gc
    callback does) and the run would go on to the end."""
    decoders = [tokenizer.decoder() for _ in prompts]
    texts = ["" for _ in prompts]
    done = [False] * len(prompts)
    stopped = []
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, lambda *_: stopped.append(1)) if main else None
    try:
        for i, toks in enumerate(gen.stream(ids, args.max_new_tokens, seed=args.seed,
                                            eos=tokenizer.eos)):
            if i == 0 and len(prompts) == 1:  # once the request is accepted
                print(prompts[0], end="", flush=True)
            for b, t in enumerate(toks):
                if done[b]:
                    continue
                done[b] = int(t) in tokenizer.eos
                # at the end of text, bytes of a character still split come
                # out as U+FFFD (as a whole decode prints them)
                piece = decoders[b]([], final=True) if done[b] else decoders[b]([int(t)])
                texts[b] += piece
                if len(prompts) == 1:
                    print(piece, end="", flush=True)
            if stopped:
                break
    finally:  # done, or stopped: what was generated is printed
        if main:
            signal.signal(signal.SIGINT, before)
        for b in range(len(prompts)):
            if not done[b]:  # the last token's bytes of a split character
                piece = decoders[b]([], final=True)
                texts[b] += piece
                if len(prompts) == 1:
                    print(piece, end="", flush=True)
        if len(prompts) == 1:
            print(flush=True)
        else:
            for p, t in zip(prompts, texts):
                print(f"--- {p!r}\n{p}{t}", flush=True)
    return bool(stopped)


if __name__ == "__main__":
    sys.exit(main())
