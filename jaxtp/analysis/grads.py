"""The gradient ledger: one table of every parameter's gradient sums (`Part`),
derived per parameter from its sharding and the Schedule, grouped into rows.

A parameter's gradient is summed over the mesh axes that split the tokens it
sees, minus its own axes (`reduced_over`): the batch axes (dp; ep, but for a
MoE layer's experts, which ep's ranks own: Megatron-Core's expert-data-
parallel group; pp for the weights outside a pipeline's stages, whose stages
split the batch as dp does), cp's sequence split, and under SP tp's for the
parameters used on the sequence shard (norms, row-parallel biases, learned
positions). FSDP's parameters own dp, where their gradient is reduce-
scattered instead (ZeRO-3, Rajbhandari et al. 2020, Sec. 5.1). Where the sum
runs (`placed`, `_once`, `jaxtp.analysis.dp.fsdp_parts`,
`jaxtp.analysis.pp.pipeline_parts`: each places one parameter):

- written in a shard_map region (shard_map's region weights, and under SP
  its replicated kv weight), and a MoE layer's experts under every impl: one
  psum over all of its axes at once, per microbatch;
- placed by GSPMD (every other gradient): the sequence axes (cp, and tp) in
  one all-reduce, then the batch axes in another; a router used on sequence
  shards (cp, SP) over all of them at once;
- in slices reduced once (`jaxtp.parallel.Schedule.reduces_once`): the dp
  part of every gradient once per step, after the slices;
- around a pipeline: a stage's weights once per step, after it (manual over
  the batch axes it is); the weights outside the stages over pp too.

A parameter's own facts (`_Grad`): a tied table is summed in two parts (lookup,
head), the head's once per loss chunk; the learned positions' sum over dp
reduces only the rank's own sequence rows; each part is summed in the dtype
it is used in (`jaxtp.analysis.params.part_dtypes`). Rows are the table
grouped by rule, axes and dtype (XLA combines only collectives of one dtype).
"""

from __future__ import annotations

import dataclasses
import math

from ..config import Config
from ..model.vocab import loss_chunks
from ..parallel import CP_AXIS, DATA_AXIS, EP_AXIS, PP_AXIS, TP_AXIS
from .backends import gradients_on_backend
from .dp import fsdp_parts, moe_fsdp_parts
from .params import ParamShard, param_shards, part_dtypes
from .pp import in_pipeline, pipeline_parts
from .rows import (ANY_SCOPE, HLO_DTYPES, Expected, batch_axes, counts_local, moe_per_tick, on,
                   reduces_once, runs_head, schedule_of)


@dataclasses.dataclass(frozen=True)
class Part:
    """One sum of one parameter's gradient: a line of the table."""

    path: str
    rule: str  # the placement that sums it: its row's name
    kind: str
    elements: int
    dtype: str
    axes: tuple[str, ...]
    per: str = "microbatch"
    written: bool = True
    role: str = "grads"  # (a compiler's rule on the row, `jaxtp.analysis.backends`)
    scope: str = ANY_SCOPE
    count: int = 1
    pass_: str = "backward"
    use: str = ""  # a vocab table's "lookup" or "head" part (else "")


