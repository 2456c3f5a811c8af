"""A mixture of experts' config rules (`jaxtp.model.moe`): the choices its
keys take and the checks that need nothing but the config. Each check
returns the ConfigError's message, or None; `jaxtp.checks` raises it (this
module imports nothing of jaxtp, as `jaxtp.axis_checks`)."""

from __future__ import annotations

# how a MoE layer's tokens reach their experts (jaxtp.model.moe, jaxtp.parallel.ep)
MOE_DISPATCHES = ("dense", "ragged")
# the router's scores, and what goes past an expert's capacity (`moe.Routing`)
MOE_SCORES = ("softmax", "sigmoid")
MOE_DROPS = ("position", "probs")
# what remat keeps of ep's slots (`jaxtp.model.block.block_fn`)
MOE_SLOTS = ("keep", "resend")
# the balance loss over a microbatch's tokens or per sequence (`routing.balance_loss`),
# or the loss-free bias (`routing.counted`, `jaxtp.train.optim.loss_free_bias`)
MOE_BALANCES = ("aux", "seq_aux", "global_aux", "bias", "bias+seq_aux")
# the keys that act only with a mixture of experts (model.n_experts > 0)
MOE_KEYS = ("moe_top_k", "moe_d_ff", "moe_norm_topk", "moe_score", "moe_groups",
            "moe_group_top_k", "moe_route_scale", "moe_drop", "moe_shared_d_ff",
            "moe_shared_gate", "moe_every", "moe_first_dense", "capacity_factor",
            "moe_dispatch", "moe_slots", "moe_balance", "moe_balance_coef", "moe_bias_rate",
            "moe_z_coef")


def routing_error(m) -> str | None:
    """What the router's keys must keep (`model.moe_*`, `moe.Routing`)."""
    E = m.n_experts
    if not 1 <= m.moe_top_k <= E:
        return f"model.moe_top_k={m.moe_top_k} must be between 1 and model.n_experts={E}"
    if E % m.moe_groups:
        ok = [g for g in range(1, E + 1) if E % g == 0]
        return (f"model.moe_groups={m.moe_groups} must divide model.n_experts={E} (equal "
                f"groups of experts); choose one of {ok}")
    if m.moe_group_top_k > m.moe_groups:
        return (f"model.moe_group_top_k={m.moe_group_top_k} picks more groups than "
                f"model.moe_groups={m.moe_groups}: set it to at most {m.moe_groups} (0: all)")
    if m.moe_group_top_k and m.moe_top_k > m.moe_group_top_k * (E // m.moe_groups):
        return (f"model.moe_top_k={m.moe_top_k} experts cannot come from "
                f"model.moe_group_top_k={m.moe_group_top_k} groups of {E // m.moe_groups}: "
                "raise moe_group_top_k, or lower moe_top_k")
    if m.moe_group_top_k and m.moe_top_k < m.moe_group_top_k:
        return (f"a group's score sums its best moe_top_k // moe_group_top_k experts' "
                f"(DeepSeek-V3's), and model.moe_top_k={m.moe_top_k} is below "
                f"model.moe_group_top_k={m.moe_group_top_k}: lower moe_group_top_k")
    if m.moe_drop == "probs" and not m.capacity_factor:
        return ("model.moe_drop='probs' chooses what goes past an expert's capacity, and "
                "model.capacity_factor=0 is dropless: set a capacity factor, or drop it")
    return None


def layout_error(m, p) -> str | None:
    """What the balance (`model.moe_balance`) and the slots' remat need, and
    are not built with yet."""
    if m.moe_slots == "resend" and p.sequence_parallel:
        return ("model.moe_slots=resend is not built with --sp yet (the slots' tp gather "
                "and scatter would run again too): use model.moe_slots=keep")
    if m.moe_balance.startswith("bias") and not m.moe_bias_rate:
        return (f"model.moe_balance={m.moe_balance!r} moves a bias by model.moe_bias_rate a "
                "step, and 0 never moves it: set it (DeepSeek-V3: 0.001), or use aux")
    if m.moe_balance == "bias+seq_aux" and not m.moe_balance_coef:
        return ("model.moe_balance='bias+seq_aux' adds the sequence-wise loss times "
                "model.moe_balance_coef, which is 0: set it (DeepSeek-V3: 0.0001), or use bias")
    if m.moe_balance.endswith("seq_aux") and p.pp > 1 and (p.cp > 1 or p.sequence_parallel):
        return ("model.moe_balance='seq_aux' sums each sequence's parts, and a pipeline's "
                f"stage holds one part of each under {'--cp' if p.cp > 1 else '--sp'}: not "
                "built yet; use model.moe_balance=aux there")
    if m.moe_balance == "global_aux" and p.pp > 1:
        return ("model.moe_balance='global_aux' carries the shares from microbatch to "
                "microbatch, and a pipeline's stages run several at once: not built for --pp; "
                "use model.moe_balance=aux there (global over the ranks, per microbatch)")
    return None


def layers_error(m, pp: int) -> str | None:
    """Which layers are MoE (`moe_every`, `moe_first_dense`), and what a
    scanned or pipelined stack of them needs."""
    if m.moe_shared_gate and not m.moe_shared_d_ff:
        return ("model.moe_shared_gate gates the shared expert, and model.moe_shared_d_ff=0 "
                "has none: set moe_shared_d_ff (Qwen2-MoE: 4 x moe_d_ff), or drop the gate")
    if m.moe_dispatch == "ragged" and m.capacity_factor:
        return (f"model.moe_dispatch='ragged' is dropless, and model.capacity_factor="
                f"{m.capacity_factor} drops: set model.capacity_factor=0, or "
                "model.moe_dispatch=dense")
    if m.moe_first_dense >= m.n_layers:
        return (f"model.moe_first_dense={m.moe_first_dense} leaves no MoE layer of "
                f"model.n_layers={m.n_layers}: set it below n_layers")
    if not 1 <= m.moe_every <= m.stacked_layers:
        return (f"model.moe_every={m.moe_every} must be between 1 (every layer a mixture of "
                f"experts) and model.n_layers={m.n_layers}")
    if m.moe_every > 1 and m.moe_shared_d_ff > 0:
        return (f"model.moe_every={m.moe_every} mixes dense and MoE blocks, which is not "
                "built with model.moe_shared_d_ff (a shared expert where only some layers "
                "are MoE)")
    if m.stacked_layers % m.moe_every and (m.scan_layers or pp > 1):
        lead = f" after model.moe_first_dense={m.moe_first_dense}" if m.moe_first_dense else ""
        return (f"a {'pipelined' if pp > 1 else 'scanned'} stack repeats groups of "
                f"model.moe_every={m.moe_every} layers (dense, then MoE), and the "
                f"{m.stacked_layers} layers{lead} are not a multiple of it: set "
                "model.n_layers to one" + ("" if pp > 1 else ", or model.scan_layers=false"))
    return None
