"""The gradient ledger: where each parameter's gradient is summed, by one rule.

A parameter's gradient is summed over the mesh axes that split the tokens it
sees, minus the parameter's own axes (`reduced_over`, per parameter). dp and cp split the
batch and the sequence for every parameter; under SP the parameters used on
the sequence shard (norms, row-parallel biases, learned positions) see tp's
split of the sequence too; FSDP's parameters own dp, where their gradient is
reduce-scattered instead (ZeRO-3, Rajbhandari et al. 2020, Sec. 5.1). How a
sum is carried out (`_placed`):

- written in a shard_map region (shard_map's region weights, and under SP
  its replicated kv weight): one psum over all of its axes;
- placed by GSPMD (every gradient under gspmd and explicit, shard_map's
  outside its regions): the sequence axes (cp, and tp) in one all-reduce,
  then dp in another;
- in slices reduced once (`jaxtp.parallel.Schedule.reduces_once`): the dp
  part of every gradient once per step, after the slices.

What else decides the bytes is the parameter's own (`_Grad`): a tied table is
summed twice (its lookup's and its head's parts, apart), the head's once per
loss chunk under cp (the chunks are taken within each rank's positions); the
learned positions' gradient lives on the rank's own sequence rows, which are
all that the sum over dp reduces; explicit gathers the positions' gradient
rows over the sequence axes instead of summing them.

And the dtype each part is summed in (`part_dtypes`): a weight cast to the
compute dtype where it is used (`jaxtp.model.layers.weight(v, dtype)`: the
linears' kernels and biases, the learned positions, the experts) has its
gradient summed in that dtype, before the cast back; one used in its own
dtype (the norms, the vocab lookup, the router) in its own. Each total is
then one row per dtype (XLA combines only collectives of one dtype).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..config import Config
from ..model.vocab import loss_chunks
from ..parallel import CP_AXIS, DATA_AXIS, PP_AXIS, TP_AXIS
from .params import ParamShard, param_shards
from .rows import ANY_SCOPE, HLO_DTYPES, Expected, reduces_once, schedule_of


def data_group(cfg: Config) -> tuple[int, tuple[str, ...]]:
    """(size, mesh axes) of the axes that split every parameter's tokens: dp
    and cp (each rank's gradient is its tokens' part)."""
    p = cfg.parallel
    axes = tuple(a for a, n in ((DATA_AXIS, p.dp), (CP_AXIS, p.cp)) if n > 1)
    return p.dp * p.cp, axes or (DATA_AXIS,)


@dataclasses.dataclass(frozen=True)
class _Grad:
    """A parameter's gradient as the sums see it."""

    shard: ParamShard
    sums: int  # how many times its gradient is summed apart (a tied table's parts)
    seq: tuple[str, ...]  # the sequence axes its sum spans (cp, and tp under SP)
    written: bool  # summed by a psum in a shard_map region
    dp_elements: int  # what the sum over dp alone reduces (positions: its own rows)
    keyed: bool  # its sum over the sequence axes is a row of its own (`_sequence_rows`)
    dtypes: tuple[str, ...] = ()  # the dtype each of its `sums` parts is summed in

    def parts(self, dtype: str) -> int:
        """How many of its parts are summed in `dtype`."""
        return self.dtypes.count(dtype)


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
        # (a pipeline's stage is manual over cp: its weights' cp part is summed
        # once a step, with the stage's, `_pipelined`)
        seq = (CP_AXIS,) * (p.cp > 1 and not _in_pipeline(cfg, s.path, s.in_stack))
        if sp and not s.region and not _whole_over_tp(cfg, impl, s):
            seq += (TP_AXIS,)  # used on the sequence shard: partial over tp
        sums = 1
        if s.path in ("wte/embedding", "lm_head/embedding") and not once:
            lookup = s.path == "wte/embedding"
            head = m.tie_embeddings or not lookup
            sums = int(lookup) + (chunks if head else 0)
        dp_elements = s.elements
        if s.path == "wpe/embedding" and not once:
            dp_elements = m.seq_len // (p.cp * (p.tp if sp else 1)) * m.d_model
        keyed = TP_AXIS in seq or _sp_kv(cfg, impl, s) or (
            s.path == "wpe/embedding" and impl == "explicit" and p.cp > 1)
        out.append(_Grad(s, sums, seq, impl == "shard_map" and bool(s.region), dp_elements,
                         keyed, part_dtypes(cfg, impl, s.path, sums)))
    return out


