"""The benchmark suite: what tensor parallelism costs, measured side by side.

The suite times train steps as *ratios* measured in one process: the variants
are compiled up front and timed alternately, round by round, and each ratio
is the median over rounds of the two times of one round (a slow moment of a
noisy machine then hits both sides alike). Sections: GSPMD vs shard_map at
the largest tp <= 8 a preset allows; tp in {1, 2, 4, 8} with and without
sequence parallelism against tp=1; SP's collectives as collective-matmul
rings against plain ones (`overlap`); XLA's windowed-einsum loops past the
CPU threshold, compile-only (`windowed`); compile time against depth; collectives
over the tp axis (`collectives`); the share of step time in collectives,
read from a profiler trace; the step's time by kind of work (`cpu_profile`);
jaxtp against two independent plain JAX steps of the same model and a tuned
one (`peer`), and PyTorch eager where torch imports (`torch-peer`);
blockwise against xla attention as the sequence grows; the expert-parallel
all-to-alls' bytes against the capacity factor, compiled and by the ep
ledger (`moe`); the
training loop's host time per step; the step predictor against published
runs (`predict`) and against this machine's measured steps (`predict_cpu`). Each section is printed; the report goes
to DIR/bench.json and DIR/bench.md (`report`).

On CPU the tp ranks are fake devices sharing the host's cores: the ratios
there show partitioning overhead, not a speed-up.
"""

from __future__ import annotations

import tempfile
import time
from typing import Callable

import jax
import numpy as np

from ..model import kernels
from ..parallel import make_mesh
from ..train.loop import train
from ..train.options import RunOptions
from ..train.state import abstract_train_state
from ..train.step import compile_train_step
from . import collectives as bc
from .cases import PAIRED, _case, _get, _paired, preset, valid_tps
from .collectives import bench_collectives
from .cp import bench_cp
from .pp import bench_pp
from .moe import bench_moe
from .cpu_profile import bench_cpu_profile
from .decode import bench_decode
from .predict_cpu import bench_predict_cpu
from .published import bench_predict
from .report import RATIO_COLUMNS, format_section, machine_info, section
from .timing import build, paired_ratio, time_alternating
from .versus import bench_peer, bench_torch_peer
from .windowed import bench_windowed

SECTIONS = ("impl", "scaling", "overlap", "windowed", "cp", "pp", "moe", "compile",
            "collectives",
            "profile",
            "cpu_profile", "peer", "torch-peer", "attention", "loop", "decode", "predict",
            "predict_cpu")
# quick: for CI, about a minute on 2 CPU cores; full: ~10 minutes there
PLANS = {
    "quick": dict(presets=("tiny",), tps=(1, 8), impls=("gspmd",), overlap_impls=("shard_map",),
                  windowed_cases=(("gpt2", "gspmd", "none"),), cps=(4,), cp_layouts=((4, 2),),
                  warmup=1, steps=3, rounds=3,
                  depths=(2, 8), unscanned=(), payloads=("tiny",), samples=5,
                  attention_seqs=(128,), loop_steps=6, decode_batch=4, decode_prompt=16,
                  decode_tokens=8, decode_reps=1,
                  small=("model.n_layers=1", "train.batch_size=8", "model.seq_len=64")),
    "full": dict(presets=("tiny", "gpt2-small"), tps=(1, 2, 4, 8), impls=("gspmd", "shard_map"),
                 cps=(2, 4, 8), cp_layouts=((2, 4), (4, 2), (8, 1)),
                 overlap_impls=("shard_map", "gspmd"),
                 windowed_cases=tuple((m, i, "none") for m in ("gpt2", "llama")
                                      for i in ("gspmd", "explicit"))
                 + (("gpt2", "gspmd", "full"),),
                 warmup=2, steps=7, rounds=5, depths=(2, 8, 32), unscanned=(2, 8),
                 payloads=("tiny", "gpt2-small", "llama-1b"), samples=10,
                 attention_seqs=(256, 512, 1024, 2048), loop_steps=60, decode_batch=8,
                 decode_prompt=64, decode_tokens=64, decode_reps=3, small=()),
}
def bench_impl(plan: dict, cache: dict, log=print) -> dict:
    """shard_map and explicit against gspmd: the train step at the largest tp
    <= 8, each pair timed alternately."""
    rows, notes = [], []
    cases = []
    for name in plan["presets"]:
        tps, why = valid_tps(name, (8, 4, 2, 1))
        notes += why[:1]
        cases += [(name, max(tps), impl) for impl in ("shard_map", "explicit")]
    for i, (name, tp, impl) in enumerate(cases, 1):
        log(f"impl {i}/{len(cases)}: {name} tp={tp} {impl} / gspmd")
        gs, cut = _get(plan, cache, name, tp, "gspmd")
        other, _ = _get(plan, cache, name, tp, impl)
        rows.append(_paired(plan, gs, other, "gspmd_ms", "impl_ms",
                            case=_case(f"{name} tp={tp}", gs.cfg, cut),
                            measured=f"train step time, {impl} / gspmd", impl=impl,
                            gspmd_compile_s=gs.compile_s, impl_compile_s=other.compile_s,
                            steps=plan["steps"]))
    return section("impl", "shard_map and explicit against GSPMD: train step at the largest "
                   "tp <= 8", PAIRED + [
        ("impl", "impl"), ("gspmd_ms", "gspmd ms (median)"), ("impl_ms", "impl ms (median)"),
        ("gspmd_compile_s", "gspmd compile s"), ("impl_compile_s", "impl compile s"),
        ("steps", "timed steps")], rows, [
        f"each pair compiled in one process, warm-up {plan['warmup']} step(s) each, then timed "
        "alternately; value: median over rounds of the paired ratio; < 1: the impl is faster "
        "than gspmd", *notes])


