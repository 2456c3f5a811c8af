"""The pipeline's ledger: the rows on the pp axis (`jaxtp.parallel.pipeline`),
and its bubble, analytic and read from the compiled program.

GPipe (Huang et al. 2019, Sec. 2.2) runs M microbatches through p stages in
M + p - 1 ticks; each stage idles (here: computes what is dropped) p - 1 of
them, the bubble (p-1)/(M+p-1) of the step; with v chunks per stage
(Narayanan et al. 2021, Sec. 2.2.2, interleaving) v*M + p - 1 ticks of 1/v
the work, the bubble (p-1)/(v*M+p-1). Compiled FLOPs per useful FLOP of the
blocks: (v*M + p - 1)/(v*M), as every stage computes in every tick.

Per tick each stage sends its output, a microbatch's b = B/(M*dp) rows of
the residual stream, to the next (one collective-permute of b*(s/cp)*D
elements, /tp under SP, where the stream is split along the sequence over
tp: Megatron's `get_tensor_shapes`), and the backward pass sends the
gradients the other way, the same bytes. The bubble's ticks send too, and
are booked with the rest (`ticks`). Entering the pipeline stage 0 receives
every other stage's B/(p*dp) rows (p - 1 permutes), leaving the last stage
sends each stage its rows (p - 1 permutes); the backward pass runs the
transposes, the same permutes reversed.
"""

from __future__ import annotations

from .. import hlo
from ..config import Config
from ..parallel import PP_AXIS
from .rows import HLO_DTYPES, Expected


def expected_pp(cfg: Config) -> list[Expected]:
    """The step's collectives on the pp axis, the shifts counted per tick
    (`rows.per_step` multiplies by `Schedule.ticks`)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if p.pp == 1:
        return []
    split = p.tp if p.sequence_parallel else 1
    row = (m.seq_len // p.cp) * m.d_model // split  # one sequence's residual stream per rank
    shift = t.batch_size // (t.microbatches * p.dp) * row
    mine = t.batch_size // (p.pp * p.dp) * row  # a stage's own rows outside the pipeline
    # a permute's group is its source-target pairs, in each of the
    # devices/p pipelines: p - 1 for a shift, 1 for an entry or exit permute
    pipelines = p.devices // p.pp
    E = lambda name, pass_, n, count, pairs=1, per="step": Expected(
        name, "collective-permute", pass_, "", n, HLO_DTYPES[m.dtype], pairs * pipelines,
        count, "pp", (PP_AXIS,), per=per)
    hops = p.pp - 1
    return [
        E("pp shift: each stage's output to the next, every tick", "forward", shift, 1, hops,
          per="microbatch"),
        E("pp shift, backward: each stage's input gradient to the one before, every tick",
          "backward", shift, 1, hops, per="microbatch"),
        E("pp entry: each stage's rows to stage 0", "forward", mine, hops),
        E("pp exit: the last stage's outputs to their stages", "forward", mine, hops),
        E("pp exit and entry, backward: the same permutes reversed", "backward", mine,
          2 * hops),
    ]


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The analytic bubble: (p-1)/(v*M + p - 1) of the step's ticks."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def compiled_ticks(colls: list[hlo.Collective], mesh: dict[str, int]) -> int | None:
    """The pipeline's ticks as the compiled program runs them: the trip count
    of the loop holding the forward shift (a collective-permute over pp);
    None without one."""
    counts = {c.count for c in colls if c.kind == "collective-permute"
              and c.pass_ == "forward" and c.axes(mesh) == (PP_AXIS,)}
    return max(counts) if counts else None