def part_dtypes(cfg: Config, impl: str, path: str, sums: int) -> tuple[str, ...]:
    """The dtype each of a gradient's `sums` parts is summed in (module
    docstring): the compute dtype for a weight cast to it where it is used,
    else its own; a vocab table's head part is the compute dtype's under
    shard_map (summed in its region) but fp32 where GSPMD places the sum (on
    the head's fp32 dot, `jaxtp.model.vocab`). (Accumulated over slices reduced
    once, or over a pipeline's ticks, every gradient is in its own dtype: the
    rows of those sums say so.)"""
    m = cfg.model
    pd, cd = HLO_DTYPES[m.param_dtype], HLO_DTYPES[m.dtype]
    if pd == cd:
        return (pd,) * sums
    module = path.split("/")[-2]
    if path in ("wte/embedding", "lm_head/embedding"):  # the lookup's, then the head's
        lookup = int(path == "wte/embedding")
        head = cd if impl == "shard_map" else pd
        return (pd,) * lookup + (head,) * (sums - lookup)
    own = module.startswith("ln") or "norm" in module or path.endswith("/router")
    return ((pd if own else cd),) * sums


def _dtypes(grads: list[_Grad]) -> list[str]:
    """The dtypes the gradients are summed in (fp32 first)."""
    return sorted({d for g in grads for d in g.dtypes}, key=lambda d: d != "f32")


def _in_pipeline(cfg: Config, path: str, in_stack: bool) -> bool:
    """Whether a parameter is used inside the pipeline's shard_map: a stage's,
    and under 1F1B the head's (final norm, LM head, a tied table's head part)."""
    if cfg.parallel.pp == 1:
        return False
    return in_stack or cfg.parallel.pp_schedule == "1f1b" and path in _HEAD_PATHS(cfg)


def _HEAD_PATHS(cfg: Config) -> tuple[str, ...]:
    return ("ln_f/scale", "ln_f/bias", "lm_head/embedding")


def reduced_over(cfg: Config, impl: str) -> dict[str, tuple[str, ...]]:
    """{parameter path: the mesh axes its gradient is summed over}: the axes
    that split its tokens (dp, cp; tp for a sequence-shard parameter under
    SP) minus its own (FSDP's dp, where it is reduce-scattered instead)."""
    p = cfg.parallel
    batch = (DATA_AXIS,) * (p.dp > 1)
    out = {}
    for g in _grads(cfg, impl):
        own = (DATA_AXIS,) if g.shard.dp_split and p.fsdp else ()
        kv_tp = (TP_AXIS,) if _sp_kv(cfg, impl, g.shard) else ()
        out[g.shard.path] = tuple(a for a in batch + g.seq + kv_tp if a not in own)
    return out


def _whole_over_tp(cfg: Config, impl: str, s: ParamShard) -> bool:
    """GSPMD sums the attention's row-parallel bias under SP from the output
    gradient it gathered anyway: whole over tp (but not in slices reduced
    once, where dp is manual, nor in a pipeline's stages, where pp is, nor
    under the overlap, where the gradient reaches the bias split along T)."""
    return (s.path.endswith("attn/out/bias") and impl == "gspmd" and not reduces_once(cfg)
            and cfg.parallel.pp == 1 and cfg.parallel.overlap == "none")