def bench_scaling(plan: dict, cache: dict, log=print) -> dict:
    rows, notes = [], []
    groups = []
    for name in plan["presets"]:
        tps, why = valid_tps(name, plan["tps"])
        notes += why
        # and context parallelism (cp x tp = 8) where the preset's sequence splits
        cps = [(cp, 8 // cp, sp) for cp in plan["cps"] for sp in (False, True)
               if 8 // cp in tps and not (sp and cp == 8)]
        groups += [(name, impl, [(1, tp, sp) for tp in tps for sp in (False, True)
                                 if not (sp and tp == 1)] + (cps if name == "tiny" else []))
                   for impl in (plan["impls"] if name == "tiny" else ("gspmd",))]
    for i, (name, impl, cases) in enumerate(groups, 1):
        log(f"scaling {i}/{len(groups)}: {name} {impl}, {len(cases)} layouts")
        runs = [_get(plan, cache, name, tp, impl, sp, cp=cp) for cp, tp, sp in cases]
        t = time_alternating([r for r, _ in runs], plan["warmup"], plan["steps"])
        for r, cut in runs:
            p = r.cfg.parallel
            ratio, lo, hi = paired_ratio(t, r.name, runs[0][0].name)
            cp = f" cp={p.cp}" if p.cp > 1 else ""
            rows.append({"case": _case(f"{name} {impl}{cp} tp={p.tp} sp={'on' if p.sp else 'off'}",
                                       r.cfg, cut),
                         "measured": "train step time / tp=1", "value": ratio,
                         "unit": "ratio", "ratio_min": lo, "ratio_max": hi,
                         "step_ms": np.median(t[r.name]) * 1e3, "compile_s": r.compile_s,
                         **dict(tp=p.tp, cp=p.cp, sp=p.sp, impl=impl)})
    note = ("the tp ranks are fake CPU devices sharing the host's cores, no more compute "
            "than tp=1 has: the ratios show partitioning overhead and how XLA's CPU runtime "
            "spreads the work, not a speed-up" if jax.default_backend() == "cpu"
            else "ideal scaling: 1/tp")
    return section("scaling", "Train step time against tp, with and without sequence parallelism",
                   PAIRED + [("step_ms", "step ms (median)"), ("compile_s", "compile s")], rows,
                   [note, f"all runs of a preset and impl interleaved, {plan['steps']} rounds "
                    "after warm-up; value: median over rounds of the paired ratio", *notes])


def bench_overlap(plan: dict, cache: dict, log=print) -> dict:
    """SP's collectives as collective-matmul rings against the plain
    all-gathers and reduce-scatters (`parallel.overlap`), per impl and tp,
    each pair timed alternately."""
    rows = []
    cases = [(impl, tp) for impl in plan["overlap_impls"] for tp in plan["tps"] if tp > 1]
    for i, (impl, tp) in enumerate(cases, 1):
        log(f"overlap {i}/{len(cases)}: tiny {impl} tp={tp}")
        base, cut = _get(plan, cache, "tiny", tp, impl, sp=True)
        ring, _ = _get(plan, cache, "tiny", tp, impl, sp=True, overlap="collective_matmul")
        rows.append(_paired(plan, base, ring, "none_ms", "ring_ms",
                            case=_case(f"tiny {impl} tp={tp} sp", base.cfg, cut),
                            measured="train step time, collective_matmul / none", tp=tp,
                            impl=impl))
    notes = ["both compiled in one process and timed alternately; < 1: the overlap pays",
             "shard_map: each region's all-gather and reduce-scatter written as tp - 1 "
             "ppermutes that a GPU or TPU runs beside the chunks' matmuls; gspmd: each "
             "region's dots written for XLA's windowed einsum (jaxtp.parallel.xla_overlap)"]
    if jax.default_backend() == "cpu":
        notes.append("CPU: no concurrent streams, so nothing runs beside a matmul: the ring's "
                     "tp matmuls and permutes cost more than one collective and one matmul; "
                     "XLA's CPU compiler forms windowed loops only past 100,000 MiB of "
                     "operand bytes (the windowed section), so gspmd's overlapped run is SP "
                     "with x gathered again for each weight gradient")
    return section("overlap", "Sequence parallelism's collectives overlapped with the matmuls",
                   PAIRED + [("none_ms", "overlap none ms"), ("ring_ms", "collective_matmul ms")],
                   rows, notes)


def bench_compile(plan: dict, log=print) -> dict:
    rows, base = [], None
    tp = min(8, jax.device_count())
    cases = [(d, True) for d in plan["depths"]] + [(d, False) for d in plan["unscanned"]]
    for i, (depth, scan) in enumerate(cases, 1):
        log(f"compile {i}/{len(cases)}: tiny L={depth} {'scanned' if scan else 'unscanned'}")
        cfg, _ = preset("tiny", f"model.n_layers={depth}", f"model.scan_layers={str(scan).lower()}",
                        f"parallel.tp={tp}")
        state = abstract_train_state(cfg, make_mesh(1, tp, devices=jax.devices()[:tp]))
        t0 = time.perf_counter()
        compile_train_step(state, cfg.train.batch_size, cfg.model.seq_len)
        s = time.perf_counter() - t0
        base = base or s
        rows.append({"case": f"tiny tp={tp} L={depth} {'scanned' if scan else 'unscanned'}",
                     "measured": f"compile time / scanned L={cases[0][0]}", "value": s / base,
                     "unit": "ratio", "compile_s": s})
    return section("compile", "Compile time against depth", RATIO_COLUMNS + [
        ("compile_s", "trace + compile s")], rows,
        ["the train step traced, lowered and compiled on abstract shapes, once per row, in "
         "this order (run alone, the first row also pays the process's first compile)"])


def bench_profile(plan: dict, cache: dict) -> dict:
    rows, tp = [], min(8, jax.device_count())
    for impl in ("gspmd", "shard_map"):
        run, cut = _get(plan, cache, "tiny", tp, impl)
        run()  # warm
        r = bc.collective_share(run, run.step.as_text(), steps=2)
        rows.append({"case": _case(f"tiny {impl} tp={tp}", run.cfg, cut),
                     "measured": "share of step time in collectives (profiler)",
                     "value": None if r["share"] is None else 100 * r["share"], "unit": "%",
                     "collective_ms": r.get("collective_ms"), "step_ms": r.get("step_ms"),
                     "reason": r["reason"]})
    notes = ["per device and step: collective ops' durations over the span of the step's ops, "
             "averaged over devices and 2 traced steps (jax.profiler XSpace)"]
    if jax.default_backend() == "cpu":
        notes.append("CPU: a collective's time includes waiting at the rendezvous for the "
                     "slowest rank, and 8 fake devices share the cores: an upper bound on "
                     "communication, not link time")
    return section("profile", "Share of the train step in collectives", RATIO_COLUMNS + [
        ("collective_ms", "collective ms"), ("step_ms", "traced step ms"), ("reason", "reason")],
        rows, notes)


def bench_attention(plan: dict, log=print) -> dict:
    """The tiny train step with blockwise attention against xla attention, at
    growing sequence lengths (batch 2), timed alternately."""
    rows = []
    for i, T in enumerate(plan["attention_seqs"], 1):
        log(f"attention {i}/{len(plan['attention_seqs'])}: T={T}, blockwise / xla")
        runs = []
        for kernel in ("xla", "blockwise"):
            # the block auto takes on this device (CPU: CPU_BLOCK)
            block = kernels.choose_block("auto", 512, jax.devices()[0])
            cfg, _ = preset("tiny", *plan["small"], "parallel.tp=1", f"model.seq_len={T}",
                            "train.batch_size=2", f"model.attention={kernel}",
                            f"model.attention_block={block}")
            runs.append(build(f"T={T} {kernel}", cfg))
        t = time_alternating(runs, plan["warmup"], plan["steps"])
        ratio, lo, hi = paired_ratio(t, runs[1].name, runs[0].name)
        rows.append({"case": f"tiny tp=1 (L={runs[1].cfg.model.n_layers} B=2 T={T}, block "
                             f"{runs[1].cfg.model.attention_block})",
                     "measured": "train step time, blockwise / xla", "value": ratio,
                     "unit": "ratio", "ratio_min": lo, "ratio_max": hi,
                     "xla_ms": np.median(t[runs[0].name]) * 1e3,
                     "blockwise_ms": np.median(t[runs[1].name]) * 1e3})
        del runs
    return section("attention", "Attention kernels: blockwise against xla", PAIRED + [
        ("xla_ms", "xla ms (median)"), ("blockwise_ms", "blockwise ms (median)")], rows, [
        "same parameters' shapes, both compiled in one process and timed alternately; "
        "< 1: blockwise faster", "model.attention=auto picks blockwise on CPU from two blocks "
        "of 64 on (jaxtp.model.kernels.CPU_BLOCK), on an accelerator without cuDNN from "
        "model.seq_len >= 1024 (BLOCKWISE_FROM_SEQ)"])


def bench_loop(plan: dict, log=print) -> dict:
    """The training loop at tp=8: host time per step outside the step call
    (data, bookkeeping, dispatch of nothing else), from the loop's own record."""


    tp = min(8, jax.device_count())
    n = plan["loop_steps"]
    cfg, cut = preset("tiny", f"parallel.tp={tp}", f"train.steps={n}", "train.warmup_steps=1",
                      f"train.log_every={n // 3}", f"train.eval_every={n}",
                      "train.eval_batches=1", *plan["small"])
    with tempfile.TemporaryDirectory() as out:
        summary = train(cfg, out, RunOptions(log=lambda _: None))
    rows = [{"case": _case(f"tiny tp={tp} gspmd", cfg, cut),
             "measured": "host time per step outside the step call (median)",
             "value": summary["host_ms_per_step"], "unit": "ms",
             "steps": n, "tokens_per_sec": summary["tokens_per_sec"]}]
    return section("loop", "The training loop: host time per step", RATIO_COLUMNS + [
        ("steps", "steps"), ("tokens_per_sec", "tokens/s (median)")], rows, [
        "measured by the loop (jaxtp.train.loop) on steps that neither log, evaluate nor save: "
        "from the top of the iteration to the step call and from its return to the end; "
        "the key, lr, spike guard and skip counts are computed inside the jitted step; "
        "the host draws and places the next batch"])


def check_only(only) -> list[str]:
    """The sections `only` names (None: all of them); an empty name or an
    unknown one is a ValueError naming it and the sections."""
    if only is None:
        return list(SECTIONS)
    only = list(only)
    if not only or "" in only:
        raise ValueError(f"--only {','.join(only)!r}: an empty section name; give sections "
                         f"separated by commas, from {','.join(SECTIONS)} (or leave --only out "
                         "for all of them)")
    bad = sorted(set(only) - set(SECTIONS))
    if bad:
        raise ValueError(f"unknown benchmark(s) {bad}; choose from {','.join(SECTIONS)}")
    return only


def run_suite(quick: bool = False, only=None, log: Callable[[str], None] = print) -> dict:
    """Run the benchmark suite (all SECTIONS, or `only` those); return the report."""
    only = check_only(only)
    plan, cache, sections = PLANS["quick" if quick else "full"], {}, []
    t0 = time.perf_counter()
    jobs = {"impl": lambda: bench_impl(plan, cache, log),
            "scaling": lambda: bench_scaling(plan, cache, log),
            "overlap": lambda: bench_overlap(plan, cache, log),
            "windowed": lambda: bench_windowed(plan, log),
            "cp": lambda: bench_cp(plan, cache, log),
            "pp": lambda: bench_pp(plan, log),
            "moe": lambda: bench_moe(plan, log),
            "compile": lambda: bench_compile(plan, log),
            "collectives": lambda: bench_collectives(plan, log),
            "profile": lambda: bench_profile(plan, cache),
            "cpu_profile": lambda: bench_cpu_profile(
                [(f"tiny gspmd tp={tp}", _get(plan, cache, "tiny", tp)[0])
                 for tp in sorted({1, min(8, jax.device_count())})]),
            "peer": lambda: bench_peer(plan, cache),
            "torch-peer": lambda: bench_torch_peer(plan, cache),
            "attention": lambda: bench_attention(plan, log), "loop": lambda: bench_loop(plan),
            "decode": lambda: bench_decode(plan),
            # quick: the ledger's pricing (no deviceless compiles), two layouts in one round
            "predict": lambda: bench_predict(log, compile=not quick),
            "predict_cpu": lambda: bench_predict_cpu(1 if quick else 5, log, quick)}
    for sid in SECTIONS:
        if sid in only:
            t1 = time.perf_counter()
            sections.append(jobs[sid]())
            sections[-1]["wall_s"] = time.perf_counter() - t1
            log(format_section(sections[-1]))
            for key in [k for k in cache if not k.startswith("tiny ")]:
                del cache[key]  # free big presets' buffers
    return {"meta": machine_info("quick" if quick else "full", time.perf_counter() - t0),
            "sections": sections}
