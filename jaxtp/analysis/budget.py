"""The analytic Megatron communication budget of a train step, as rows that
`jaxtp.analysis.rows.check` holds compiled HLO against (the side-by-side
report is `jaxtp.analysis.compare`).

Tensor parallelism per Shoeybi et al. 2019 ("Megatron-LM", Sec. 3, Fig. 4):
each Transformer block has two column -> row regions (attention, MLP), each
with one all-reduce forward (g) and one backward (f), so per block and
microbatch 2 + 2 all-reduces of the activation, b*s*h elements. Narayanan et
al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters",
Sec. 3.3) price each with a ring all-reduce: every rank sends and receives
2(t-1)/t of the payload ((t-1)/t for an all-gather or reduce-scatter).

Outside the blocks this model needs, per train step (`expected_collectives`):
- vocab-parallel embedding: the lookup's partial rows are summed over tp,
  one forward all-reduce of b*s*h;
- LM head: column-parallel over the vocabulary, so its input gradient is
  all-reduced backward (f), b*s*h;
- vocab-parallel cross-entropy: max, sum of exponentials and target logit,
  three forward all-reduces of b*s fp32 values;
- the global gradient norm: one scalar all-reduce of the partial sums of
  squares of the tp-sharded gradients;
- with fewer kv heads than tp (replicated kv projection): the kv gradient,
  b*s*2*K*H per block, is summed over the ranks that share each kv head.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from ..config import Config
from ..model import Transformer
from ..model.vocab import loss_chunks
from ..parallel import DATA_AXIS, TP_AXIS, Layout, spec_axes, split_over_tp
from ..train.step import slices_over_dp_of
from .backends import on_backend
from .rows import ANY_PASS, ANY_SCOPE, HLO_DTYPES, Expected


@dataclasses.dataclass(frozen=True)
class Budget:
    """Megatron's per-block TP communication for one train step, per tp rank."""

    tp: int
    layers: int
    batch: int  # microbatch size on one dp rank
    seq: int
    d_model: int
    dtype_bytes: int
    microbatches: int = 1
    all_reduce_per_layer_fwd: int = 2
    all_reduce_per_layer_bwd: int = 2

    @property
    def ring_factor(self) -> float:
        """Bytes each rank sends per payload byte in a ring all-reduce: 2(t-1)/t."""
        return 2 * (self.tp - 1) / self.tp

    @property
    def elements_per_all_reduce(self) -> int:
        return self.batch * self.seq * self.d_model

    @property
    def bytes_per_all_reduce(self) -> int:
        return self.elements_per_all_reduce * self.dtype_bytes

    @property
    def ring_bytes_per_all_reduce(self) -> float:
        return self.ring_factor * self.bytes_per_all_reduce

    @property
    def ring_bytes_per_layer(self) -> float:
        """Per block and microbatch, forward + backward."""
        per_layer = self.all_reduce_per_layer_fwd + self.all_reduce_per_layer_bwd
        return per_layer * self.ring_bytes_per_all_reduce

    @property
    def ring_bytes_blocks_per_step(self) -> float:
        return self.layers * self.microbatches * self.ring_bytes_per_layer


def budget_for(cfg: Config) -> Budget:
    m, p = cfg.model, cfg.parallel
    M = cfg.train.microbatches
    return Budget(tp=p.tp, layers=m.n_layers, batch=cfg.train.batch_size // (p.dp * M),
                  seq=m.seq_len, d_model=m.d_model, dtype_bytes=np.dtype(m.dtype).itemsize,
                  microbatches=M)


