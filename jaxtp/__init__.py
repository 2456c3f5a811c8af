"""jaxtp: Megatron-style tensor parallelism in JAX/Flax NNX, with proof from HLO."""

from . import comm, hlo
from .config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig, load_config
from .layers import ColumnParallelLinear, Embed, LayerNorm, RMSNorm, RowParallelLinear
from .attention import Attention
from .mlp import MLP
from .model import Block, Transformer, stack_layers, unstack_layers
from .sharding import RULES, constrain, make_mesh, spec
from .train_lib import (abstract_train_state, compile_train_step, grads_of, init_train_state,
                        loss_fn, make_eval_step, make_optimizer, make_train_step,
                        step_controls)
from .vocab import VocabEmbed

__all__ = [
    "Config", "ConfigError", "ModelConfig", "ParallelConfig", "TrainConfig", "load_config",
    "ColumnParallelLinear", "RowParallelLinear", "Embed", "LayerNorm", "RMSNorm", "Attention", "MLP",
    "Block", "Transformer", "RULES", "constrain", "make_mesh", "spec",
    "init_train_state", "abstract_train_state", "compile_train_step", "loss_fn",
    "make_eval_step", "make_optimizer", "make_train_step", "step_controls", "grads_of",
    "stack_layers", "unstack_layers", "VocabEmbed", "comm", "hlo",
]
