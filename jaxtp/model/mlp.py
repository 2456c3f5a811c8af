"""MLP with Megatron's column -> row split: GELU or SwiGLU."""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from .. import parallel
from ..config import ModelConfig
from ..parallel import Layout
from .layers import ColumnParallelLinear, RowParallelLinear, gelu, init_std_out


class MLP(nnx.Module):
    """GELU: h = gelu(x W_up); SwiGLU (Shazeer 2020): h = silu(x W_gate) * (x W_up).
    Then y = g(h W_down) + b_down.

    W_up: [D, F] (SwiGLU: gate and up fused as [D, 2, F]) column-parallel, each
    rank [D, (2,) F/tp]; W_down: [F, D] row-parallel, each rank [F/tp, D]. One
    all-reduce forward (g, after W_down) and one backward (f, the gradient of x
    entering W_up; fusing gate and up keeps it one).
    """

    def __init__(self, cfg: ModelConfig, layout: Layout, *, rngs: nnx.Rngs):
        kw = dict(use_bias=cfg.use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                  rngs=rngs)
        self.swiglu = cfg.style == "llama"
        F = cfg.d_ff
        up = ((2, F), (None, "mlp"), "CF") if self.swiglu else ((F,), ("mlp",), "F")
        self.up = ColumnParallelLinear(cfg.d_model, *up, layout, std=cfg.init_std, **kw)
        self.down = RowParallelLinear((F,), ("mlp",), "F", cfg.d_model, layout,
                                      std=init_std_out(cfg.init_std, cfg.n_layers), **kw)
        self.layout = layout
        self.tag = "mlp_out"  # the region's reduced output, for remat policies

    def __call__(self, x_BTD):
        with jax.named_scope("mlp"):
            return self.down.add_bias(parallel.region(self, x_BTD))

    def region(self, x_BTD, local):
        """Local math from x to the output summed over tp (`local.exit`)."""
        h_BTCF = checkpoint_name(local.enter(x_BTD, self.up.matmul(), self.up.out_axes),
                                 "mlp_up")  # sharded over F
        if self.swiglu:
            h_BTF = jax.nn.silu(h_BTCF[:, :, 0]) * h_BTCF[:, :, 1]
        else:
            h_BTF = gelu(h_BTCF)
        return local.exit(local.constrain(h_BTF, "batch", "seq", "mlp"), self.down.partial)
