"""GSPMD's overlap (`parallel.overlap="collective_matmul"` under impl gspmd
and explicit): the compiler options that ask XLA for windowed einsum, which
of its loops a compile forms, and the installed jaxlib's known bugs there.

XLA's SPMD partitioner (xla/service/spmd/dot_handler.cc,
GetWindowedEinsumConfiguration) turns the all-gather beside a column-parallel
dot, or the reduce-scatter beside a row-parallel one, into a while loop of tp
steps (`windowed_dot_general_body_ag` / `_rs`), each a collective-permute of
one [b, s/tp, h] chunk beside the matmul of another, when the dot has that
form (`jaxtp.parallel.GSPMD.project`) and

- tp is at most the iteration cap its compiler sets (logged under
  `TF_CPP_VMODULE=stateful_rng_spmd_partitioner=3`): 32 on CPU; on a GPU the
  NVLink domain size of the client at run time (openxla/xla PR 26391), 0 in a
  deviceless (ahead-of-time) compile, where no loop can form;
- the operand gathered (the output scattered) has at least the threshold's
  global bytes: a fixed 100000 MiB on CPU; on a GPU the option
  `xla_gpu_threshold_for_windowed_einsum_mib`, which jaxtp sets to 0;
- no other dot needs the same gathered operand (`check_users_sharding`: one
  plain all-gather shared instead; `jaxtp.parallel.overlap.reread`).

Measured with jaxlib 0.10.2 on CPU (`python -m jaxtp.bench --only windowed`):
past the threshold every budgeted loop forms at dp = 1; at dp = 2 x tp = 4
only the reduce-scatter loops (the all-gather ones did not at any size tried,
up to 64 x 2^20 tokens of 8192), and the threshold counts one dp group's
batch.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata

import numpy as np

from ..config import Config

# XLA's options that turn windowed einsum on, per platform. GPU: a threshold
# of 0 MiB decomposes every all-gather / reduce-scatter feeding a dot, on
# multiple streams, with the latency-hiding scheduler placing the permutes
# beside the matmuls (xla/debug_options_flags.cc). TPU: libtpu's windowed
# einsum for both directions, with async collective-permutes (flags that
# public TPU training configs pass in LIBTPU_INIT_ARGS; passed here as the
# jit's compiler options). CPU: none to give (its threshold is fixed).
XLA_OVERLAP_OPTIONS = {
    "gpu": {"xla_gpu_threshold_for_windowed_einsum_mib": 0,
            "xla_gpu_multi_streamed_windowed_einsum": True,
            "xla_gpu_enable_latency_hiding_scheduler": True},
    "tpu": {"xla_tpu_enable_windowed_einsum_for_all_gather": True,
            "xla_tpu_enable_windowed_einsum_for_reduce_scatter": True,
            "xla_enable_async_collective_permute": True},
}
CPU_THRESHOLD_MIB = 100_000  # XLA's CPU compiler: fixed, global operand bytes
CPU_CAP = 32  # the iteration cap XLA's CPU compiler logs
# on a machine with tp GPUs: the cap its compile logs, and the loops per region
GPU_COMMAND = ("TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=stateful_rng_spmd_partitioner=3 "
               "python train.py --tp 8 --sp --overlap collective_matmul --compare-hlo")


def _gpu(platform: str) -> bool:
    return platform in ("gpu", "cuda", "rocm")


def windowed(cfg: Config) -> bool:
    """GSPMD's overlap asked for: XLA's windowed einsum is what overlaps."""
    p = cfg.parallel
    return p.overlap != "none" and p.sequence_parallel and p.impl != "shard_map"


def xla_options(platform: str) -> dict:
    """The compiler options of GSPMD's overlap on `platform` ("cpu",
    "gpu"/"cuda"/"rocm", "tpu"): {} on CPU."""
    return dict(XLA_OVERLAP_OPTIONS.get("gpu" if _gpu(platform) else platform, {}))


def compiler_options(cfg: Config, platform: str) -> dict | None:
    """XLA options for the step of `cfg` on `platform`: windowed einsum for
    XLA's partitioner under GSPMD's overlap (impl gspmd, and explicit, which
    it lowers from the types), with the workarounds of the installed jaxlib's
    known bugs (`known_bugs`); None otherwise (and on CPU)."""
    if not windowed(cfg):
        return None
    options = xla_options(platform)
    for bug in known_bugs(cfg, platform):
        options.update(bug.options)
    return options or None


@dataclasses.dataclass(frozen=True)
class Forms:
    """Which of XLA's windowed loops a compile forms, and why (or why not)."""

    all_gather: bool
    reduce_scatter: bool
    why: str


