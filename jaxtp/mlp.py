"""GELU MLP with Megatron's column -> row split (GSPMD or shard_map)."""

from __future__ import annotations

import jax
from flax import nnx

from .config import ModelConfig
from .layers import ColumnParallelLinear, RowParallelLinear, gelu, init_std_out
from .manual import tp_region
from .sharding import constrain


class MLP(nnx.Module):
    """h = gelu(x W_up + b_up); y = g(h W_down) + b_down.

    W_up: [D, F] column-parallel (each rank [D, F/tp]); W_down: [F, D]
    row-parallel (each rank [F/tp, D]). One all-reduce forward (g, after
    W_down) and one backward (f, the gradient of x entering W_up).
    """

    def __init__(self, cfg: ModelConfig, *, impl: str = "gspmd", rngs: nnx.Rngs):
        kw = dict(use_bias=cfg.use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                  rngs=rngs)
        self.up = ColumnParallelLinear(cfg.d_model, (cfg.d_ff,), ("mlp",),
                                       std=cfg.init_std, **kw)
        self.down = RowParallelLinear((cfg.d_ff,), ("mlp",), cfg.d_model,
                                      std=init_std_out(cfg.init_std, cfg.n_layers), **kw)
        self.impl = impl

    def region(self, x_BTD):
        """Local math from replicated x to the partial (pre-reduction) output."""
        h_BTF = gelu(self.up(x_BTD))  # sharded over F
        h_BTF = constrain(h_BTF, "batch", "seq", "mlp")
        return self.down.partial(h_BTF)

    def __call__(self, x_BTD):
        with jax.named_scope("mlp"):
            return self.down.add_bias(tp_region(self, x_BTD))