def expected_collectives(cfg: Config, impl: str, platform: str = "") -> list[Expected]:
    """Every collective the train step of `cfg` needs under `impl`: over tp,
    and with dp > 1 over dp (`_expected_dp`); as the compiler for `platform`
    ("cpu", "gpu", "tpu"; "" for none) carries it out (`backends.on_backend`)."""
    rows = _per_microbatch(cfg, _expected_tp(cfg, impl)) + _expected_dp(cfg, impl)
    return on_backend(rows, cfg, impl, platform) if platform else rows


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """One parameter as the dp budget needs it: its path, the elements one tp
    rank holds, whether FSDP splits it over dp, where it is used."""

    path: str
    elements: int  # one tp rank's (a stacked parameter: all its layers')
    dp_split: bool
    in_stack: bool  # a block's (under a scanned stack: one layer per loop trip)
    # "column" (kernel or bias) / "row" kernel or "vocab" table: used inside a
    # region (shard_map gathers it there); "": on global arrays (norms,
    # row-parallel biases, positions)
    region: str
    # the MLP's down-projection bias: added last, its value feeds only the
    # block's output, so a remat's recompute never needs it
    block_output: bool


def param_shards(cfg: Config) -> list[ParamShard]:
    """Every parameter of `cfg`'s model as a `ParamShard`, from abstract shapes."""
    # Auto axes whatever the impl: shapes only, no contraction is typed
    layout = Layout.of(cfg)
    mesh = dataclasses.replace(layout, impl="gspmd").abstract_mesh()
    model = dataclasses.replace(cfg.model, attention="xla")  # shapes only
    with jax.sharding.use_abstract_mesh(mesh):
        params = nnx.state(nnx.eval_shape(
            lambda: Transformer(model, layout, rngs=nnx.Rngs(0))), nnx.Param)
    out = []
    flat = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, v in flat:
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        spec = v.get_metadata().get("out_sharding") or ()
        module, leaf = names[-2], names[-1]
        # a column-parallel bias is added inside the region; a row-parallel
        # one after g, outside it
        region = ("vocab" if leaf == "embedding" and module in ("wte", "lm_head") else
                  "column" if module in ("q", "kv", "up") else
                  "row" if leaf == "kernel" and module in ("out", "down") else "")
        out.append(ParamShard(
            "/".join(names), int(np.prod(v.shape)) // (cfg.parallel.tp if split_over_tp(spec)
                                                        else 1),
            any(DATA_AXIS in spec_axes(e) for e in spec), names[0] == "blocks", region,
            module == "down" and leaf == "bias"))
    return out


def _per_microbatch(cfg: Config, rows: list[Expected]) -> list[Expected]:
    """The tp rows of a step in `train.microbatches` slices: each activation's
    collectives once per slice (`_expected_tp` sizes them for one); the
    gradient norm once per step, over dp and tp under FSDP (the gradients
    are split over both)."""
    M, p = cfg.train.microbatches, cfg.parallel
    out = []
    for r in rows:
        if r.pass_ == "other":  # the gradient norm
            if p.fsdp and p.dp > 1:
                r = dataclasses.replace(r, group=p.dp * p.tp, axes=(DATA_AXIS, TP_AXIS))
        elif r.role != "positions_ids":  # that one is hoisted out of the loop
            r = dataclasses.replace(r, count=r.count * M)
        out.append(r)
    return out


