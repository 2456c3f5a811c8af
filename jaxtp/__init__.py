"""jaxtp: Megatron-style tensor parallelism in JAX/Flax NNX, with proof from HLO."""

from .config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig, load_config
from .layers import ColumnParallelLinear, Embed, LayerNorm, RowParallelLinear
from .attention import Attention
from .mlp import MLP
from .model import Block, Transformer
from .sharding import RULES, constrain, make_mesh, spec
from .train_lib import init_train_state, loss_fn, make_eval_step, make_optimizer, make_train_step

__all__ = [
    "Config", "ConfigError", "ModelConfig", "ParallelConfig", "TrainConfig", "load_config",
    "ColumnParallelLinear", "RowParallelLinear", "Embed", "LayerNorm", "Attention", "MLP",
    "Block", "Transformer", "RULES", "constrain", "make_mesh", "spec",
    "init_train_state", "loss_fn", "make_eval_step", "make_optimizer", "make_train_step",
]
