"""A router's decisions and losses, per group of tokens (one sequence, so
that the groups do not depend on how the batch is split; `jaxtp.model.moe`
runs them):

- the scores (`Routing`, `route`): a softmax over the E experts (Mixtral,
  Qwen) or each expert's sigmoid (DeepSeek-V3), the top k of them, from a
  token's best groups where set, their weights renormalised where
  `model.moe_norm_topk` and scaled;
- capacity (GShard, Lepikhin et al. 2020, Sec. 2.2): each expert takes at
  most C = ceil(cf * T * k / E) of a group's T tokens; assignments queue in
  router order, every token's first choice before any second choice (so a
  second choice is dropped before a first), and within a choice in token
  order, or by weight (`model.moe_drop=probs`); an assignment past C is
  dropped (the token keeps its other experts' outputs and the residual).
  cf = 0 is dropless: C = T, as no token picks an expert twice;
- dispatch and combine as dense one-hot tensors [G, T, E, C] (GShard's
  form, which the partitioner splits by the expert dim).

The two router losses, per microbatch over all its tokens:

- load balancing (Switch, Fedus et al. 2021, Eq. 4-6, generalised to top-k
  as Megatron-Core's `switch_load_balancing_loss_func`): E/k * sum_e f_e P_e,
  f_e the share of the tokens assigned to expert e (before capacity: the
  router's decision), P_e the mean affinity of e; 1 when the load is
  uniform; or per sequence (DeepSeek-V3's);
- router z-loss (Zoph et al. 2022, ST-MoE, Eq. 5): the mean over tokens of
  logsumexp(logits)^2, which keeps the router's logits small.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from ..config import ModelConfig
from ..parallel.collectives import wide


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a router's logits pick each token's experts and weigh them
    (`route`; the config's `model.moe_*` keys, `Routing.of`)."""
    k: int  # experts per token
    score: str = "softmax"  # "softmax" over the experts, or each expert's "sigmoid"
    norm_topk: bool = True  # the k weights renormalised to sum to 1
    groups: int = 1  # the experts in this many equal groups ...
    group_top_k: int = 0  # ... of which a token picks from its best this many; 0: all
    scale: float = 1.0  # the weights times this (DeepSeek-V3's routed_scaling_factor)
    drop: str = "position"  # past capacity: the latest in router order, or the least "probs"

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Routing":
        return cls(cfg.moe_top_k, cfg.moe_score, cfg.moe_norm_topk, cfg.moe_groups,
                   cfg.moe_group_top_k, cfg.moe_route_scale, cfg.moe_drop)


def _argmaxes(scores, n: int):
    """The indices of the n largest of the last dim [..., n] int32, in
    descending order (ties: the lower index first, as `lax.top_k`). By n
    argmaxes, not `lax.top_k`, which the partitioner splits by gathering its
    operand whole (measured on jax 0.10.2: the router's [B, T, E]
    all-gathered over ep in every layer)."""
    picked, left = [], scores
    for _ in range(n):
        i = jnp.argmax(left, -1).astype(jnp.int32)
        picked.append(i)
        left = jnp.where(jax.nn.one_hot(i, left.shape[-1], dtype=bool), -jnp.inf, left)
    return jnp.stack(picked, -1)