def _expected_dp(cfg: Config, impl: str) -> list[Expected]:
    """Data parallelism: the loss is averaged over dp (one scalar all-reduce),
    and every parameter gradient (each rank's tp shard) is all-reduced over dp
    (a tied embedding twice: its lookup and LM-head gradients are reduced
    before they are added). XLA may combine, split or loop these (a scanned
    stack), so the budget is their total elements, whatever the scopes.

    With microbatches the slices run in a shard_map manual over dp
    (`jaxtp.train.step`): every gradient, summed over the slices on each
    rank, is reduced once per step (the tied embedding's two parts added
    first), and the loss once. FSDP: `_expected_fsdp`."""
    m, p = cfg.model, cfg.parallel
    if p.dp == 1:
        return []
    M = cfg.train.microbatches
    if p.fsdp:
        return _expected_fsdp(cfg, impl)
    pd = HLO_DTYPES[m.param_dtype]
    grads = sum(s.elements for s in param_shards(cfg))
    if slices_over_dp_of(cfg):  # one reduction of each whole gradient at the end
        return [_loss_mean(p.dp, 1, "other"),
                Expected("dp: every parameter gradient (tp shard), summed over dp once "
                         f"after {M} microbatches", "all-reduce", "other", ANY_SCOPE, grads,
                         pd, p.dp, 1, axes=(DATA_AXIS,))]
    if M > 1:  # cuDNN attention: the slices reduce as one batch does, each of them
        one = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=1))
        return [dataclasses.replace(r, count=r.count * M) for r in _expected_dp(one, impl)]
    if m.tie_embeddings:
        grads += m.padded_vocab // p.tp * m.d_model
    if p.sequence_parallel and m.style != "llama":
        # learned positions used on sequence shards: each tp rank's gradient is
        # non-zero only on its T/tp rows, and XLA reduces that slice over dp
        # (the tp sum then assembles the table)
        grads -= m.seq_len * m.d_model - m.seq_len // p.tp * m.d_model
    if p.sequence_parallel and impl == "shard_map" and m.kv_heads < p.tp:
        grads -= m.n_layers * m.d_model * 2 * m.kv_heads * m.head_dim  # over dp and tp at once
    rows = [_loss_mean(p.dp, 1)]
    if impl == "shard_map":  # its regions' own sums, and what GSPMD places outside them
        outside = sum(s.elements for s in param_shards(cfg) if not s.region)
        if p.sequence_parallel and m.style != "llama":
            outside -= m.seq_len * m.d_model - m.seq_len // p.tp * m.d_model
        rows.append(Expected("dp: parameter gradients outside the regions (norms, biases, "
                             "positions), summed over dp by GSPMD", "all-reduce", "backward",
                             ANY_SCOPE, outside, pd, p.dp, 1, axes=(DATA_AXIS,), written=False))
        grads -= outside
    return rows + [Expected("dp: every parameter gradient (tp shard), summed over dp"
                            + (" in its region" if impl == "shard_map" else ""), "all-reduce",
                            "backward", ANY_SCOPE, grads, pd, p.dp, 1, axes=(DATA_AXIS,))]


def _loss_mean(dp: int, count: int, pass_: str = "forward") -> Expected:
    """The loss averaged over dp: in the forward pass of each microbatch, or
    once after the slices ("other": `jaxtp.train.step`'s dp-local sum)."""
    return Expected("dp: mean of the loss over dp" + (" (per microbatch)" if count > 1 else ""),
                    "all-reduce", pass_, "", 1, "f32", dp, count, axes=(DATA_AXIS,),
                    written=pass_ == "other")


