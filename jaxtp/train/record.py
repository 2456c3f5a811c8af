"""The run record (`run.json`): what an engineer writes down for a TP experiment."""

from __future__ import annotations

from flax import nnx

from .. import hlo
from ..config import Config
from ..model.layers import ColumnParallelLinear, RowParallelLinear
from ..model.vocab import VocabEmbed
from ..parallel import known_bugs, split_over_tp


def linear_layouts(model) -> dict[str, str]:
    """'blocks.0.mlp.up' -> 'column', 'row', 'vocab-parallel' or 'replicated'
    (a kv projection with fewer kv heads than tp), for every linear and table."""
    kinds = {ColumnParallelLinear: "column", RowParallelLinear: "row",
             VocabEmbed: "vocab-parallel"}
    out = {}
    for path, mod in nnx.iter_modules(model):
        if type(mod) in kinds:
            w = mod.embedding if isinstance(mod, VocabEmbed) else mod.kernel
            spec = w.get_metadata().get("out_sharding") or ()
            split = split_over_tp(spec)
            out[".".join(map(str, path))] = kinds[type(mod)] if split else "replicated"
    return out


# the scopes of a block's collectives (the rest run outside the blocks)
BLOCK_SCOPES = ("attention", "mlp", "moe")


def run_record(cfg: Config, mesh, model, hlo_text: str, check: dict | None = None) -> dict:
    """What an engineer records for a TP experiment (written as run.json)."""
    m, p, schedule = cfg.model, cfg.parallel, model.schedule
    M, b = cfg.train.microbatches, schedule.rows  # (a rank's rows of a microbatch)
    colls = hlo.collectives(hlo_text)
    rows = hlo.summarize(colls)
    # per layer a loop trip runs (every layer once a microbatch; under a
    # pipeline its chunk once a tick: `jaxtp.analysis.rows.per_step`'s count)
    trips = schedule.layers_per_tick * schedule.ticks
    per_layer = [{**r, "count_per_layer": r["count"] / trips,
                  "payload_bytes": r["bytes"]}
                 for r in rows if r["scope"] in BLOCK_SCOPES]
    outside = [r for r in rows if r["scope"] not in BLOCK_SCOPES]
    return {
        **p.degrees, "impl": p.impl,  # (each axis of the table, `jaxtp.axes`)
        # pipeline parallelism's schedule and repeats (pp > 1)
        "pp_schedule": p.pp_schedule if p.pp > 1 else None,
        "pp_repeats": p.pp_repeats if p.pp > 1 else None,
        # context parallelism's strategy and causal load balance (cp > 1)
        "cp_attention": p.cp_attention if p.cp > 1 else None,
        "cp_balance": p.cp_balance if p.cp > 1 else None,
        "platform": mesh.devices.flat[0].platform,
        # [dp][tp], or with the pp, ep and cp axes where present: [pp][dp][ep][cp][tp]
        "mesh_device_ids": mesh.device_ids.tolist(),
        "model": {"d_model": m.d_model, "d_ff": m.d_ff, "n_heads": m.n_heads,
                  "n_kv_heads": m.kv_heads, "n_layers": m.n_layers, "vocab_size": m.vocab_size,
                  "padded_vocab": m.padded_vocab, "style": m.style, "dtype": m.dtype,
                  "attention": m.attention, "attention_block": m.attention_block,
                  "remat": m.remat, "loss_chunk": m.loss_chunk,
                  # a mixture of experts (n_experts > 0): E, top-k, hidden units, capacity
                  **({"n_experts": m.n_experts, "moe_top_k": m.moe_top_k,
                      "moe_d_ff": m.expert_d_ff, "capacity_factor": m.capacity_factor,
                      "moe_shared_d_ff": m.moe_shared_d_ff, "moe_every": m.moe_every}
                     if m.n_experts else {})},
        # s: the sequence; each cp rank holds s/cp of its positions
        "microbatch": {"b": b, "s": m.seq_len, "tokens": b * m.seq_len, "microbatches": M},
        "linear_layouts": linear_layouts(model),
        "collectives_per_layer": per_layer,
        "collectives_outside_blocks": outside,
        # per step, by the mesh axes each collective's groups span (full buffers)
        "collectives_by_axis": hlo.by_axis(colls, dict(mesh.shape)),
        "check": check,
        # bugs of the installed jaxlib this run meets, with the workaround applied
        "known_bugs": [b.to_dict() for b in known_bugs(cfg, mesh.devices.flat[0].platform)],
    }
