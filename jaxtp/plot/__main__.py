"""`python -m jaxtp.plot runs RUN_DIR... | experts RUN_DIR | bench BENCH_DIR`: figures as PNG
and SVG in --out, else next to their input (one run, a bench directory) or
in the current directory (several runs); each path written is printed. Exit status 2 without
matplotlib (with the install hint) or for a directory that holds no run or
report."""

from __future__ import annotations

import sys

from ..cli import Parser
from . import NoMatplotlib
from .bench import plot_bench
from .experts import has_loads, plot_experts
from .runs import plot_runs


def main(argv=None) -> int:
    ap = Parser(prog="python -m jaxtp.plot", description=__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    runs = sub.add_parser("runs", help="loss (against step and tokens), tokens/s and MFU of "
                          "training runs, overlaid")
    runs.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    experts = sub.add_parser("experts", help="a mixture of experts' load per layer and "
                             "expert (heat maps) and each layer's max violation against steps")
    experts.add_argument("run_dir", metavar="RUN_DIR")
    bench = sub.add_parser("bench", help="step time against tp, collective bandwidth against "
                           "payload, compile time against depth")
    bench.add_argument("bench_dir", metavar="BENCH_DIR")
    for p in (runs, experts, bench):
        p.add_argument("--out", help="directory for the figures (default: next to the input; "
                                     "several runs: the current directory)")
    args = ap.parse_args(argv)
    try:
        if args.what == "runs":
            paths = plot_runs(args.run_dirs, args.out)
            if len(args.run_dirs) == 1 and has_loads(args.run_dirs[0]):  # (a MoE run)
                paths += plot_experts(args.run_dirs[0], args.out)
        elif args.what == "experts":
            paths = plot_experts(args.run_dir, args.out)
        else:
            paths = plot_bench(args.bench_dir, args.out)
    except (NoMatplotlib, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
