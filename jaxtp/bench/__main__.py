"""Run the benchmarks:

    python -m jaxtp.bench [--quick] [--out DIR] [--only impl,scaling,compile,...,loop]
    python -m jaxtp.bench --gpu [--gpu-config llama-1b] [--steps 40] [section.key=value ...]
    python -m jaxtp.bench --gpu-overlap [--gpu-config llama-1b] [--steps 20]

`--gpu` (`jaxtp.bench.gpu`, bench/gpu.sh) trains a preset on one accelerator
and reports absolute tokens/s, model TFLOP/s and MFU. `--gpu-overlap`
(`jaxtp.bench.gpu_overlap`), given 2 or more GPUs: GSPMD's overlap, its
logged iteration cap, its loops and its step time against none.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..parallel import ensure_devices
from . import suite
from .gpu import check_accelerator, gpu_bench, gpu_config
from .gpu_overlap import gpu_overlap
from .report import RESULTS_PAGE, header, readme_parts, splice_readme, write_report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__ + suite.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny preset, few steps (~1 min on CPU)")
    ap.add_argument("--out", help="output directory (default: runs/bench-<time>)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(suite.SECTIONS)}")
    ap.add_argument("--readme", metavar="PATH", nargs="?", const=RESULTS_PAGE,
                    help="also put bench.md into PATH between its bench:begin/end markers "
                         f"(without PATH: the results page, {RESULTS_PAGE})")
    ap.add_argument("--gpu", action="store_true",
                    help="train --gpu-config on one device at tp=1; tokens/s, TFLOP/s, MFU")
    ap.add_argument("--gpu-overlap", action="store_true",
                    help="given 2 or more devices: the SP step at tp <= 8 with GSPMD's overlap "
                         "against none (the logged cap, the loops XLA formed, the step times)")
    ap.add_argument("--gpu-config", default="llama-1b", help="preset for --gpu, --gpu-overlap")
    ap.add_argument("--steps", type=int, default=40, help="--gpu: timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="--gpu: untimed steps first")
    ap.add_argument("--peak-tflops", type=float,
                    help="--gpu: the device's peak TFLOP/s, where jaxtp does not know it")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value",
                    help="--gpu: config overrides after the preset's GPU defaults")
    args = ap.parse_intermixed_args(argv)  # overrides before or after flags
    out = args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}"
    try:  # bad arguments fail here, before anything is compiled
        only = suite.check_only(None if args.only is None else args.only.split(","))
        if args.readme:
            readme_parts(args.readme)  # the markers are there, before hours of benchmarks
        if args.overrides and not (args.gpu or args.gpu_overlap):
            raise ValueError("config overrides apply to --gpu and --gpu-overlap only")
        if args.gpu:
            cfg = gpu_config(args.gpu_config, args.overrides)
            check_accelerator(args.gpu_config)  # a CPU host: refused before compiling
    except (ValueError, OSError) as e:  # a ConfigError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.gpu:
        report = gpu_bench(cfg, args.steps, args.warmup, args.peak_tflops, args.gpu_config)
    elif args.gpu_overlap:
        print(ensure_devices(8))  # fake CPU devices where there is no accelerator (a dry run)
        try:
            report = gpu_overlap(args.gpu_config, args.steps, args.warmup, args.overrides)
        except ValueError as e:  # one device, or a ConfigError
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        print(ensure_devices(8))  # before JAX starts: the suite wants tp up to 8
        report = suite.run_suite(args.quick, only)
    print(f"\n{header(report['meta'])}")
    paths = write_report(report, out)
    print(f"wrote {paths[0]} and {paths[1]} ({report['meta']['wall_s']:.0f} s)")
    if args.readme:
        splice_readme(args.readme, paths[1].read_text())
        print(f"updated the results in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
