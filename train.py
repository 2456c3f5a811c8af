"""Train a tensor-parallel Transformer: `python train.py --tp 8`.

A thin CLI over the `jaxtp` library. Any config field can be overridden with
`section.key=value` arguments anywhere on the command line, e.g.
`python train.py model.n_layers=2 --tp 4 train.lr=1e-3`.
`python train.py --resume --out DIR` starts or continues the run in DIR with
its own config: the one command a job that may be requeued needs.

The run's log (its description, compile time, one line per logged step)
goes to stdout; warnings, errors and where a stopped run stands go to stderr.

Exit status: 0 done (or stopped at --until), 1 the run failed (too many
skipped steps, no usable checkpoint, a budget deviation, processes that never
arrived), 2 a usage, config or data error (before anything is written),
3 a file of the run could not be written (a checkpoint, the metrics: disk
full, file system error; the checkpoints before it are intact), 128+N stopped by signal N (130 SIGINT,
143 SIGTERM; resumable once the run has started).
"""

from __future__ import annotations

# the library's heavy parts (JAX and all that uses it) are imported inside the
# functions that need them: --help and a usage error answer before JAX loads

import argparse
import dataclasses
import functools
import os
import signal
import sys
import threading
import time

from jaxtp.axes import AXES
from jaxtp.cli import FLAG_KEYS, Parser, positive
from jaxtp.config import (ATTENTIONS, COORDINATOR_TIMEOUT_S, CP_STRATEGIES, IMPLS, OVERLAPS,
                          PP_SCHEDULES, REMATS, Config, ConfigError,
                          apply_overrides, load_config, preset_names, validate)
from jaxtp.checks import check_asked
from jaxtp.hardware import HARDWARE, TARGET_NAMES
from jaxtp.train.rundir import RunDir

EXIT_FAILED, EXIT_USAGE, EXIT_SAVE = 1, 2, 3


