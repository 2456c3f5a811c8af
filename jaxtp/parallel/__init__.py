"""The only place that knows the mesh axes and how tp communicates: the
`Layout` (and the mesh it builds), how a batch is placed on it, who consumes
its microbatches (the `Schedule`), Megatron's f and g, one `Local` per impl,
context parallelism's attention core, multi-process start-up, and meshes of
compile-only accelerator devices (`jaxtp.parallel.targets`)."""

from .collectives import f, f_sp, g, g_sp, global_norm, vary, wide
from .layout import (CP_AXIS, DATA_AXIS, EP_AXIS, FSDP_PARAM_RULES, PP_AXIS, RULES, TP_AXIS, Layout,
                     cache_spec, constrain, cp_order, first_row,
                     in_region, keep_axes, make_mesh, mesh_for, mesh_size, named, spec,
                     spec_axes, split_over_tp)
from .distributed import check_device_count, ensure_devices
from .batches import batch_shape, batch_sharding, cp_batch, inputs_targets, sequence_split
from .schedule import Schedule
from .xla_overlap import compiler_options, known_bugs
from .global_arrays import GSPMD, Explicit, GlobalArrays
from .shardmap import BF16_CPU_SHARD_MAP, Ring, ShardMap, act_spec, run_sharded
from .locals import (LOCALS, Local, cached_region, embed, experts, local_of, place_slots,
                     ragged_experts, region, vocab_losses, vocab_sample)

__all__ = ["f", "f_sp", "g", "g_sp", "global_norm", "vary", "wide", "CP_AXIS", "DATA_AXIS", "EP_AXIS",
           "FSDP_PARAM_RULES", "PP_AXIS", "RULES", "TP_AXIS", "Layout", "Schedule", "batch_shape",
           "batch_sharding", "cache_spec", "check_device_count", "constrain", "cp_batch",
           "cp_order", "ensure_devices", "first_row", "in_region", "inputs_targets",
           "keep_axes", "make_mesh", "mesh_for", "mesh_size", "named", "sequence_split", "spec",
           "spec_axes", "split_over_tp", "compiler_options", "known_bugs", "GSPMD", "Explicit",
           "GlobalArrays", "BF16_CPU_SHARD_MAP", "Ring", "ShardMap", "act_spec", "run_sharded",
           "LOCALS", "Local", "cached_region", "embed", "local_of", "region", "vocab_losses",
           "vocab_sample", "experts", "place_slots", "ragged_experts"]