def expected_grads(cfg: Config, impl: str) -> list[Expected]:
    """Every gradient sum of a step (and the loss mean over the same axes),
    by the module docstring's rule: the sequence-shard rows (per parameter)
    and the totals over dp and cp (any scope: XLA combines, splits and loops
    them)."""
    m, p = cfg.model, cfg.parallel
    grads = _grads(cfg, impl)
    rows = _sequence_rows(cfg, impl, grads) + _sp_kv_rows(cfg, impl)
    if p.pp > 1:
        return rows + _pipelined(cfg, impl, grads)
    if data_group(cfg)[0] == 1:
        return rows
    pd = HLO_DTYPES[m.param_dtype]
    if reduces_once(cfg):  # one reduction of each whole gradient at the end
        total = sum(g.shard.elements for g in grads)
        return rows + [_loss_mean(p.dp, (DATA_AXIS,), "other"), Expected(
            f"dp: every parameter gradient (tp shard), summed over dp once after "
            f"{cfg.train.microbatches} microbatches", "all-reduce", "other", ANY_SCOPE, total,
            pd, p.dp, 1, "grads", (DATA_AXIS,))]
    if p.fsdp and p.dp > 1:  # (at dp = 1 FSDP splits nothing)
        return rows + _fsdp_rows(cfg, impl, grads)
    # the kv weight's whole sum is its own row (`_sp_kv_rows`)
    return rows + _placed(cfg, impl, [g for g in grads if not _sp_kv(cfg, impl, g.shard)])


