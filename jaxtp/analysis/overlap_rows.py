"""The budget's rows for SP's overlapped regions (`parallel.overlap`): under
shard_map the collective-matmul rings, under GSPMD and explicit the windowed
loops XLA may form, and the LM head's entry likewise. Called by
`jaxtp.analysis.budget` with its row factories `E(name, kind, pass, scope,
elements, count, ...)`, counted per microbatch, and `EL`, per layer and
microbatch; a region without overlap is budgeted there."""

from __future__ import annotations

from ..config import Config
from ..parallel import xla_overlap


def windowed_regions(cfg: Config, EL, act: int, shard: int, xla_kv: bool,
                      forms: xla_overlap.Forms) -> list:
    """GSPMD's and explicit's SP regions under `parallel.overlap`: x enters
    each column matmul split along T with the output named split over tp,
    and each row matmul's output is named split along T
    (`jaxtp.parallel.GSPMD.project`), so that XLA's partitioner may turn the
    all-gather / reduce-scatter beside each into a windowed loop of tp
    collective-permutes of one chunk [b, s/tp, h] (`forms` says which loops
    form for this compiler and these shapes: `jaxtp.parallel.xla_overlap`).
    Per region and layer, forward: the entry's all-gather, the exit's
    reduce-scatter; backward: dX's reduce-scatter, x gathered again for the
    weight gradient (the entry matmul is rematerialised,
    `jaxtp.parallel.overlap.reread`: Megatron-SP's second gather,
    Korthikanti et al. 2022, Sec. 4.2.3), and the output gradient's
    all-gather, never a loop: two dots read it (the exit's dX and dW) and
    XLA shares one plain gather between them. Remat "full" recomputes the
    entry's matmul: one more gather of x. With fewer kv heads than tp the
    attention's entry is two dots (q and the replicated kv) of one gathered
    x: plain SP there."""
    ag, rs = forms.all_gather, forms.reduce_scatter
    p = cfg.parallel
    hops, pairs = p.tp, p.tp * p.dp * p.ep
    loop = lambda what, pass_, scope, role="": EL(
        f"windowed {what}", "collective-permute", pass_, scope, shard, hops,
        group=pairs, role=role)
    rows = []
    for scope in ("attention", "mlp"):
        plain_entry = scope == "attention" and xla_kv
        # x gathered again for dW (and a remat "full" for the recomputed
        # entry); a plain entry's is SP's own remat regather
        remat = cfg.model.remat
        gathers = (remat != "none") if plain_entry else 1 + (remat == "full")
        rows += [loop(f"all-gather loop: x's chunks into {scope}'s column matmul", "forward",
                      scope, "gather_in") if ag and not plain_entry else
                 EL(f"SP entry: all-gather into {scope}", "all-gather", "forward", scope, act, 1,
                    role="gather_in"),
                 loop(f"reduce-scatter loop: partial sums out of {scope}'s row matmul",
                      "forward", scope) if rs else
                 EL(f"SP exit: reduce-scatter out of {scope}", "reduce-scatter", "forward",
                    scope, shard, 1),
                 EL(f"SP exit, backward: all-gather of the {scope} output gradient (read by "
                    "two dots: no loop)", "all-gather", "backward", scope, act, 1,
                    role=f"gather_grad_{scope}")]
        if plain_entry:
            rows.append(EL(f"SP entry, backward: all-reduce of dX into {scope} (the kv branch's "
                           "dX is whole)", "all-reduce", "backward", scope, act, 1))
        else:
            rows.append(loop(f"reduce-scatter loop: partial sums of dX into {scope}", "backward",
                             scope) if rs else
                        EL(f"SP entry, backward: reduce-scatter of dX into {scope}",
                           "reduce-scatter", "backward", scope, shard, 1))
        for i in range(gathers):
            what = f"all-gather loop: x's chunks into {scope} again for " + (
                "dW" if i == 0 else "the remat")
            rows.append(loop(what, "backward", scope, "gather_in") if ag and not plain_entry else
                        EL(f"SP overlap: {scope}'s input gathered again for "
                           + ("its weight gradient" if i == 0 else "the remat"), "all-gather",
                           "backward", scope, act, 1, role="gather_in"))
    return rows


def windowed_head(E, act: int, shard: int, forms: xla_overlap.Forms, pairs: int,
                   tp: int) -> list:
    """The LM head of one loss chunk under the overlap: its entry windowed as
    a region's (forward all-gather, backward dX reduce-scatter and x gathered
    again for the table's gradient)."""
    loop = lambda what, pass_, role: E(f"windowed {what}", "collective-permute", pass_,
                                       "cross_entropy", shard, tp, group=pairs, role=role)
    ag, rs = forms.all_gather, forms.reduce_scatter
    return [loop("all-gather loop: x's chunks into the LM head", "forward", "gather_in")
            if ag else
            E("SP LM head entry: all-gather", "all-gather", "forward", "cross_entropy", act, 1,
              role="gather_in"),
            loop("reduce-scatter loop: partial sums of the LM head's dX", "backward",
                 "head_dx") if rs else
            E("SP LM head, backward: reduce-scatter of dX", "reduce-scatter", "backward",
              "cross_entropy", shard, 1, role="head_dx"),
            loop("all-gather loop: x's chunks into the LM head again for dW", "backward",
                 "gather_in") if ag else
            E("SP overlap: the LM head's input gathered again for the table's gradient",
              "all-gather", "backward", "cross_entropy", act, 1, role="gather_in")]


def ring_regions(cfg: Config, EL, shard: int) -> list:
    """SP's entry and exit as collective-matmul rings (`jaxtp.parallel.overlap`,
    Wang et al. 2023): each is tp - 1 ppermutes of one sequence chunk,
    b*s*h/tp elements, in place of the all-gather or reduce-scatter of the
    same ring bytes; the backward pass is the reverse ring of each (dX
    reduce-scattered, the output gradient all-gathered), and a remat policy
    runs the entry's ring again to regather x for the weight gradient. The
    permutes' pairs span the whole mesh (dp x tp: each dp group's ring).
    Bidirectional (`collective_matmul_bidi`): each of the tp - 1 steps sends
    half a chunk each way, two permutes of b*s*h/(2 tp): the same bytes, half
    on each direction of a link."""
    bidi = cfg.parallel.overlap == "collective_matmul_bidi"
    p = cfg.parallel
    hops, pairs = (p.tp - 1) * (1 + bidi), p.tp * p.dp * p.ep
    P = lambda name, pass_, scope, n, role="": EL(name, "collective-permute", pass_, scope,
                                                  shard // (1 + bidi), n * hops, group=pairs,
                                                  role=role)
    rows = []
    for scope in ("attention", "mlp"):
        rows += [P(f"f_sp ring: x's chunks into {scope}'s column matmul", "forward", scope, 1,
                   "gather_in"),
                 P(f"g_sp ring: partial sums out of {scope}'s row matmul", "forward", scope, 1),
                 P(f"g_sp ring, backward: chunks of {scope}'s output gradient", "backward",
                   scope, 1, f"gather_grad_{scope}"),
                 P(f"f_sp ring, backward: partial sums of dX into {scope}", "backward", scope,
                   1)]
        if cfg.model.remat != "none":
            rows.append(P(f"f_sp ring, remat: x's chunks into {scope} again for dW",
                          "backward", scope, 1, "gather_in"))
    return rows