def _steps(text: str) -> set[int]:
    try:
        return {int(s) for s in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected step numbers like 3 or 3,7")


def _layout_flags(ap) -> None:
    group = ap.add_argument_group("the model and its layout",
                                  "what is trained and how it is split")
    group.add_argument("--config",
                       help=f"preset name ({', '.join(preset_names())}) or a .json path "
                            "(default: tiny; with --resume: the run's own config)")
    group.add_argument("--tp", type=int, help="tensor-parallel degree (mesh axis 'tp')")
    group.add_argument("--dp", type=int, help="data-parallel degree (mesh axis 'dp')")
    group.add_argument("--ep", type=int,
                       help="expert-parallel degree (mesh axis 'ep', between dp and cp), with "
                            "model.n_experts: each rank holds n_experts/ep experts; the batch "
                            "is split over dp x ep (tokens reach their experts by all-to-alls)")
    group.add_argument("--pp", type=int,
                       help="pipeline-parallel degree (mesh axis 'pp', the outermost): the "
                            "layers split evenly over pp stages, the batch run through them in "
                            "train.microbatches microbatches (default with --pp N: 2N, or N where the batch does not split so)")
    group.add_argument("--pp-schedule", choices=PP_SCHEDULES,
                       help="with --pp: how the stages run the microbatches (gpipe: all "
                            "forwards, then all backwards, M + pp - 1 ticks each; circular: "
                            "each stage holds --pp-repeats v chunks of layers, v*M + pp - 1 "
                            "ticks of 1/v the work; 1f1b: each backward as soon as its "
                            "gradient arrives, M + 2pp - 2 ticks, a steady one a forward and "
                            "a backward, GPipe's compiled FLOPs, 2pp - 1 microbatches in "
                            "flight; interleaved: circular's chunks in 1f1b's order, M a "
                            "multiple of pp; zb: 1f1b's table (interleaved's at --pp-repeats "
                            "2+) with each backward split in two, the weights' gradients "
                            "never computed on dropped data; parallel.pp_stash=inputs: keep "
                            "a stage's input alone, its forward run again)")
    group.add_argument("--pp-repeats", type=int,
                       help="with --pp-schedule circular or interleaved: the chunks of layers "
                            "per stage, v >= 2 (zb: any v >= 1) (the layers split over pp*v "
                            "chunks; stage r holds chunks r, r+pp, ...)")
    group.add_argument("--cp", type=int,
                       help="context-parallel degree (mesh axis 'cp', between dp and tp): the "
                            "sequence split over it for the whole model (with the causal load "
                            "balance; parallel.cp_balance=false turns it off)")
    group.add_argument("--cp-attention", choices=CP_STRATEGIES,
                       help="with --cp: allgather (K/V all-gathered over cp per layer) or ring "
                            "(K/V chunks passed cp-1 hops, merged by log-sum-exp)")
    group.add_argument("--impl", choices=IMPLS,
                       help="gspmd: XLA inserts the collectives; shard_map: written out; "
                            "explicit: sharding in types (Explicit mesh axes)")
    group.add_argument("--sp", action="store_true", default=None,
                       help="sequence parallelism: split the residual stream over tp along the "
                            "sequence (all-gather / reduce-scatter instead of all-reduce)")
    group.add_argument("--overlap", choices=OVERLAPS,
                       help="with --sp: collective_matmul overlaps each region's all-gather and "
                            "reduce-scatter with its matmuls (shard_map: ppermute rings; gspmd "
                            "and explicit: dots XLA's windowed einsum can loop, which it does on "
                            "a GPU client, on CPU only past 100000 MiB); collective_matmul_bidi: "
                            "shard_map's rings sending half of each step each way")
    group.add_argument("--fsdp", action="store_true", default=None,
                       help="also split parameters and optimizer state over dp (FSDP-style)")
    group.add_argument("--capacity-factor", type=float, metavar="CF",
                       help="a mixture of experts' slots per expert: ceil(CF x tokens x top_k "
                            "/ n_experts) per sequence, later assignments dropped; 0: dropless "
                            "(the same result at every layout, as --sp and --cp need)")
    group.add_argument("--microbatches", type=int,
                       help="gradient accumulation: run the batch in this many sequential slices")
    group.add_argument("--bf16", action="store_true",
                       help="mixed precision: bf16 compute, fp32 master weights and optimizer "
                            "state, fp32 loss/softmax (sets model.dtype=bfloat16)")
    group.add_argument("--float64", action="store_true",
                       help="verification mode: float64 weights, compute, softmax and sums "
                            "under jax_enable_x64 (sets model.dtype and model.param_dtype="
                            "float64), so two layouts' losses agree to rounding (~1e-14) "
                            "where fp32's part at the first flipped top-k routing choice")
    group.add_argument("--scan", action="store_true", default=None,
                       help="the blocks as one scan over stacked parameters (compile time "
                            "independent of depth)")
    group.add_argument("--remat", choices=REMATS,
                       help="what each block keeps for the backward pass: none (everything), "
                            "full (only the block input and the reduced region outputs), dots "
                            "(the weight-matmul outputs), minimal (q/k/v, MLP up and the region "
                            "outputs; recompute norms, activations and the attention core)")
    group.add_argument("--attention", choices=ATTENTIONS,
                       help="attention kernel: auto (default: cudnn on NVIDIA GPUs in bf16, else "
                            "blockwise for long sequences, else xla), xla (einsum/softmax), "
                            "blockwise (memory-efficient exact, plain JAX), cudnn (flash "
                            "attention, NVIDIA GPUs)")
    group.add_argument("overrides", nargs="*", metavar="section.key=value",
                       help="config overrides, anywhere on the command line, e.g. "
                            "model.d_model=256 train.lr=1e-3")


def _run_flags(ap) -> None:
    group = ap.add_argument_group("the run", "steps, data, checkpoints and drills")
    group.add_argument("--steps", type=int, help="training steps")
    group.add_argument("--seed", type=int, help="init, data and dropout seed")
    group.add_argument("--out",
                       help="output directory (default: runs/<config>-dp<dp>-tp<tp>-<time>)")
    group.add_argument("--data", help="UTF-8 text file (byte-level), token file (python -m "
                                      "jaxtp.data prepare) or .bin of uint16 token ids (default: "
                                      "the Python standard library's source; with --resume: the "
                                      "run's, recognised by content)")
    group.add_argument("--resume", action="store_true",
                       help="start or continue the run in --out with its config: from its latest "
                            "complete checkpoint (at any tp/dp), from step 0 if it has none, or "
                            "as a new run if --out holds none. Flags may change only the layout, "
                            "remat/attention, logging, checkpointing and --steps")
    group.add_argument("--until", type=int, metavar="STEP",
                       help="stop with a checkpoint after this step (the schedule still spans "
                            "--steps); continue later with --resume")
    group.add_argument("--checkpoint-every", type=int, metavar="N",
                       help="save a checkpoint every N steps, 0: never (always: every "
                            "train.checkpoint_minutes, at the end, at --until and on "
                            "SIGTERM/SIGINT)")
    group.add_argument("--inject-nan-at", type=_steps, default=(), metavar="STEP[,STEP...]",
                       help="fault drill: make the gradients of these steps NaN (they are "
                            "skipped and logged)")
    group.add_argument("--peak-tflops", type=positive(float),
                       help="per-device peak TFLOP/s for MFU, where the device is not known")
    group.add_argument("--tensorboard", action="store_true",
                       help="also write TensorBoard scalars to --out/tensorboard (needs "
                            "tensorboardX: pip install -e '.[tensorboard]')")
    group.add_argument("--init-from-hf", metavar="PATH",
                       help="fine-tune a Hugging Face Llama, Mixtral or Qwen3-MoE checkpoint "
                            "(save_pretrained dir); its config.json replaces the model section, "
                            "then overrides apply")


def _cluster_flags(ap) -> None:
    group = ap.add_argument_group("several processes", "a multi-process job (jax.distributed)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="multi-process: process 0's address (else JAX_COORDINATOR_ADDRESS "
                            "or a launcher such as srun/mpirun)")
    group.add_argument("--num-processes", type=int, help="multi-process: how many")
    group.add_argument("--process-id", type=int, help="multi-process: this one (0..n-1)")
    group.add_argument("--coordinator-timeout", type=positive(float), default=COORDINATOR_TIMEOUT_S,
                       metavar="SECONDS",
                       help="multi-process: how long to wait for every process to arrive "
                            "(default: %(default)s)")
    group.add_argument("--local-devices", type=int,
                       help="CPU only: fake devices per process (default: enough for dp*cp*tp "
                            "in one process)")


def _analysis_flags(ap) -> None:
    group = ap.add_argument_group("no training",
                                  "compile and inspect instead, or check against one device")
    group.add_argument("--compare-hlo", action="store_true",
                       help="no training: compile the train step under gspmd, shard_map and "
                            "explicit, compare their collectives with the budget per mesh axis "
                            "(Megatron's over tp; dp, FSDP, microbatches over dp) and the "
                            "shard_map step with jax.experimental.roofline, write "
                            "comm_report.json, collectives.svg and the HLO texts to --out; exit "
                            "1 on a deviation")
    group.add_argument("--plan", action="store_true",
                       help="no training: compile the train step at tp in {1,2,4,8} (or --tp; "
                            "with --cp N (--pp N) at cp (pp) = 1, the powers of two below N, "
                            "and N, at one tp; a degree the model does not split into is "
                            "skipped, saying why; under --pp every number is a stage's; with "
                            "--ep N at ep over the same degrees on N x tp devices, tp taking "
                            "what ep leaves) on abstract shapes and "
                            "print per-device memory, collectives, flops, redundancy, whether tp "
                            "is compute- or communication-bound and, under cp, the cp roofline")
    group.add_argument("--hardware", choices=TARGET_NAMES,
                       help="--plan and --compare-hlo: compile for this accelerator without "
                            "having it, where its compiler is installed (jax[cuda12] or "
                            "jax[tpu]), else plan on CPU; --plan's memory verdict and roofline "
                            "use it (default: h100, planned on CPU)")
    group.add_argument("--cluster", metavar="NAME|FILE",
                       help="--plan: also predict the step on this cluster (a preset: "
                            "h100x8, h100x8x8nodes, h100x8x64nodes, h200x8, a100x8, v5p-32, "
                            "v5p-128; or a JSON file, jaxtp.analysis.cluster): compiled for its "
                            "accelerator where that compiler is here and priced op by op (one "
                            "step, tokens/s, MFU, the top ops and exposed collectives), else "
                            "by the accelerator's ledger; where no planned layout fits, the "
                            "fewest of its devices that hold the step and the layout there "
                            "(jaxtp.analysis.fit)")
    group.add_argument("--calibrate", action="store_true",
                       help="--plan: measure this machine's op costs by micro-benchmarks "
                            "(jaxtp.bench.calibrate: matmuls, memory-bound classes, loops, "
                            "each collective by group and size) on 1 device and on all at "
                            "once, write costs-<n>.json to --out (default runs/calibration), "
                            "then predict the steps of the layouts that fit (tiny, llama-tiny, "
                            "moe-tiny) op by op and time them: predicted against measured")
    group.add_argument("--check", action="store_true",
                       help="replay the first steps on one device, up to the first that moves "
                            "the parameters (step 2: step 1 runs at lr 0), and record loss, "
                            "grad-norm and parameter-update differences in run.json")


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog="train.py", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (_layout_flags, _run_flags, _cluster_flags, _analysis_flags):
        add(ap)
    tiny = load_config("tiny").to_dict()
    for action in ap._actions:  # each config flag: its key, and the default it leaves
        if action.dest in FLAG_KEYS:
            section, key = FLAG_KEYS[action.dest].split(".")
            action.help += (f" [{section}.{key}; default: the config's, "
                            f"{tiny[section][key]} in tiny]")
    # overrides before, between and after the flags, as a user writes them
    return ap.parse_intermixed_args(argv)


def _overrides(args: argparse.Namespace) -> list[str]:
    """The command line's "section.key=value"s: its flags', then its own."""
    flags = {FLAG_KEYS[k]: getattr(args, k) for k in FLAG_KEYS}
    if args.bf16 and args.float64:
        raise ValueError("--bf16 and --float64 ask for two precisions; choose one")
    flags["model.dtype"] = "bfloat16" if args.bf16 else "float64" if args.float64 else None
    flags["model.param_dtype"] = "float64" if args.float64 else None
    return [f"{k}={v}" for k, v in flags.items() if v is not None] + args.overrides


def resolve_config(args: argparse.Namespace, base: Config | None = None) -> Config:
    """The config the command line asks for: `base` (else --config, else
    tiny; --init-from-hf's model section), then the flags, then the overrides."""
    cfg = base or load_config("tiny" if args.config is None else args.config)
    if args.init_from_hf:
        from jaxtp.hf import hf_model_config

        cfg = dataclasses.replace(cfg, model=hf_model_config(args.init_from_hf))
    overrides = _overrides(args)
    asked = {o.split("=", 1)[0] for o in overrides}
    cfg = apply_overrides(cfg, overrides)
    p, t = cfg.parallel, cfg.train
    chosen = p.pp > 1 and t.microbatches == 1 and "train.microbatches" not in asked
    if chosen:
        # 2 per stage where the batch splits so, else 1 (a batch too small for
        # either: validate says which batch sizes work)
        M = next((k * p.pp for k in (2, 1) if t.batch_size % (p.dp * k * p.pp) == 0),
                 2 * p.pp)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, microbatches=M))
    cfg = check_asked(validate(cfg), asked)
    if chosen:  # (once the config is known good: a refused --pp says nothing of its M)
        M = cfg.train.microbatches
        print(f"note: --pp {p.pp} runs the batch in train.microbatches={M} microbatches "
              f"({M // p.pp} per stage; --microbatches M sets it, M >= {p.pp})",
              file=sys.stderr)
    return cfg