def _pipelined(cfg: Config, impl: str, grads: list[_Grad]) -> list[Expected]:
    """The sums around a pipeline (`jaxtp.parallel.pipeline`), once per step.

    A stage's weights (own axis pp) are cast to varying over the batch axes
    the stage is manual over (dp, cp) on entry: one all-reduce over dp x cp
    (FSDP's, under shard_map, gathered in the pipeline and reduce-scattered;
    under gspmd gathered before it and all-reduced). So are 1F1B's head
    weights, which run in the loop, over pp x dp x cp (pp splits their
    tokens as dp does). The weights outside the pipeline (embedding; under
    GPipe the final norm and head) are summed where their tokens are split:
    written in a shard_map region, one psum over pp x dp x cp; placed by
    GSPMD, over cp (its sequence split) and then over pp x dp."""
    p, pd = cfg.parallel, HLO_DTYPES[cfg.model.param_dtype]
    f1b = p.pp_schedule == "1f1b"
    outer = tuple(a for a, n in ((PP_AXIS, p.pp), (DATA_AXIS, p.dp)) if n > 1)
    cp = (CP_AXIS,) * (p.cp > 1)
    joint = outer + cp
    rows = ([_loss_mean(p.pp * p.dp * p.cp, joint, per="step")] if f1b else
            [_loss_mean(p.pp * p.dp, outer, per="step")]
            + ([_loss_mean(p.cp, cp, per="step")] if cp else []))
    stage = [g for g in grads if g.shard.in_stack]
    E = lambda name, kind, n, group, axes, written, role="grads": Expected(
        name, kind, "backward", ANY_SCOPE, n, pd, group, 1, role, axes, written, "step")
    inner = tuple(a for a, n in ((DATA_AXIS, p.dp), (CP_AXIS, p.cp)) if n > 1)
    if inner:
        split = p.fsdp and impl == "shard_map" and p.dp > 1
        scattered = sum(g.shard.elements for g in stage if split and g.shard.dp_split)
        whole = sum(g.shard.elements for g in stage if not (split and g.shard.dp_split))
        if scattered and cp:
            rows.append(E("cp: the stages' FSDP weight gradients, summed over cp once",
                          "all-reduce", scattered, p.cp, cp, True))
        if scattered:
            rows.append(E("dp: the stages' FSDP weight gradients, reduce-scattered once",
                          "reduce-scatter", scattered // p.dp, p.dp, (DATA_AXIS,), True))
        over = " x ".join(inner)
        rows.append(E(f"{over}: the stages' weight gradients, summed over {over} once (after "
                      "the pipeline)", "all-reduce", whole, p.dp * p.cp, inner, True))
    # the weights outside the stages, each part (a tied table's lookup and
    # head) summed at once over pp x dp x cp, or over cp and then pp x dp
    fsdp = lambda g: p.fsdp and p.dp > 1 and g.shard.dp_split and impl == "shard_map"
    # (in the loop, accumulated over the ticks: in its own dtype)
    for dt in dict.fromkeys(_dtypes([g for g in grads if not g.shard.in_stack]) + [pd]):
        at_once = apart_cp = apart = scattered = 0
        for g in grads:
            if g.shard.in_stack:
                continue
            tied_head = g.shard.path == "wte/embedding" and g.sums > 1
            for i, in_loop in ([(0, False)] + [(i, f1b) for i in range(1, g.sums)]
                               if tied_head else
                               [(i, _in_pipeline(cfg, g.shard.path, False))
                                for i in range(g.sums)]):
                if (pd if in_loop else g.dtypes[i]) != dt:
                    continue
                if fsdp(g) and g.written:  # FSDP's region: reduce-scattered over dp
                    scattered += g.shard.elements
                elif in_loop or (impl == "shard_map" and g.written):
                    at_once += g.shard.elements
                else:  # (a learned positions' gradient: its own sequence rows over pp x dp)
                    apart_cp += 0 if g.keyed else g.shard.elements
                    apart += g.dp_elements
        E = lambda name, kind, n, group, axes, written, role="grads": Expected(
            name, kind, "backward", ANY_SCOPE, n, dt, group, 1, role, axes, written, "step")
        if at_once:
            rows.append(E(f"{' x '.join(joint)}: the gradients of the weights outside the "
                          "stages (embedding, head, final norm), summed at once", "all-reduce",
                          at_once, p.pp * p.dp * p.cp, joint, impl == "shard_map",
                          role="grads_outside"))
        if scattered:  # (pp x cp at once in the region, then FSDP's reduce-scatter over dp)
            rest = tuple(a for a in joint if a != DATA_AXIS)
            rows += [E(f"{' x '.join(rest)}: the FSDP vocab tables' gradients outside the "
                       "stages", "all-reduce", scattered, p.pp * p.cp, rest, True),
                     E("dp: the FSDP vocab tables' gradients outside the stages, "
                       "reduce-scattered", "reduce-scatter", scattered // p.dp, p.dp,
                       (DATA_AXIS,), True)]
        if apart_cp and cp:
            rows.append(E("cp: the gradients of the weights outside the pipeline, placed by "
                          "GSPMD, summed over cp", "all-reduce", apart_cp, p.cp, cp, False,
                          role="grads_apart_cp"))
        if apart:
            rows.append(E(f"{' x '.join(outer)}: the gradients of the weights outside the "
                          "pipeline (embedding, head, final norm)", "all-reduce", apart,
                          p.pp * p.dp, outer, False, role="grads_apart"))
    return rows


def _placed(cfg: Config, impl: str, grads: list[_Grad]) -> list[Expected]:
    """The totals without FSDP, per microbatch and dtype: a written
    gradient's one psum over dp x cp; GSPMD's sum over the sequence axes (what
    `_sequence_rows` does not sum) and then over dp; the loss mean as GSPMD's."""
    p = cfg.parallel
    group, axes = data_group(cfg)
    over = lambda a: " x ".join(a)
    steps = [((CP_AXIS,), p.cp), ((DATA_AXIS,), p.dp)] if p.dp > 1 and p.cp > 1 else \
        [(axes, group)]
    rows = [_loss_mean(n, a) for a, n in steps]
    for dt in _dtypes(grads):
        for a, n in steps:
            # every sum over dp; over cp, what no row of its own sums
            placed = sum((g.dp_elements if a == (DATA_AXIS,) else g.shard.elements) *
                         g.parts(dt) for g in grads
                         if not g.written and (a == (DATA_AXIS,) or not g.keyed))
            if not placed:
                continue
            name = (f"{over(axes)}: parameter gradients outside the regions (norms, biases, "
                    f"positions), summed over {over(a)} by GSPMD" if impl == "shard_map" else
                    f"{over(a)}: every parameter gradient (tp shard), summed over {over(a)}")
            rows.append(Expected(name, "all-reduce", "backward", ANY_SCOPE, placed, dt, n, 1,
                                 "grads_placed" if impl == "shard_map" else "grads", a,
                                 impl != "shard_map", "microbatch"))
        written = sum(g.shard.elements * g.parts(dt) for g in grads if g.written)
        if written:
            rows.append(Expected(f"{over(axes)}: every parameter gradient (tp shard), summed "
                                 f"over {over(axes)} in its region", "all-reduce", "backward",
                                 ANY_SCOPE, written, dt, group, 1, "grads", axes,
                                 per="microbatch"))
    return rows


def _fsdp_rows(cfg: Config, impl: str, grads: list[_Grad]) -> list[Expected]:
    """FSDP's sums, per microbatch and dtype: over cp first (what is whole
    over dp; a written gradient in its region), then each dp-split gradient
    reduce-scattered over dp (n/dp elements per rank: the accumulator stays
    sharded), each other one all-reduced (with cp at once where written)."""
    p = cfg.parallel
    rows = [_loss_mean(p.dp, (DATA_AXIS,))] + [_loss_mean(p.cp, (CP_AXIS,))] * (p.cp > 1)
    joint = lambda g: g.written and not g.shard.dp_split  # one psum over dp x cp
    both = dict(group=p.dp * p.cp, axes=(DATA_AXIS, CP_AXIS)) if impl == "shard_map" and \
        p.cp > 1 else {}
    for dt in _dtypes(grads):
        n = lambda pick, elements=lambda g: g.shard.elements: sum(
            elements(g) * g.parts(dt) for g in grads if pick(g))
        E = lambda name, kind, n, group=p.dp, axes=(DATA_AXIS,), role="", written=True: \
            Expected(name, kind, "backward", ANY_SCOPE, n, dt, group, 1, role, axes, written,
                     "microbatch")
        if p.cp > 1:
            cp = lambda pick: n(lambda g: pick(g) and not joint(g) and not g.keyed)
            name = "cp: {} summed over cp before FSDP's reduction"
            row = lambda what, k, role, written: E(name.format(what), "all-reduce", k, p.cp,
                                                   (CP_AXIS,), role, written)
            rows += [row("the regions' parameter gradients (whole over dp)",
                         cp(lambda g: g.written), "", True),
                     row("by GSPMD, the gradients outside the regions (norms, biases, "
                         "positions)", cp(lambda g: not g.written), "cp_grads", False)] \
                if impl == "shard_map" else [row("every parameter gradient (whole over dp)",
                                                 cp(lambda g: True), "cp_grads", True)]
        region = n(lambda g: g.shard.dp_split and g.written)
        placed = n(lambda g: g.shard.dp_split and not g.written, lambda g: g.dp_elements)
        rows += [E("FSDP: region weights' gradients reduce-scattered (shard_map)",
                   "reduce-scatter", region // p.dp),
                 E("FSDP: gradients reduce-scattered over dp" +
                   (" (GSPMD: norms, biases, positions)" if impl == "shard_map" else ""),
                   "reduce-scatter", placed // p.dp, role="fsdp_gspmd", written=False),
                 E("FSDP: parameters not split over dp (no model dim): gradient all-reduced"
                   + (" over dp x cp" if both else ""), "all-reduce",
                   n(lambda g: not g.shard.dp_split), **both)]
    return [r for r in rows if r.elements]


def _loss_mean(group: int, axes: tuple[str, ...], pass_: str = "forward",
               per: str | None = None) -> Expected:
    """The loss averaged over `axes`: in the forward pass of each microbatch,
    or once after the slices reduced once ("other", written there), or
    (`per`="step") once after a pipeline."""
    over = " x ".join(axes)
    return Expected(f"{over}: mean of the loss over {over}", "all-reduce", pass_, "", 1, "f32",
                    group, 1, "loss_mean", axes, pass_ == "other",
                    per or ("step" if pass_ == "other" else "microbatch"))


def _sequence_rows(cfg: Config, impl: str, grads: list[_Grad]) -> list[Expected]:
    """The sums over the sequence axes of the parameters used on the
    sequence shard, per parameter, under SP (over cp x tp at once) or, for
    explicit's learned positions, under cp (gathered rows)."""
    m, p = cfg.model, cfg.parallel
    once = reduces_once(cfg)
    rows = []
    for g in grads:
        s = g.shard
        positions = s.path == "wpe/embedding"
        if TP_AXIS not in g.seq and not (positions and impl == "explicit" and p.cp > 1):
            continue
        group = int(np.prod([dict(p.degrees)[a] for a in g.seq]))
        # a stacked parameter's (scanned, or a pipeline's stage's: its L/pp
        # layers, a chunk of L/(pp*v) per tick) one layer per loop trip;
        # outside a pipeline once
        held = m.n_layers // p.pp if s.in_stack and (m.scan_layers or p.pp > 1) else 1
        layers = held // p.pp_repeats if s.in_stack else 1
        # outside a pipeline's loop once a step, but 1F1B's head (the final
        # norm) runs in it, once a tick
        in_loop = s.in_stack or (p.pp_schedule == "1f1b" and s.path.startswith("ln_f/"))
        per = "step" if p.pp > 1 and not in_loop else "microbatch"
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
        rows.append(Expected(what, "all-gather" if gather else "all-reduce", "backward", scope,
                             s.elements // held, g.dtypes[0], group, layers,
                             "positions" if positions else "seq_shard_param", g.seq, False,
                             per))
        if positions and once and impl != "explicit":
            # GSPMD partitions the positions' scatter-add in the dp-manual
            # region by gathering its indices (loop-invariant: once per step)
            rows.append(Expected("learned positions: the gradient scatter's indices gathered",
                                 "all-gather", "backward", "", m.seq_len, "s32", group, 1,
                                 "positions_ids", g.seq, False, "step"))
    return rows


def _sp_kv(cfg: Config, impl: str, s: ParamShard) -> bool:
    """shard_map's replicated kv weight under SP with fewer kv heads than tp:
    fed the gathered x, its gradient is partial over tp too."""
    p = cfg.parallel
    return (s.path.endswith("attn/kv/kernel") and impl == "shard_map" and p.sequence_parallel
            and cfg.model.kv_heads < p.tp)


def _sp_kv_rows(cfg: Config, impl: str) -> list[Expected]:
    """`_sp_kv`'s weight gradient (in the compute dtype it multiplied), summed
    over dp, cp and tp at once, one psum per layer; FSDP's dp part is the
    weight's reduce-scatter, and in slices reduced once dp comes after them."""
    m, p = cfg.model, cfg.parallel
    if not (impl == "shard_map" and p.sequence_parallel and m.kv_heads < p.tp):
        return []
    dp = 1 if p.fsdp or reduces_once(cfg) else p.dp
    over = tuple(a for a, n in ((DATA_AXIS, dp), (CP_AXIS, p.cp)) if n > 1)
    return [Expected("replicated kv weight gradient: sum over tp" + "".join(
        f" and {a}" for a in over), "all-reduce", "backward", "attention",
        m.d_model * 2 * m.kv_heads * m.head_dim, HLO_DTYPES[m.dtype], p.tp * dp * p.cp, 1,
        "", over + (TP_AXIS,), per="layer")]
