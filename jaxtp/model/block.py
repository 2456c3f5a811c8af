"""A Transformer block (pre-norm attention and MLP, or a mixture of
experts), the stack's unit where the layers mix kinds (`Group`), and the
remat policies a block runs under (`model.remat`)."""

from __future__ import annotations

import jax
from flax import nnx

from ..config import REMATS, ModelConfig
from ..parallel import Layout, constrain
from ..parallel.context import KV_NAME as CP_KV
from ..parallel.ep import SLOTS_NAME as EP_SLOTS
from .attention import Attention
from .layers import dropout, make_norm
from .mlp import MLP
from .moe import MoE


class Block(nnx.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); the residual stream is
    replicated over tp, or split along the sequence under SP. With
    `model.n_experts` the MLP is a mixture of experts (`jaxtp.model.moe`),
    and a call returns (x, the layer's router statistics)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, *, rngs: nnx.Rngs,
                 moe: bool | None = None):
        self.ln1 = make_norm(cfg, layout)
        self.attn = Attention(cfg, layout, rngs=rngs)
        self.ln2 = make_norm(cfg, layout)
        # (`moe`: this layer's kind, `model.moe_every`; None: every layer's)
        self.moe = cfg.n_experts > 0 if moe is None else moe
        self.mlp = MoE(cfg, layout, rngs=rngs) if self.moe else MLP(cfg, layout, rngs=rngs)
        self.rate = cfg.dropout
        self.layout = layout

    def _ffn(self, x_BTD, *prior_E):
        """(the MLP's output, router statistics or None; `prior_E`: a MoE's
        running shares, `jaxtp.model.moe.moe`)."""
        out = self.mlp(self.ln2(x_BTD), *prior_E) if self.moe else self.mlp(self.ln2(x_BTD))
        return out if self.moe else (out, None)

    def extend(self, x_BTD, k_BSKH, v_BSKH, pos_BT, prefill: bool):
        """The block over new positions, reading and extending its KV cache."""
        a_BTD, k_BSKH, v_BSKH = self.attn.extend(self.ln1(x_BTD), k_BSKH, v_BSKH, pos_BT,
                                                 prefill)
        x_BTD = x_BTD + a_BTD
        return constrain(x_BTD + self._ffn(x_BTD)[0], *self.layout.residual), \
            k_BSKH, v_BSKH

    def __call__(self, x_BTD, key=None, *prior_E):
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        x_BTD = x_BTD + dropout(self.attn(self.ln1(x_BTD)), self.rate, k1)
        y_BTD, stats = self._ffn(x_BTD, *prior_E)
        x_BTD = constrain(x_BTD + dropout(y_BTD, self.rate, k2), *self.layout.residual)
        return (x_BTD, stats) if self.moe else x_BTD


class Group(nnx.Module):
    """The stack's unit where its layers are not all of one kind: `period`
    consecutive blocks (`model.moe_every`: its dense layers, then a MoE
    layer), so that a scan or a pipeline stage repeats one structure. A
    stacked stack of them holds, for each position j, the blocks j, j + k,
    j + 2k, ... on a leading axis (`stack_layers`)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, *, rngs: nnx.Rngs):
        k = cfg.layer_group  # (its last block the MoE one, `ModelConfig.is_moe_layer`)
        self.layers = nnx.List([Block(cfg, layout, rngs=rngs, moe=j == k - 1) for j in range(k)])


def unit_of(cfg: ModelConfig, layout: Layout, rngs: nnx.Rngs):
    """The stack's unit: a Block, or a Group where the layers mix kinds."""
    if cfg.layer_group == 1:
        return Block(cfg, layout, rngs=rngs)
    return Group(cfg, layout, rngs=rngs)


def layers_of(unit) -> list:
    return list(unit.layers) if isinstance(unit, Group) else [unit]


_names = jax.checkpoint_policies.save_only_these_names
# The reduced outputs of the attention and MLP regions (after g). Every policy keeps them:
# recomputing one would repeat its forward all-reduce (or SP reduce-scatter) in the
# backward. (XLA keeps only what the backward reads: the attention's, not the MLP's.)
REGION_OUTPUTS = ("attn_out", "mlp_out")
# (a MoE's own assignment shares under "global_aux" over microbatches, summed
# over the ranks: kept by every policy, so the backward does not sum them again)
SHARES = ("moe_shares",)
# CP_KV: the K/V a context-parallel rank received from the others (all-gathered,
# or each ring hop's chunk), and EP_SLOTS: the slots ep's all-to-alls delivered
# (to the experts and back): kept by every policy but "full" (and the slots not
# under `model.moe_slots=resend`), so the backward does not repeat the collectives
def _policies(slots: tuple = (EP_SLOTS,)) -> dict:
    return {
        "none": None,  # keep every activation the backward pass needs
        # recompute the whole block but the region outputs
        "full": _names(*REGION_OUTPUTS, *SHARES),
        # the weight matmuls' outputs (no batch dims); recompute norms, activations, core
        "dots": jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            _names(*REGION_OUTPUTS, *SHARES, CP_KV, *slots)),
        # the tagged projection outputs only (q/k/v, MLP up, the region outputs: under
        # SP their sequence shards); recompute norms, activations, the core (cp's K/V)
        "minimal": _names("qkv", "mlp_up", *REGION_OUTPUTS, *SHARES, CP_KV, *slots)}


REMAT_POLICIES = _policies()
assert tuple(REMAT_POLICIES) == REMATS  # the config's list of names is the one source


def block_fn(remat: str, slots: str = "keep"):
    """(block, x, key) -> x, rematerialised by the named policy (without ep's
    slots where `slots` is "resend", `model.moe_slots`)."""
    call = lambda block, x, key, *prior: block(x, key, *prior)
    policies = REMAT_POLICIES if slots == "keep" else _policies(())
    return call if remat == "none" else nnx.remat(call, policy=policies[remat])
