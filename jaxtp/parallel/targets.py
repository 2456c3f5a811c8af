"""Accelerators jaxtp plans for, and compiling for one this machine lacks.

XLA compiles for a device it cannot see when its compiler is installed:
`jax.experimental.topologies.get_topology_desc` gives compile-only devices
of a GPU or TPU topology; a mesh over them lowers and compiles a train step
to real post-partitioning HLO with `memory_analysis()`, without running it.

- NVIDIA GPUs need the CUDA plugin (`pip install "jax[cuda12]"`) and a
  `GpuTargetConfigProto` describing the GPU. jaxtp writes one from the
  datasheet facts below (jaxlib 0.10.2 rejects the proto field
  `collective_memory_granularity`: it is left out). No autotuning runs and
  `cost_analysis()` is None there.
- TPUs need libtpu (`pip install "jax[tpu]"`); `v5p:2x2x2` is 8 chips.

Without the compiler the planner compiles for this machine's CPU, whose
temporaries overstate a GPU compile's (measured in `CPU_OVERSTATES`). The
accelerators' facts are the one hardware table, `jaxtp.hardware.HARDWARE`.
"""

from __future__ import annotations

import os

from .layout import Layout
from ..hardware import HARDWARE, Hardware

# CPU temporaries / the H100 compile's for the same step (XLA's CPU backend
# upcasts bf16 buffers and keeps more live, even with the memory-optimized
# scheduler jaxtp.analysis.plan uses): each preset at tp=8 with its defaults and
# blockwise attention, jaxlib 0.10.2 (llama-1b 4.03 / 2.97 GiB, llama3-8b
# 50.5 / 27.9 GiB).
CPU_OVERSTATES = {"llama-1b": 1.4, "llama3-8b": 1.8}


class TargetUnavailable(RuntimeError):
    """The compiler for a target is not installed here."""


def _gpu_target_config(t: Hardware) -> str:
    """A GpuTargetConfigProto (text) for a Hopper GPU, from its datasheet and the
    CUDA programming guide's compute capability 9.0 limits (1024 threads per
    block, 2048 per SM, 64K registers, 228 KiB shared memory per SM of which
    227 KiB opt-in per block)."""
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: {t.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(t.hbm_bandwidth)}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {t.memory}
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 }}
device_description_str: "{t.description}"
"""


def compile_only_devices(name: str, n: int = 8) -> list:
    """`n` compile-only devices of target `name` (a GPU target: hosts of 8
    past 8; a TPU target: its topology's chips), or TargetUnavailable saying
    what to install."""
    t = HARDWARE[name]
    if t.platform == "cuda":
        # the plugin checks the CUDA libraries against a GPU it will not find
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    try:
        if t.platform == "cuda":
            # past one node: hosts of 8 GPUs each ("1x4x8": 4 hosts, 32 GPUs;
            # jaxlib 0.10.2 builds up to 1x8x8 = 64 compile-only H100s)
            shape = f"1x1x{max(n, 1)}" if n <= 8 else f"1x{-(-n // 8)}x8"
            topo = topologies.get_topology_desc(platform="cuda", topology=shape,
                                                target_config=_gpu_target_config(t))
        else:
            topo = topologies.get_topology_desc(_tpu_topology(t.topology, n), platform="tpu")
    except Exception as e:  # no plugin: RuntimeError/ValueError, worded by jaxlib
        install = 'jax[cuda12]' if t.platform == "cuda" else 'jax[tpu]'
        raise TargetUnavailable(
            f"cannot compile for {name} here ({type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0][:120]}); install its compiler with "
            f'pip install "{install}"') from None
    devices = list(topo.devices)
    if len(devices) < n:
        raise TargetUnavailable(f"{name}: the topology has {len(devices)} devices, {n} needed")
    return devices[:n]


# 3-D TPU slices past 8 chips, as libtpu 0.0.42 builds them compile-only
# (checked: v5p 2x2x4 = 16, 4x4x2 = 32, 2x4x8 = 64 chips; on 4x4x4 jax.make_mesh
# finds no place for an axis of 8, which must be a product of physical axis sizes)
TPU_SLICES = {16: "2x2x4", 32: "4x4x2", 64: "2x4x8"}


def _tpu_topology(eight: str, n: int) -> str:
    """The topology string of a slice of at least n chips of the generation
    whose 8-chip string is `eight` (e.g. "v5p:2x2x2")."""
    if n <= 8:
        return eight
    size = min((k for k in TPU_SLICES if k >= n), default=None)
    if size is None:
        raise TargetUnavailable(f"{n} TPU chips: jaxtp knows compile-only slices of up to "
                                f"{max(TPU_SLICES)}")
    return f"{eight.split(':')[0]}:{TPU_SLICES[size]}"


def target_mesh(name: str, dp: int = 1, tp: int = 1, **degrees):
    """A ([pp,] dp, [ep,] [cp,] tp) mesh of compile-only devices of target
    `name`, of these degrees (named as the mesh axes; 1 where not given)."""
    layout = Layout.make(dp=dp, tp=tp, **degrees)
    return layout.mesh(devices=compile_only_devices(name, layout.devices))
