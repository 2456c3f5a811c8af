"""Train a tensor-parallel Transformer: `python train.py --tp 8`.

A thin CLI over the `jaxtp` library. Any config field can be overridden with
`section.key=value` arguments, e.g. `python train.py --tp 4 model.n_layers=2`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from jaxtp.config import (IMPLS, Config, apply_overrides, load_config, preset_names,
                          validate)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny",
                    help=f"preset name ({', '.join(preset_names())}) or a .json path "
                         "(default: tiny)")
    ap.add_argument("--tp", type=int, help="tensor-parallel degree (mesh axis 'tp')")
    ap.add_argument("--dp", type=int, help="data-parallel degree (mesh axis 'dp')")
    ap.add_argument("--impl", choices=IMPLS,
                    help="gspmd: XLA inserts the collectives; shard_map: written out")
    ap.add_argument("--sp", action="store_true", default=None,
                    help="sequence parallelism: split the residual stream over tp along the "
                         "sequence (all-gather / reduce-scatter instead of all-reduce)")
    ap.add_argument("--steps", type=int, help="training steps")
    ap.add_argument("--seed", type=int, help="init, data and dropout seed")
    ap.add_argument("--out", help="output directory (default: runs/<config>-dp<dp>-tp<tp>-<time>)")
    ap.add_argument("--data", help="UTF-8 text file (byte-level) or .bin of uint16 token ids "
                                   "(default: the Python standard library's source)")
    ap.add_argument("--init-from-hf", metavar="PATH",
                    help="fine-tune a Hugging Face Llama checkpoint (save_pretrained dir); "
                         "its config.json replaces the model section, then overrides apply")
    ap.add_argument("--compare-hlo", action="store_true",
                    help="no training: compile the train step under gspmd and shard_map, "
                         "compare their collectives with the Megatron budget, write "
                         "comm_report.json and both HLO texts to --out; exit 1 on a deviation")
    ap.add_argument("--plan", action="store_true",
                    help="no training: compile the train step at tp in {1,2,4,8} (or --tp) on "
                         "abstract shapes and print per-device memory, collectives, flops, "
                         "redundancy and whether tp is compute- or communication-bound")
    ap.add_argument("--hardware", choices=["h100", "h200", "tpu-v5p"], default="h100",
                    help="accelerator for --plan's roofline (default: h100)")
    ap.add_argument("--check", action="store_true",
                    help="after step 1, replay it on one device and record loss, grad-norm "
                         "and parameter-update differences in run.json")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value",
                    help="config overrides, e.g. model.d_model=256 train.lr=1e-3")
    return ap.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    if args.init_from_hf:
        from jaxtp.convert import hf_model_config

        cfg = dataclasses.replace(cfg, model=hf_model_config(args.init_from_hf))
    flags = {"parallel.tp": args.tp, "parallel.dp": args.dp, "parallel.impl": args.impl,
             "parallel.sp": args.sp,
             "train.steps": args.steps, "train.seed": args.seed}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + args.overrides
    return validate(apply_overrides(cfg, overrides))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = resolve_config(args)
    except (ValueError, OSError, KeyError, ImportError) as e:  # ConfigError is a ValueError
        print(f"config error: {e}", file=sys.stderr)
        return 2
    import jax

    from jaxtp.manual import BF16_CPU_SHARD_MAP
    from jaxtp.sharding import ensure_devices

    p = cfg.parallel
    print(ensure_devices(p.dp * (max(p.tp, 8) if args.plan else p.tp)))  # before JAX starts
    uses_shard_map = p.impl == "shard_map" or args.compare_hlo
    if uses_shard_map and cfg.model.dtype == "bfloat16" and jax.default_backend() == "cpu":
        print(f"error: {BF16_CPU_SHARD_MAP}", file=sys.stderr)
        return 2
    out = args.out or (f"runs/{args.config.split('/')[-1].removesuffix('.json')}"
                       f"-dp{p.dp}-tp{p.tp}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        if args.plan:
            from jaxtp.plan import plan

            plan(cfg, [args.tp] if args.tp else [1, 2, 4, 8], args.hardware)
            return 0
        if args.compare_hlo:
            from jaxtp.comm import compare_hlo

            return 0 if compare_hlo(cfg, out)["ok"] else 1
        from jaxtp.trainer import train

        init = None
        if args.init_from_hf:
            from jaxtp.convert import read_hf

            init = read_hf(args.init_from_hf, **dataclasses.asdict(cfg.model))[1]
        train(cfg, out, data_path=args.data, check=args.check, init_params=init)
    except (ValueError, OSError, KeyError, ImportError) as e:  # before compiling
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