def resolve_run(args: argparse.Namespace) -> tuple[Config, dict]:
    """(config, {"data", "init_from_hf"}) of this command: with --resume on a
    run directory, the run's own, changed only by what the flags may change."""
    if args.resume and (args.plan or args.compare_hlo):
        raise ConfigError("--resume continues a training run; --plan and --compare-hlo "
                          "do not train")
    if args.cluster is not None and not args.plan:
        raise ConfigError("--cluster applies to --plan")
    if args.calibrate and not args.plan:
        raise ConfigError("--calibrate applies to --plan")
    if args.cluster is not None:  # '' too: refused, not ignored
        from jaxtp.analysis.cluster import load

        load(args.cluster)  # a bad preset name or file refused before compiling
    if args.resume and not args.out:
        raise ConfigError("--resume needs --out DIR: the run directory to continue (or "
                          "to start)")
    run = RunDir(args.out) if args.resume else None
    if run is None or not run.has_run():
        return resolve_config(args), {"data": args.data, "init_from_hf": args.init_from_hf}
    launch = run.launch()
    # a whole config, else the run's with flags
    whole = args.config is not None or args.init_from_hf
    cfg = resolve_config(args, None if whole else run.config())
    changes = run.changes(cfg)  # refuses what a resume may not change, before JAX starts
    t = cfg.train
    if "parallel.pp" in changes and "train.microbatches" not in changes and t.microbatches > 1:
        # a fresh run at the new pp would choose its own M; a resume is the same run
        print(f"note: --pp {cfg.parallel.pp} keeps the run's train.microbatches="
              f"{t.microbatches}, as a resume keeps what it is not told to change (a mixture "
              "of experts balances its load per microbatch); --microbatches N changes it",
              file=sys.stderr)
    return cfg, {"data": args.data or launch.get("data"),
                 "init_from_hf": args.init_from_hf or launch.get("init_from_hf")}