def activation_bytes(cfg: Config) -> int:
    """Global bytes of one [b, s, h] activation as the partitioner weighs it
    against its threshold: one microbatch of one dp group, in the compute
    dtype."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    b = t.batch_size // (p.dp * t.microbatches)
    return b * m.seq_len * m.d_model * np.dtype(m.dtype).itemsize


def forms(cfg: Config, platform: str, deviceless: bool = False,
          cap: int | None = None) -> Forms:
    """The loops XLA forms for the step of `cfg` under GSPMD's overlap on
    `platform` ("" for the form asked for: every loop); `deviceless`: a
    compile-only GPU; `cap`: the iteration cap the compile logged, if read."""
    p = cfg.parallel
    if p.overlap == "none" or not p.sequence_parallel:
        return Forms(False, False, "no overlap asked for")
    if not platform:
        return Forms(True, True, "the form asked for: every loop")
    if platform == "cpu":
        cap = CPU_CAP if cap is None else cap
        mib = activation_bytes(cfg) / 2**20
        if p.tp > cap:
            return Forms(False, False, f"tp={p.tp} is past XLA's CPU iteration cap of {cap}")
        if mib < CPU_THRESHOLD_MIB:
            return Forms(False, False, (
                f"XLA's CPU compiler windows a dot only past {CPU_THRESHOLD_MIB:,} MiB of "
                f"global operand bytes; this step's [b, s, h] activation is {mib:,.3f} MiB "
                "(the compile-only proof past it: python -m jaxtp.bench --only windowed)"))
        return Forms(p.dp == 1, True, (
            f"past XLA's CPU threshold ({mib:,.0f} MiB >= {CPU_THRESHOLD_MIB:,} MiB), tp={p.tp} "
            f"within its cap of {cap}" + (
                "; at dp > 1 only the reduce-scatter loops form (measured, jaxlib 0.10.2)"
                if p.dp > 1 else "")))
    if _gpu(platform):
        if deviceless or cap == 0:
            logged = "0" if cap is None else f"{cap} (logged by a compile for this target)"
            return Forms(False, False, (
                f"a deviceless GPU compile sets XLA's windowed-einsum iteration cap to {logged}: "
                "the loops form only at run time on a GPU client, whose cap is its NVLink "
                f"domain size; on a machine with {p.tp} GPUs run: {GPU_COMMAND}"))
        return Forms(True, True, "asked for on a GPU client (threshold 0 MiB, cap " + (
            "its NVLink domain" if cap is None else str(cap)) + "); XLA's cost model may still "
            "decline a loop")
    return Forms(False, False, f"not measured on {platform}: budgeted as SP's plain "
                 "collectives there")


@dataclasses.dataclass(frozen=True)
class KnownBug:
    """A bug of the installed jaxlib that a feature asked for meets."""

    issue: str
    what: str
    workaround: str
    options: dict  # compiler options jaxtp applies for it

    def line(self) -> str:
        return f"known bug {self.issue}: {self.what}; workaround: {self.workaround}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def per_device_matmul_dim(cfg: Config) -> int:
    """The largest per-device dim of a tp-split matmul of the step: tokens of
    one sequence chunk (b*s/tp) or the split output (F/tp, N*H/tp)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    b = t.batch_size // (p.dp * t.microbatches)
    return max(b * m.seq_len // p.cp // p.tp, m.d_ff // p.tp, m.n_heads * m.head_dim // p.tp)


def known_bugs(cfg: Config, platform: str, jaxlib: str | None = None) -> list[KnownBug]:
    """The known bugs of `jaxlib` (default: the installed one) that the step
    of `cfg` on `platform` meets, each with its workaround."""
    jaxlib = metadata.version("jaxlib") if jaxlib is None else jaxlib
    bugs = []
    if windowed(cfg) and _gpu(platform) and jaxlib == "0.10.2" and \
            per_device_matmul_dim(cfg) > 1024:
        bugs.append(KnownBug(
            "jax-ml/jax#39200", "jaxlib 0.10.2's multi-stream windowed einsum fails XLA's HLO "
            "verifier on GPU once a per-device matmul dim exceeds ~1024 (here "
            f"{per_device_matmul_dim(cfg)})", "the loops compiled on one stream "
            "(xla_gpu_multi_streamed_windowed_einsum=false); jaxlib 0.10.1 compiles them "
            "multi-streamed", {"xla_gpu_multi_streamed_windowed_einsum": False}))
    return bugs
