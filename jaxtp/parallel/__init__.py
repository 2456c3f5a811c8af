"""The only place that knows the mesh axes and how tp communicates: the mesh and
the `Layout`, Megatron's f and g, regions run per impl, multi-process start-up."""

from .collectives import f, f_sp, g, g_sp, global_norm
from .layout import (DATA_AXIS, FSDP_PARAM_RULES, IMPL_AXIS, MESH_AXES, RULES, Layout,
                     check_device_count, constrain, ensure_devices, in_region, make_mesh,
                     mesh_for, mesh_size, named, spec, split_over_tp)
from .inference import cache_spec, cached_region, vocab_sample
from .overlap import CPU_HAS_NO_WINDOWED_EINSUM, NO_XLA_OVERLAP, compiler_options
from .locals import GSPMD, Explicit, Ring, ShardMap
from .regions import BF16_CPU_SHARD_MAP, act_spec, embed, region, run_sharded, vocab_losses

__all__ = ["f", "f_sp", "g", "g_sp", "global_norm", "DATA_AXIS", "FSDP_PARAM_RULES", "IMPL_AXIS",
           "MESH_AXES", "RULES", "Layout", "check_device_count", "constrain", "ensure_devices",
           "in_region", "make_mesh", "mesh_for", "mesh_size", "named", "spec", "split_over_tp",
           "BF16_CPU_SHARD_MAP", "Explicit", "GSPMD", "Ring", "ShardMap", "act_spec", "cache_spec",
           "cached_region",
           "embed", "region", "run_sharded", "vocab_losses", "vocab_sample", "CPU_HAS_NO_WINDOWED_EINSUM", "NO_XLA_OVERLAP",
           "compiler_options"]