def _in_best_groups(choice_GTE, groups: int, top: int, k: int):
    """Which experts [G, T, E] bool lie in a token's `top` best of `groups`
    equal groups, a group's score the sum of its best k // top choice
    scores (DeepSeek-V3's node-limited routing, arXiv 2412.19437 Sec. 2.1.2,
    its top 2 at k = 8 of 4 groups; Megatron-Core's `group_limited_topk`)."""
    G, T, E = choice_GTE.shape
    per = choice_GTE.reshape(G, T, groups, E // groups)
    best = jnp.take_along_axis(per, _argmaxes(per, max(1, k // top)), -1).sum(-1)
    keep = jax.nn.one_hot(_argmaxes(best, top), groups, dtype=bool).any(-2)  # [G, T, groups]
    return jnp.repeat(keep, E // groups, -1)


def route(logits_GTE, routing: Routing, bias_E=None):
    """(weights [G, T, k], experts [G, T, k] int32, affinities [G, T, E]):
    each token's k experts by score (softmax over the experts, Mixtral's and
    Qwen's; or each expert's sigmoid, DeepSeek-V3's Eq. 15), in descending
    order, from the best `group_top_k` groups where set; `bias_E` (the
    loss-free balance's) added to the scores for the choice only (DeepSeek-V3
    Eq. 16). The weights are the chosen scores, renormalised where
    `norm_topk`, times `scale`. The affinities are the scores over their sum
    (DeepSeek-V3 Eq. 19's s'; the softmax's own): what the balance loss reads."""
    wide_GTE = logits_GTE.astype(wide(logits_GTE))
    if routing.score == "sigmoid":
        scores_GTE = jax.nn.sigmoid(wide_GTE)
        affinity_GTE = scores_GTE / scores_GTE.sum(-1, keepdims=True)
    else:
        scores_GTE = affinity_GTE = jax.nn.softmax(wide_GTE, axis=-1)
    choice_GTE = scores_GTE if bias_E is None else scores_GTE + bias_E.astype(scores_GTE.dtype)
    if routing.group_top_k and routing.group_top_k < routing.groups:
        choice_GTE = jnp.where(_in_best_groups(choice_GTE, routing.groups, routing.group_top_k,
                                               routing.k), choice_GTE, -jnp.inf)
    experts_GTk = _argmaxes(choice_GTE, routing.k)
    weights_GTk = jnp.take_along_axis(scores_GTE, experts_GTk, -1)
    if routing.norm_topk:
        weights_GTk = weights_GTk / weights_GTk.sum(-1, keepdims=True)
    if routing.scale != 1.0:
        weights_GTk = weights_GTk * routing.scale
    return weights_GTk, experts_GTk, affinity_GTE


def dispatch(experts_GTk, E: int, C: int, dtype=jnp.float32, by_GTk=None):
    """(dispatch [G, T, E, C] 0/1, kept [G, T, k] bool): assignment (t, j)
    takes slot p of expert experts[t, j], p the number of assignments to that
    expert before it in router order (choice j = 0 of every token, then
    j = 1, ...), or where `by_GTk` (Megatron-Core's drop policy "probs") the
    number with a larger `by` or an equal one before it; kept where p < C."""
    G, T, k = experts_GTk.shape
    if by_GTk is None:
        onehot_GkTE = jax.nn.one_hot(experts_GTk.transpose(0, 2, 1), E, dtype=jnp.int32)
        flat = onehot_GkTE.reshape(G, k * T, E)
        slot = (jnp.cumsum(flat, axis=1) - flat).reshape(G, k, T, E)  # earlier assignments
        slot_GTk = jnp.sum(slot * onehot_GkTE, -1).transpose(0, 2, 1)
    else:
        slot_GTk = _ranks(experts_GTk, by_GTk, E)
    kept_GTk = slot_GTk < C
    # one-hot over (expert, slot) of each kept assignment, summed over choices
    # (a token's k experts differ, so no two of its assignments share a cell)
    cell = jax.nn.one_hot(experts_GTk, E, dtype=dtype)[..., None] * \
        jax.nn.one_hot(jnp.where(kept_GTk, slot_GTk, C), C, dtype=dtype)[..., None, :]
    return cell.sum(2), kept_GTk


def _ranks(experts_GTk, by_GTk, E: int):
    """Each assignment's rank [G, T, k] among its expert's, by descending
    `by`, ties in router order: a stable sort of a group's k*T assignments
    by (expert, -by), less the expert's first place in it."""
    G, T, k = experts_GTk.shape
    e = experts_GTk.transpose(0, 2, 1).reshape(G, k * T)  # router order
    order = jnp.lexsort((-jax.lax.stop_gradient(by_GTk).transpose(0, 2, 1).reshape(G, k * T),
                         e), axis=-1)
    per_E = jax.nn.one_hot(e, E, dtype=jnp.int32).sum(1)  # [G, E]: each expert's count
    first = jnp.cumsum(per_E, -1) - per_E  # where each expert starts in the sort
    place = jnp.argsort(order, axis=-1).astype(jnp.int32)  # each assignment's place
    rank = place - jnp.take_along_axis(first, e, -1)
    return rank.reshape(G, k, T).transpose(0, 2, 1)


def combine(experts_GTk, weights_GTk, kept_GTk, E: int, C: int, dispatch_GTEC):
    """The combine tensor [G, T, E, C]: each kept assignment's cell holds its
    routing weight."""
    w_GTE = jnp.sum(jax.nn.one_hot(experts_GTk, E, dtype=weights_GTk.dtype)
                    * jnp.where(kept_GTk, weights_GTk, 0.0)[..., None], 2)
    return dispatch_GTEC * w_GTE[..., None]


def balance_loss(probs_GTE, experts_GTk, mean: Callable = lambda x: x,
                 parts: int = 0, f_E=None, name: str | None = None) -> jax.Array:
    """Switch's load-balancing loss for top-k: E/k * sum_e f_e P_e over all
    G*T tokens (1 when uniform; "aux"). `parts` > 0: over each sequence, a
    run of `parts` groups ([parts, G/parts] part-major, `MoE._groups`), then
    the mean over the sequences (DeepSeek-V3's sequence-wise loss, arXiv
    2412.19437 Eq. 17-20; "seq_aux"). `mean(a)`: a rank's mean over its
    tokens -> the mean over every rank's (`over_tokens`; outside a manual
    region the partitioner's). `f_E`, where given, the assignment shares to
    weigh P by (`shares`; "global_aux": the step's so far); `name`: P's
    remat name, where it is to be kept."""
    E, k = probs_GTE.shape[-1], experts_GTk.shape[-1]
    if parts:
        G, T = probs_GTE.shape[:2]
        seq = lambda a_GE: a_GE.reshape(parts, G // parts, E).sum(0) / (parts * T)
        f_SE = seq(jnp.sum(jax.nn.one_hot(experts_GTk, E, dtype=probs_GTE.dtype), (1, 2)))
        return mean(E / k * jnp.mean(jnp.sum(f_SE * seq(jnp.sum(probs_GTE, 1)), -1)))
    tokens = probs_GTE.shape[0] * probs_GTE.shape[1]
    f_E = shares(experts_GTk, E, probs_GTE.dtype, mean) if f_E is None else f_E
    P_E = mean(jnp.sum(probs_GTE, (0, 1)) / tokens)
    P_E = P_E if name is None else checkpoint_name(P_E, name)
    return E / k * jnp.sum(f_E * P_E)


def shares(experts_GTk, E: int, dtype, mean: Callable = lambda x: x) -> jax.Array:
    """Each expert's assignments per token over every rank's tokens [E]
    (k in all): the balance loss's f."""
    tokens = experts_GTk.shape[0] * experts_GTk.shape[1]
    return mean(jnp.sum(jax.nn.one_hot(experts_GTk, E, dtype=dtype), (0, 1, 2)) / tokens)


def running(prior_E, own_E) -> jax.Array:
    """Megatron-Core's global_aux f at a step's m-th microbatch: the shares
    of the microbatches so far, `prior_E` (the m - 1 before, summed) and
    this one's, averaged (each sums to k; equal-sized microbatches)."""
    k = jnp.sum(own_E)
    return (prior_E + own_E) * k / jnp.sum(prior_E + own_E)


def counted(bias_E, experts_GTk) -> jax.Array:
    """0, whose gradient with respect to `bias_E` is the number of this
    group's assignments to each expert [E]: the step's gradient reduction
    sums a layer's counts over its microbatches and ranks into the bias's
    gradient, from which the optimizer moves it (`jaxtp.train.optim`)."""
    E = bias_E.shape[-1]
    counts_E = jax.lax.stop_gradient(jnp.sum(jax.nn.one_hot(experts_GTk, E, dtype=bias_E.dtype),
                                             (0, 1, 2)))
    return jnp.sum(counts_E * (bias_E - jax.lax.stop_gradient(bias_E)))


def z_loss(logits_GTE, mean: Callable = lambda x: x) -> jax.Array:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2."""
    return mean(jnp.mean(jax.nn.logsumexp(logits_GTE.astype(wide(logits_GTE)), axis=-1) ** 2))


def load(experts_GTk, E: int, dtype=jnp.float32) -> jax.Array:
    """The share of the assignments each expert gets [E] (before capacity)."""
    return jnp.mean(jax.nn.one_hot(experts_GTk, E, dtype=dtype), (0, 1, 2))