def _expected_fsdp(cfg: Config, impl: str) -> list[Expected]:
    """FSDP (ZeRO-3, Rajbhandari et al. 2020, Sec. 5.1: parameters, gradients
    and Adam state split over dp along the model dim), per parameter p whose
    tp shard holds n elements, over dp:

    - forward: p all-gathered (n elements) where a module uses it
      (`jaxtp.model.layers.weight`; under shard_map inside its region),
      once per microbatch inside a scanned stack (one layer per trip); XLA
      hoists every other gather, a loop invariant, out of the microbatch loop,
      so it runs once per step. A tied table is gathered once for both uses.
    - backward, with a remat policy: the recomputed block gathers its
      weights again, once per microbatch (the recompute is not hoisted):
      every dp-split block parameter but the MLP's down bias (the block's
      last op, which the backward never needs), whatever the policy (none
      saves a gathered weight). Except under shard_map in an unscanned stack
      in one batch, where XLA gathers each region kernel once in all
      (remat "full": the forward's and the recompute's gather are one op,
      labelled by either pass: GPT-2's column kernels by the backward,
      Llama's by the forward) or not again ("dots", "minimal" keep the
      gathered kernels); a scanned stack's backward loop gathers them again
      (measured, jaxlib 0.10.2).
    - each gradient reduce-scattered (n/dp elements per rank) once per
      microbatch: the accumulator stays sharded (ZeRO-3's gradient memory,
      not one unsharded gradient per rank); a tied table's two parts apart.
      A parameter not split over dp (a column-parallel bias: no model dim)
      is all-reduced, as without FSDP.
    - the loss mean once per microbatch; the gradient norm over dp and tp
      (`_expected_tp`)."""
    m, p, M = cfg.model, cfg.parallel, cfg.train.microbatches
    dp, pd, cd = p.dp, HLO_DTYPES[m.param_dtype], HLO_DTYPES[m.dtype]
    scanned, remat = m.scan_layers, m.remat != "none"
    shards = param_shards(cfg)
    split = [s for s in shards if s.dp_split]
    per_use = lambda s: M if s.in_stack and scanned else 1
    # the vocab tables travel in the parameter dtype, every other weight in the
    # compute dtype (`jaxtp.model.layers.weight`): their forward gathers apart
    tables = sum(s.elements for s in split if s.region == "vocab")
    split = [s for s in split if s.region != "vocab"]
    fwd, bwd = 0, 0
    either = 0  # gathered once, in the pass XLA keeps of two equal gathers
    # under shard_map, GSPMD gathers the parameters used outside the regions
    outside = (sum(s.elements for s in split if not s.region)
               if impl == "shard_map" and not remat and not scanned and M == 1 else 0)
    for s in split:
        if impl == "shard_map" and remat and s.in_stack and s.region and not scanned and M == 1:
            if m.remat == "full":
                either += s.elements * per_use(s)
            else:
                fwd += s.elements * per_use(s)
            continue
        fwd += s.elements * per_use(s)
        if remat and s.in_stack and not s.block_output:
            bwd += s.elements * M  # inside the recompute: never hoisted
    tied = m.tie_embeddings
    # shard_map reduce-scatters its region weights itself; GSPMD places the rest
    both = tables + (m.padded_vocab // p.tp * m.d_model if tied else 0)  # 2 parts if tied
    region_rs = sum(s.elements for s in split if s.region) + both if impl == "shard_map" else 0
    gspmd_rs = sum(s.elements for s in split) + both - region_rs
    replicated = sum(s.elements for s in shards if not s.dp_split)
    if p.sequence_parallel and m.style != "llama":  # the positions' dp slice (as without FSDP)
        gspmd_rs -= m.seq_len * m.d_model - m.seq_len // p.tp * m.d_model
    E = lambda name, kind, pass_, n, count, dtype, role="": Expected(
        "FSDP: " + name, kind, pass_, ANY_SCOPE, n, dtype, dp, count, role, (DATA_AXIS,))
    rows = [_loss_mean(dp, M)]
    if not either or pd != cd:
        rows.append(E("the vocab tables all-gathered (in their own dtype) for the lookup and "
                      "the head", "all-gather", "forward", tables, 1, pd))
    else:  # one total with the gathers whose pass is XLA's pick
        either += tables
    if either:  # which pass a gather is labelled with is XLA's pick: one total
        rows.append(E("every dp-split parameter all-gathered for its forward use, block "
                      f"weights again for the backward (remat {m.remat!r}), but shard_map's "
                      "region kernels once for both passes", "all-gather", ANY_PASS,
                      fwd + bwd + either, 1, cd))
    else:
        if outside:
            rows.append(dataclasses.replace(E(
                "parameters outside the regions all-gathered by GSPMD for their forward use",
                "all-gather", "forward", outside, 1, cd), written=False))
        rows.append(E("every dp-split parameter all-gathered for its forward use"
                      + (" in its region" if outside else ""),
                      "all-gather", "forward", fwd - outside, 1, cd))
        if bwd:
            rows.append(E(f"remat {m.remat!r}: block weights gathered again for the backward",
                          "all-gather", "backward", bwd, 1, cd))
    if region_rs:
        rows.append(E("region weights' gradients reduce-scattered (shard_map)",
                      "reduce-scatter", "backward", region_rs // dp, M, pd))
    if gspmd_rs:
        rows.append(dataclasses.replace(E(
            "gradients reduce-scattered over dp" +
            (" (GSPMD: norms, biases, positions)" if impl == "shard_map" else ""),
            "reduce-scatter", "backward", gspmd_rs // dp, M, pd, "fsdp_gspmd"), written=False))
    if replicated:
        rows.append(E("parameters not split over dp (no model dim): gradient all-reduced",
                      "all-reduce", "backward", replicated, M, pd))
    return rows


def _expected_tp(cfg: Config, impl: str) -> list[Expected]:
    m, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return []
    b, s, L, dt = cfg.train.batch_size // (cfg.parallel.dp * cfg.train.microbatches), \
        m.seq_len, m.n_layers, HLO_DTYPES[m.dtype]
    act = b * s * m.d_model
    E = lambda name, kind, pass_, scope, n, count, dtype=dt, group=tp, role="", axes=(TP_AXIS,): \
        Expected(name, kind, pass_, scope, n, dtype, group, count, role, axes)
    if cfg.parallel.sequence_parallel:
        return _expected_sp(cfg, impl, E, b, s, L, act)
    n, c = loss_chunks(m.loss_chunk, b, s)
    rows = [
        E("g: vocab-parallel embedding lookup", "all-reduce", "forward", "embed", act, 1,
          role="embed"),
        E("g: attention out-proj output", "all-reduce", "forward", "attention", act, L),
        E("g: MLP down-proj output", "all-reduce", "forward", "mlp", act, L),
        *_cross_entropy(E, b, n, c),
        E("f: dX entering the q/kv projection", "all-reduce", "backward", "attention", act, L),
        E("f: dX entering the MLP up-proj", "all-reduce", "backward", "mlp", act, L),
        E("f: dX entering the LM head", "all-reduce", "backward", "cross_entropy", act, 1,
          role="head_dx")
        if impl == "shard_map" or n == 1 else
        E("f: dX entering the LM head, per loss chunk (GSPMD reduces each chunk's partial "
          "dX; shard_map once after the loop)", "all-reduce", "backward", "cross_entropy",
          b * c * m.d_model, n, role="head_dx"),
        E("gradient norm: one sum of squares", "all-reduce", "other", "", 1, 1, "f32"),
    ]
    return rows + _kv_rows(cfg, impl, E, b * s * 2 * m.kv_heads * m.head_dim)


def _kv_rows(cfg: Config, impl: str, E, kv: int) -> list[Expected]:
    """With fewer kv heads than tp the kv projection is replicated, and the kv
    activation gradient (kv = b*s*2*K*H elements) is summed over the ranks that
    share each kv head (`jaxtp.model.attention`)."""
    m, tp, L = cfg.model, cfg.parallel.tp, cfg.model.n_layers
    K = m.kv_heads
    if K >= tp:
        return []
    # explicit picks each rank's kv head by a contraction over tp
    # (`jaxtp.parallel.Explicit.kv_for_heads`): the same one sum as shard_map
    if impl != "gspmd" or K == 1:
        return [E("kv gradient: sum over the ranks sharing a kv head", "all-reduce",
                  "backward", "attention", kv, L, role="kv_grad")]
    # GSPMD splits the same sum: within each kv group, then gathered
    return [E("kv gradient: sum within each group of tp/K ranks", "all-reduce", "backward",
              "attention", kv // K, L, group=tp // K, role="kv_grad"),
            E("kv gradient: gathered across the K groups", "all-gather", "backward",
              "attention", kv, L, group=K, role="kv_grad")]


def _cross_entropy(E, b: int, n: int, c: int) -> list[Expected]:
    """The vocab-parallel loss's three reductions, per loss chunk (jaxtp.model.vocab:
    n chunks of c positions; a recomputed chunk reuses them)."""
    return [E("cross-entropy: max, sum of exp, target logit"
              + (f" (x {n} loss chunks)" if n > 1 else ""), "all-reduce", "forward",
              "cross_entropy", b * c, 3 * n, "f32")]


def _expected_sp(cfg: Config, impl: str, E, b: int, s: int, L: int, act: int):
    """Megatron-SP (Korthikanti et al. 2022, Sec. 4.2.2): each all-reduce of a
    region becomes an all-gather at its entry and a reduce-scatter at its exit
    (their mirrors in the backward pass), the same ring bytes. Elements count
    the result: a reduce-scatter returns b*s*h/tp. Replicated parameters used
    on sequence shards (norm scales, row-parallel biases, learned positions)
    get partial gradients, all-reduced over tp (a bias's in the compute dtype:
    it is summed from the output gradient).

    With a remat policy, the backward pass gathers each region's input again
    for its weight gradient instead of keeping the gathered copy, as
    Megatron-SP does (Korthikanti et al. 2022, Sec. 4.2.2): one more
    all-gather per region and layer.

    With fewer kv heads than tp, GSPMD and explicit sum the kv gradient as
    they do without SP (`_kv_rows`), so the kv branch's dX is whole while the
    queries' is partial: the attention's backward entry stays an all-reduce of
    b*s*h."""
    m, tp = cfg.model, cfg.parallel.tp
    shard = act // tp
    n, c = loss_chunks(m.loss_chunk, b, s)
    # GSPMD and explicit sum the kv gradient as they do without SP
    # (`_kv_rows`); shard_map sums the replicated kv weight's gradient instead
    xla_kv = impl != "shard_map" and m.kv_heads < tp
    rows = _sp_regions(cfg, E, act, shard, L, xla_kv, impl)
    rows += [
        E("SP embedding: reduce-scatter of the looked-up rows", "reduce-scatter", "forward",
          "embed", shard, 1, role="embed"),
        E("SP embedding, backward: all-gather", "all-gather", "backward", "embed", act, 1),
        E("SP LM head entry: all-gather", "all-gather", "forward", "cross_entropy", act, 1,
          role="gather_in"),
        E("SP LM head, backward: reduce-scatter of dX", "reduce-scatter", "backward",
          "cross_entropy", shard, 1, role="head_dx")
        if impl == "shard_map" or n == 1 else
        E("SP LM head, backward: dX per loss chunk (GSPMD reduces each chunk)",
          "all-reduce", "backward", "cross_entropy", b * c * m.d_model, n, role="head_dx"),
        *_cross_entropy(E, b, n, c),
        E("gradient norm: one sum of squares", "all-reduce", "other", "", 1, 1, "f32"),
    ]
    # GSPMD sums these outside the regions, under every impl
    rows += [dataclasses.replace(r, written=False) for r in _seq_shard_params(cfg, impl, E, s, L)]
    K, H = m.kv_heads, m.head_dim
    if xla_kv:
        rows += _kv_rows(cfg, impl, E, b * s * 2 * K * H)
    elif K < tp:  # replicated kv projection fed the gathered x: its weight gradient,
        # summed as the compute-dtype weight it multiplied; inside shard_map
        # over dp and tp at once (one psum: `_expected_dp` leaves it out)
        # (under FSDP the dp part is the weight's reduce-scatter; in slices
        # over dp, dp is manual and reduced once after them: jaxtp.train.step)
        p = cfg.parallel
        dp = 1 if p.fsdp or slices_over_dp_of(cfg) else p.dp
        rows.append(E("replicated kv weight gradient: sum over tp"
                      + (" and dp" if dp > 1 else ""), "all-reduce", "backward", "attention",
                      m.d_model * 2 * K * H, L, group=tp * dp,
                      axes=(DATA_AXIS, TP_AXIS) if dp > 1 else (TP_AXIS,)))
    return rows


def _seq_shard_params(cfg: Config, impl: str, E, s: int, L: int) -> list:
    """Replicated parameters used on sequence shards under SP: each rank's
    gradient is partial, summed over tp (in the parameter dtype; a
    row-parallel bias's in the compute dtype, from the output gradient)."""
    m, pd = cfg.model, HLO_DTYPES[cfg.model.param_dtype]
    norm_params = (2 * L + 1) * (1 if m.style == "llama" else 2)
    rows = [E("norm weights used on sequence shards: gradient sum", "all-reduce", "backward",
              "", m.d_model, norm_params, pd, role="seq_shard_param")]
    dp_local = slices_over_dp_of(cfg)  # jaxtp.train.step
    if m.use_bias:
        # GSPMD sums the attention's from the output gradient it gathered
        # anyway (but not in slices over dp, where dp is manual)
        rows += [E(f"{scope} row-parallel bias on sequence shards: gradient sum",
                   "all-reduce", "backward", scope, m.d_model, L, role="seq_shard_param")
                 for scope in ("attention", "mlp")
                 if impl != "gspmd" or scope == "mlp" or dp_local]
    if m.style != "llama":
        # explicit: the positions are resharded from replicated to the sequence
        # split, whose transpose gathers the gradient's rows (half the bytes);
        # so does every impl in slices over dp (jaxtp.train.step's dp-local sum)
        gather = impl == "explicit" or dp_local
        if dp_local and impl != "explicit":
            # GSPMD partitions the positions' scatter-add in the dp-manual
            # region by gathering its indices (loop-invariant: once per step)
            rows.append(E("learned positions: the gradient scatter's indices gathered",
                          "all-gather", "backward", "", s, 1, "s32", role="positions_ids"))
        rows.append(E("learned positions on sequence shards: gradient sum"
                      + (" (gathered rows)" if gather else ""),
                      "all-gather" if gather else "all-reduce",
                      "backward", "", s * m.d_model, 1, pd, role="positions"))
    return rows


def _sp_regions(cfg: Config, E, act: int, shard: int, L: int, xla_kv: bool,
                impl: str) -> list:
    """Each region's SP entry and exit, forward and backward (and a remat's regather)."""
    if impl == "shard_map" and cfg.parallel.overlap == "collective_matmul":
        return _ring_regions(cfg, E, shard, L)
    rows = []
    for scope in ("attention", "mlp"):
        rows += [E(f"SP entry: all-gather into {scope}", "all-gather", "forward", scope, act, L,
                   role="gather_in"),
                 E(f"SP exit: reduce-scatter out of {scope}", "reduce-scatter", "forward",
                   scope, shard, L),
                 E(f"SP exit, backward: all-gather of the {scope} output gradient",
                   "all-gather", "backward", scope, act, L, role=f"gather_grad_{scope}"),
                 E(f"SP entry, backward: all-reduce of dX into {scope} (the kv branch's dX "
                   "is whole)", "all-reduce", "backward", scope, act, L)
                 if scope == "attention" and xla_kv else
                 E(f"SP entry, backward: reduce-scatter of dX into {scope}",
                   "reduce-scatter", "backward", scope, shard, L)]
        if cfg.model.remat != "none":
            rows.append(E(f"SP remat: {scope}'s input gathered again in the backward pass",
                          "all-gather", "backward", scope, act, L, role="gather_in"))
    return rows


def _ring_regions(cfg: Config, E, shard: int, L: int) -> list:
    """SP's entry and exit as collective-matmul rings (`jaxtp.parallel.overlap`,
    Wang et al. 2023): each is tp - 1 ppermutes of one sequence chunk,
    b*s*h/tp elements, in place of the all-gather or reduce-scatter of the
    same ring bytes; the backward pass is the reverse ring of each (dX
    reduce-scattered, the output gradient all-gathered), and a remat policy
    runs the entry's ring again to regather x for the weight gradient. The
    permutes' pairs span the whole mesh (dp x tp: each dp group's ring)."""
    hops, pairs = cfg.parallel.tp - 1, cfg.parallel.tp * cfg.parallel.dp
    P = lambda name, pass_, scope, n, role="": E(name, "collective-permute", pass_, scope, shard,
                                                 n * hops * L, group=pairs, role=role)
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