def _stop(args: argparse.Namespace, signum: int, _frame) -> None:
    """SIGINT/SIGTERM outside the training loop (which saves and stops by
    itself): in start-up, restore or compile there is nothing to save, so say
    where the run stands and exit now. (Python runs this handler between
    bytecodes: a signal during an XLA compile takes effect when it returns.)"""
    then = (f"; continue with: python train.py --resume --out {args.out}"
            if args.out and RunDir(args.out).has_run() else " before writing anything")
    print(f"stopped by {signal.Signals(signum).name} outside the training steps{then}",
          file=sys.stderr, flush=True)
    os._exit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _main(args)
    before = {s: signal.signal(s, functools.partial(_stop, args))
              for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(args)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _main(args: argparse.Namespace) -> int:
    try:
        cfg, given = resolve_run(args)
    except (ValueError, OSError, KeyError, ImportError) as e:  # ConfigError is a ValueError
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not args.out and not (args.plan or args.compare_hlo):
        args.out = default_out(args, cfg)
    p = cfg.parallel
    unwritten = [flag for flag, on in (("--pp", p.pp > 1), ("--sp", p.sp)) if on]
    if cfg.model.n_experts and args.compare_hlo and p.fsdp and unwritten:
        print(f"error: --compare-hlo --fsdp is not built for a mixture of experts with "
              f"{' and '.join(unwritten)} yet (FSDP's rows there are not written); without "
              f"{'them' if len(unwritten) > 1 else 'it'} it is", file=sys.stderr)
        return EXIT_USAGE
    refusal = start_jax(args, cfg)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    from jaxtp.parallel.targets import TargetUnavailable
    from jaxtp.train.checkpoint import CheckpointError, SaveFailed
    from jaxtp.train.loop import TrainingStopped

    try:
        if args.plan and args.calibrate:
            from jaxtp.bench.predict_cpu import calibrate_here

            calibrate_here(args.out or "runs/calibration")
            return 0
        if args.plan:
            return plan(args, cfg)
        if args.compare_hlo:
            return compare(args, cfg)
        return run(args, cfg, given)
    except SaveFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_SAVE
    except (TrainingStopped, CheckpointError, TargetUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, OSError, KeyError, ImportError) as e:  # before compiling
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


def cluster_target(cluster: str) -> str | None:
    """The compile-only target of `cluster`'s accelerator, if jaxtp has one."""
    from jaxtp.analysis.cluster import load

    name = load(cluster).accelerator.name
    return name if name in TARGET_NAMES else None


def _cluster_devices(cluster: str) -> int:
    from jaxtp.analysis.cluster import load

    return load(cluster).devices


def start_jax(args, cfg: Config) -> str | None:
    """Start JAX as the run needs it (fake CPU devices, or jax.distributed for
    several processes); the reason to refuse the run, or None."""
    p = cfg.parallel
    if args.hardware and not (args.plan or args.compare_hlo):
        return "--hardware applies to --plan and --compare-hlo"
    # --plan --cluster: where nothing fits, a search up to the cluster's devices
    # compiles for its accelerator (`jaxtp.analysis.fit`)
    search = args.plan and args.cluster
    if search or args.hardware and HARDWARE[args.hardware].platform == "cuda":
        # compiling for a GPU this machine lacks: the CUDA plugin must not insist
        # on finding one when JAX starts (jaxtp.parallel.targets)
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import jax

    if cfg.model.dtype == "float64":  # before any array is made (jaxtp.model.build)
        jax.config.update("jax_enable_x64", True)
    from jaxtp.parallel import BF16_CPU_SHARD_MAP, distributed, ensure_devices
    from jaxtp.parallel.ep import RAGGED_CPU

    # flags, JAX's environment variables or a launcher (srun, mpirun) make a multi-process run
    try:
        multi, n = distributed.requested(args.coordinator, args.num_processes, args.process_id)
        if multi and n and not args.local_devices and p.devices % n:
            return (f"--num-processes {n}: the mesh's {'*'.join(p.degrees)} = {p.devices} "
                    f"devices do not split evenly over {n} processes; choose degrees whose "
                    f"product divides by {n}, or give --local-devices")
        if multi:
            print(distributed.initialize(
                args.coordinator, args.num_processes, args.process_id,
                args.local_devices or (p.devices // n if n else None),
                timeout_s=args.coordinator_timeout))
        else:  # before JAX starts
            print(ensure_devices(args.local_devices or max(
                p.devices // p.tp * (max(p.tp, 8) if args.plan else p.tp),
                _cluster_devices(args.cluster) if search else 0)))
        on_cpu = jax.default_backend() == "cpu" and not args.hardware
    except (ValueError, RuntimeError, AssertionError) as e:
        # jax 0.10.2 fails JAX_PLATFORMS=cuda without a GPU on a bare assert
        platforms = os.environ.get("JAX_PLATFORMS")
        if platforms and not str(e):
            return (f"JAX_PLATFORMS={platforms}: JAX found no such device on this machine; "
                    "unset JAX_PLATFORMS, or name a platform this machine has (cpu)")
        return str(e) or type(e).__name__
    uses_shard_map = p.impl == "shard_map" or args.compare_hlo
    if uses_shard_map and cfg.model.dtype == "bfloat16" and on_cpu:
        return BF16_CPU_SHARD_MAP
    if cfg.model.moe_dispatch == "ragged" and p.ep > 1 and on_cpu:
        return RAGGED_CPU
    return None


def plan(args, cfg: Config) -> int:
    from jaxtp.analysis.plan import plan, planned_sweep
    from jaxtp.sizes import check_plannable
    from jaxtp.train.step import compiled_step

    p = cfg.parallel
    # --cp N (--pp N, --ep N): a sweep of that axis over 1, 2, 4, ... below N,
    # and N, at the one tp (the axis table's rule: `jaxtp.axes.Axis.sweep`)
    sweep = planned_sweep(cfg)
    tps = [args.tp or p.tp] if sweep else [args.tp] if args.tp else [1, 2, 4, 8]
    largest = p.devices // p.tp * max(tps)
    check_plannable(cfg, largest)  # a model no accelerator holds: refused before compiling
    if args.cluster:  # the largest mesh against the cluster, before compiling anything
        from jaxtp.analysis.cluster import load

        cluster, need = load(args.cluster), largest
        if need > cluster.devices:
            raise ValueError(f"--cluster {args.cluster}: {'*'.join(AXES)} = {need} devices at "
                             f"the largest tp, and {cluster.name} has {cluster.devices}")
    # --cluster: compiled for its accelerator (where that compiler is here),
    # whose program the cluster's prediction prices op by op
    target = args.hardware or (cluster_target(args.cluster) if args.cluster else None)
    plan(cfg, tps,
         target or "h100", compile_for_target=target is not None,
         out_dir=args.out, sweep=sweep, cluster=args.cluster,
         compile_step=compiled_step)
    return 0


def compare(args, cfg: Config) -> int:
    from jaxtp.analysis.compare import compare_hlo
    from jaxtp.train.step import compiled_step

    p, mesh = cfg.parallel, None
    if args.hardware:
        from jaxtp.parallel.targets import target_mesh

        mesh = target_mesh(args.hardware, **p.degrees)  # or TargetUnavailable
    ok = compare_hlo(cfg, default_out(args, cfg), mesh=mesh, compile_step=compiled_step)["ok"]
    return 0 if ok else EXIT_FAILED


def run(args, cfg: Config, given: dict) -> int:
    import jax

    from jaxtp.train.loop import train
    from jaxtp.train.options import RunOptions

    init, hf = None, given["init_from_hf"]
    if hf:
        from jaxtp.hf import read_hf
        from jaxtp.parallel import Layout
        from jaxtp.train.start import check_memory

        check_memory(cfg, Layout.of(cfg).mesh())  # before reading the checkpoint's tensors
        init = lambda: read_hf(hf, **dataclasses.asdict(cfg.model))[1]
        if not (args.resume and RunDir(args.out).has_run()):
            init = init()  # a new run: a broken download is refused before writing
        # else read only if the run has no checkpoint to continue from
    asked = {o.split("=", 1)[0] for o in _overrides(args)}
    summary = train(cfg, args.out, RunOptions(
        # a config's warmup against a --steps of the command line's (a smoke run) is not news
        warn_warmup="train.steps" not in asked or "train.warmup_steps" in asked,
        data_path=given["data"], check=args.check, init_params=init, resume=args.resume,
        inject_nan_at=args.inject_nan_at, peak_tflops=args.peak_tflops,
        tensorboard=args.tensorboard, until=args.until, init_from_hf=hf, argv=sys.argv,
        log=_log))
    if summary["interrupted"]:
        return 128 + signal.Signals[summary["interrupted"]]
    if jax.process_index() == 0 and not summary["finished"]:
        print(f"stopped after step {summary['last_step']} (--until); continue with "
              f"--resume --out {args.out}", file=sys.stderr)
    return 0


def _log(line: str) -> None:
    """The run's log lines on stdout; its warnings and where a stopped run
    stands (`Notice`) on stderr, so that stdout piped on holds the log alone."""
    from jaxtp.train.options import Notice

    print(line, file=sys.stderr if isinstance(line, Notice) else sys.stdout, flush=True)


def default_out(args, cfg: Config) -> str:
    p = cfg.parallel
    name = args.config or "tiny"  # (an empty --config was refused)
    cp = f"-cp{p.cp}" if p.cp > 1 else ""
    return args.out or (f"runs/{name.split('/')[-1].removesuffix('.json')}"
                        f"-dp{p.dp}{cp}-tp{p.tp}-{time.strftime('%Y%m%d-%H%M%S')}")


if __name__ == "__main__":
    code = main()
    if code == EXIT_SAVE:
        # orbax's threads of a save that failed at its directory (read-only,
        # no inodes) wait ~300 s for a signal that cannot come, and the
        # interpreter would join them: abandon them, what was written is kept
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