def _group(cfg: Config, axes: tuple[str, ...]) -> int:
    return math.prod(cfg.parallel.degrees[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class _Grad:
    """A parameter's gradient as the sums see it."""

    shard: ParamShard
    sums: int  # how many times its gradient is summed apart (a tied table's parts)
    seq: tuple[str, ...]  # the sequence axes its sum spans (cp, and tp under SP)
    written: bool  # summed by a psum in a shard_map region
    dp_elements: int  # what the sum over dp alone reduces (positions: its own rows)
    keyed: bool  # its sum over the sequence axes is a row of its own (`_sequence_parts`)
    dtypes: tuple[str, ...]  # the dtype each of its `sums` parts is summed in
    uses: tuple[str, ...]  # what each part is of: a table's "lookup" or "head", else ""
    batch: tuple[str, ...]  # the batch axes that split its tokens (`batch_axes`)
    expert: bool  # a MoE layer's experts (ep's ranks own them)
    router: bool

    def part(self, rule: str, elements: int, dtype: str, axes: tuple[str, ...],
             **kw) -> Part:
        return Part(self.shard.path, rule, kw.pop("kind", "all-reduce"), elements, dtype,
                    axes, **kw)


def _grads(cfg: Config, impl: str) -> list[_Grad]:
    m, p = cfg.model, cfg.parallel
    sp = p.sequence_parallel
    once = reduces_once(cfg)
    # the head's gradient is summed over the batch axes once per loss chunk
    # (XLA sums each chunk's part in the loop over them), and under cp per
    # chunk of each rank's positions
    chunks = 1 if p.fsdp else loss_chunks(m.loss_chunk, schedule_of(cfg).head_rows,
                                          m.seq_len // p.cp)[0]
    out = []
    for s in param_shards(cfg):
        bias = s.path.endswith("/mlp/router_bias")
        if bias and m.remat == "none" and not counts_local(cfg):  # (its counts summed
            continue  # in the forward, `ep`; a remat recounts them, summed as a gradient)
        # (a pipeline's stage is manual over cp: its weights' cp part is summed
        # once a step, with the stage's, `_pipelined`)
        seq = (CP_AXIS,) * (p.cp > 1 and not in_pipeline(cfg, s.path, s.in_stack))
        if sp and not s.region and not _whole_over_tp(cfg, impl, s):
            seq += (TP_AXIS,)  # used on the sequence shard: partial over tp
        uses = ("",)
        if s.path in ("wte/embedding", "lm_head/embedding") and not once:
            lookup = s.path == "wte/embedding"
            head = m.tie_embeddings or not lookup
            uses = ("lookup",) * lookup + ("head",) * (chunks if head else 0)
        sums = len(uses)
        dp_elements = s.elements
        if s.path == "wpe/embedding" and not once:
            dp_elements = m.seq_len // (p.cp * (p.tp if sp else 1)) * m.d_model
        expert, router = "/mlp/experts/" in s.path, bias or s.path.endswith("/mlp/router")
        keyed = not router and (TP_AXIS in seq or _sp_kv(cfg, impl, s) or (
            s.path == "wpe/embedding" and impl == "explicit" and p.cp > 1))
        out.append(_Grad(s, sums, seq, impl == "shard_map" and bool(s.region), dp_elements,
                         keyed, part_dtypes(cfg, impl, s.path, sums), uses,
                         on(cfg, DATA_AXIS, *(EP_AXIS,) * (not expert)), expert, router))
    return out


def _whole_over_tp(cfg: Config, impl: str, s: ParamShard) -> bool:
    """GSPMD sums the attention's row-parallel bias under SP from the output
    gradient it gathered anyway: whole over tp (but not in slices reduced
    once, where dp is manual, nor in a pipeline's stages, where pp is, nor
    under the overlap, where the gradient reaches the bias split along T);
    so a gated shared expert's, whose gate reads its output."""
    gated = cfg.model.moe_shared_gate and s.path.endswith("mlp/shared/down/bias")
    return ((s.path.endswith("attn/out/bias") or gated) and impl == "gspmd"
            and not reduces_once(cfg) and cfg.parallel.pp == 1
            and cfg.parallel.overlap == "none")


def _sp_kv(cfg: Config, impl: str, s: ParamShard) -> bool:
    """shard_map's replicated kv weight under SP with fewer kv heads than tp:
    fed the gathered x, its gradient is partial over tp too."""
    p = cfg.parallel
    return (s.path.endswith("attn/kv/kernel") and impl == "shard_map" and p.sequence_parallel
            and cfg.model.kv_heads < p.tp)


def gradient_table(cfg: Config, impl: str, platform: str = "") -> list[Part]:
    """Every sum of every parameter's gradient in a step: the placement the
    Schedule and the layout give it (module docstring), one `Part` each."""
    p = cfg.parallel
    grads = _grads(cfg, impl)
    table = _sequence_parts(cfg, impl, grads) + _sp_kv_parts(cfg, impl, grads)
    if p.pp > 1:
        place = pipeline_parts
    elif not (batch_axes(cfg) or on(cfg, CP_AXIS)):
        return table
    elif reduces_once(cfg):
        place = _once
    elif p.fsdp and p.dp > 1:
        place = moe_fsdp_parts if cfg.model.n_experts else fsdp_parts
    else:
        place = placed
    # (a placement's None: the parameter is placed as without it)
    out = [place(cfg, impl, g, platform) for g in grads]
    return table + [part for g, parts in zip(grads, out)
                    for part in (placed(cfg, impl, g) if parts is None else parts)]


def reduced_over(cfg: Config, impl: str) -> dict[str, tuple[str, ...]]:
    """{parameter path: the mesh axes its gradient is summed over}, read off
    the table: what the parts of its sums span together (FSDP's
    reduce-scatter over dp aside: dp is its own axis there)."""
    out: dict[str, tuple[str, ...]] = {}
    for part in gradient_table(cfg, impl):
        if part.kind == "reduce-scatter":  # (FSDP's own dp: scattered, not summed)
            continue
        have = out.setdefault(part.path, ())
        out[part.path] = have + tuple(a for a in part.axes if a not in have)
    return {path: tuple(a for a in (PP_AXIS, DATA_AXIS, EP_AXIS, CP_AXIS, TP_AXIS) if a in axes)
            for path, axes in out.items()}


def expected_grads(cfg: Config, impl: str, platform: str = "") -> list[Expected]:
    """Every gradient sum of a step, the table grouped (one row per rule,
    axes, dtype and count), and the loss's mean over the axes that split the
    tokens."""
    rows: dict[tuple, Expected] = {}
    for t in gradients_on_backend(gradient_table(cfg, impl, platform), cfg, impl, platform):
        total = t.scope == ANY_SCOPE  # (its elements add up; a scoped row's count does)
        key = (t.rule, t.kind, t.pass_, t.scope, t.dtype, t.axes, t.per, t.written, t.role,
               None if total else t.elements)
        had = rows.get(key, Expected("", "", "", "", 0, "", 0, 0))
        rows[key] = Expected(t.rule, t.kind, t.pass_, t.scope, had.elements + t.elements * t.count
                             if total else t.elements, t.dtype, _group(cfg, t.axes),
                             1 if total else had.count + t.count, t.role, t.axes, t.written,
                             t.per)
    return _loss_means(cfg, impl) + [r for r in rows.values() if r.elements]


def _loss_means(cfg: Config, impl: str) -> list[Expected]:
    """The loss averaged over the axes that split its tokens, where the
    gradients are summed: per microbatch over cp and then the batch axes (or
    at once in a region); once after slices reduced once; once after a
    pipeline (1F1B, whose loss is in its loop, over all at once). A MoE
    model's joins its router's statistics' means in one total."""
    p = cfg.parallel
    batch, cp = batch_axes(cfg), on(cfg, CP_AXIS)
    if p.pp > 1:
        outer = on(cfg, PP_AXIS) + batch
        steps, per = ([outer + cp] if runs_head(cfg) else [outer, cp]), "step"
    elif not batch + cp:
        return []
    elif reduces_once(cfg):
        return [_loss_mean(cfg, batch, "other", "step")]
    elif p.fsdp and p.dp > 1 and not cfg.model.n_experts:
        steps, per = [on(cfg, DATA_AXIS), cp], "microbatch"
    else:
        steps, per = ([cp, batch] if batch and cp else [batch + cp]), "microbatch"
    return [_loss_mean(cfg, a, "forward", per) for a in steps if a]


def _loss_mean(cfg: Config, axes: tuple[str, ...], pass_: str, per: str) -> Expected:
    over = " x ".join(axes)
    return Expected(f"{over}: mean of the loss over {over}", "all-reduce", pass_,
                    ANY_SCOPE if cfg.model.n_experts else "", 1, "f32", _group(cfg, axes), 1,
                    "loss_mean", axes, pass_ == "other", per)


def placed(cfg: Config, impl: str, g: _Grad, platform: str = "") -> list[Part]:
    """Per microbatch: a written gradient's (and the experts') one psum over
    its batch axes and cp; a router on sequence shards over all its axes at
    once; GSPMD's sum over the sequence axes (what `_sequence_parts` does not
    sum) and then over the batch axes."""
    p = cfg.parallel
    cp = on(cfg, CP_AXIS)
    over = lambda a: " x ".join(a)
    if _sp_kv(cfg, impl, g.shard):  # (its whole sum is its own part, `_sp_kv_parts`)
        return []
    if g.expert:
        return [g.part(f"{over(g.batch + cp)}: the experts' weight gradients (ep owns its "
                       "experts)", g.shard.elements, g.dtypes[0], g.batch + cp,
                       role="moe_grads")] if g.batch + cp else []
    if g.written:
        axes = g.batch + cp
        return [g.part(f"{over(axes)}: every parameter gradient (tp shard), summed over "
                       f"{over(axes)} in its region", g.shard.elements, dt, axes, use=use)
                for use, dt in zip(g.uses, g.dtypes)]
    if g.router and (p.cp > 1 or p.sequence_parallel):
        axes = g.batch + g.seq
        return [g.part("the router's gradient over every axis that splits the tokens",
                       g.shard.elements, g.dtypes[0], axes, role="router", written=False)]
    every = batch_axes(cfg) + cp
    out = []
    for axes in ([cp, g.batch] if g.batch and cp else [g.batch + cp]):
        n = g.dp_elements if axes == g.batch else 0 if g.keyed else g.shard.elements
        name = (f"{over(every)}: parameter gradients outside the regions (norms, biases, "
                f"positions), summed over {over(axes)} by GSPMD" if impl == "shard_map" else
                f"{over(axes)}: every parameter gradient (tp shard), summed over {over(axes)}")
        out += [g.part(name, n, dt, axes, written=impl != "shard_map", use=use,
                       role="grads_placed" if impl == "shard_map" else "grads")
                for use, dt in zip(g.uses, g.dtypes)]
    return out


def _once(cfg: Config, impl: str, g: _Grad, platform: str = "") -> list[Part]:
    """Slices reduced once: the whole gradient (tp shard) summed over dp once
    per step, after them, in its own dtype."""
    M = cfg.train.microbatches
    return [g.part(f"dp: every parameter gradient (tp shard), summed over dp once after {M} "
                   "microbatches", g.shard.elements, HLO_DTYPES[cfg.model.param_dtype],
                   (DATA_AXIS,), per="step", pass_="other")]


def _sequence_parts(cfg: Config, impl: str, grads: list[_Grad]) -> list[Part]:
    """The sums over the sequence axes of the parameters used on the
    sequence shard, per parameter, under SP (over cp x tp at once) or, for
    explicit's learned positions, under cp (gathered rows); a stage's router
    on sequence shards over tp in every layer and tick (shard_map)."""
    m, p = cfg.model, cfg.parallel
    once = reduces_once(cfg)
    out = []
    for g in grads:
        s = g.shard
        if g.router and p.pp > 1 and p.sequence_parallel and impl == "shard_map":
            # (its dp x ep part once, with the stage's weights; in each MoE
            # layer of a tick)
            out.append(g.part("moe: the router's gradient over tp (its tokens on sequence "
                              "shards)", m.d_model * m.n_experts, g.dtypes[0], (TP_AXIS,),
                              scope="moe", role="moe", count=moe_per_tick(cfg), per="wtick"))
        positions = s.path == "wpe/embedding"
        if not g.keyed or _sp_kv(cfg, impl, s):
            continue
        # a stacked parameter's (scanned, or a pipeline's stage's: its L/pp
        # layers, a chunk of L/(pp*v) per tick) one layer per loop trip;
        # outside a pipeline once
        held = m.stacked_layers // m.layer_group // p.pp \
            if s.in_stack and (m.scan_layers or p.pp > 1) else 1
        layers = held // p.pp_repeats if s.in_stack else 1
        # outside a pipeline's loop once a step, but 1F1B's head (the final
        # norm) runs in it, once a microbatch; a stage's layers once a tick
        in_loop = s.in_stack or (runs_head(cfg) and s.path.startswith("ln_f/"))
        per = ("step" if not in_loop else "wtick" if s.in_stack else "microbatch") \
            if p.pp > 1 else "microbatch"
        module = s.path.split("/")[-2]
        bias = module in ("out", "down")  # a row-parallel bias (its kernel is a region's)
        # explicit reshards the positions from replicated to the sequence
        # split, whose transpose gathers the gradient's rows; so does every
        # impl in slices reduced once (dp is manual there)
        gather = positions and (impl == "explicit" or once)
        what = ("learned positions on sequence shards: gradient sum"
                + (" (gathered rows)" if gather else "") if positions else
                f"{'attention' if module == 'out' else 'mlp'} row-parallel bias on sequence "
                "shards: gradient sum"
                if bias else "norm weights used on sequence shards: gradient sum")
        scope = ("attention" if module == "out" else "mlp") if bias else ""
        out.append(g.part(what, s.elements // held, g.dtypes[0], g.seq,
                          kind="all-gather" if gather else "all-reduce", per=per,
                          count=layers, scope=scope, written=False,
                          role="positions" if positions else "seq_shard_param"))
        if positions and once and impl != "explicit":
            # GSPMD partitions the positions' scatter-add in the dp-manual
            # region by gathering its indices (loop-invariant: once per step)
            out.append(g.part("learned positions: the gradient scatter's indices gathered",
                              m.seq_len, "s32", g.seq, kind="all-gather", per="step",
                              scope="", written=False, role="positions_ids"))
    return out


def _sp_kv_parts(cfg: Config, impl: str, grads: list[_Grad]) -> list[Part]:
    """`_sp_kv`'s weight gradient (in the compute dtype it multiplied), summed
    over the batch axes, cp and tp at once, one psum per layer; FSDP's dp
    part is the weight's reduce-scatter, and in slices reduced once dp comes
    after them."""
    m, p = cfg.model, cfg.parallel
    kv = next((g for g in grads if _sp_kv(cfg, impl, g.shard)), None)
    if kv is None:
        return []
    over = on(cfg, *(DATA_AXIS,) * (not (p.fsdp or reduces_once(cfg))), EP_AXIS, CP_AXIS)
    return [kv.part("replicated kv weight gradient: sum over tp" + "".join(
        f" and {a}" for a in over), m.d_model * 2 * m.kv_heads * m.head_dim,
        HLO_DTYPES[m.dtype], over + (TP_AXIS,), per="wlayer", scope="attention", role="")]
