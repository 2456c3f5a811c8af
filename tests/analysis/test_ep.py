"""The ep all-to-alls of a compiled MoE train step against the analytic
ledger (jaxtp.analysis.ep), by hand: per MoE layer 2 forward and 2
backward, each E * G_r * C * D elements per rank, scaling with the capacity
factor; nothing else over ep in the MoE layers but the small router sums."""

import contextlib
import dataclasses
import functools
import io
import math
import re

import jax
import jax.numpy as jnp

import pytest

from jaxtp import hlo
from jaxtp.analysis.budget import expected_collectives
from jaxtp.analysis.ep import expected_ep, slots
from jaxtp.analysis.params import param_shards
from jaxtp.analysis.rows import check, per_step, schedule_of
from jaxtp.config import Config, ModelConfig, ParallelConfig, TrainConfig, validate
from jaxtp.model.moe import capacity
from jaxtp.parallel import Layout
from jaxtp.train.state import abstract_train_state
from jaxtp.train.step import compile_train_step, loss_fn

MOE = ModelConfig(style="llama", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64,
                  seq_len=32, use_bias=False, tie_embeddings=False, n_experts=8, moe_top_k=2,
                  moe_d_ff=32)
B = 16


@functools.cache
def compiled(impl: str, factor: float, ep: int = 4, tp: int = 2, dp: int = 1,
             remat: str = "none", dispatch: str = "dense", shared: int = 0, microbatches: int = 1,
             every: int = 1, fsdp: bool = False, cp: int = 1, loss_chunk: int = 4096,
             balance: str = "aux", slots: str = "keep"):
    cfg = validate(Config(dataclasses.replace(MOE, capacity_factor=factor, remat=remat,
                                              moe_dispatch=dispatch, moe_shared_d_ff=shared,
                                              moe_every=every, loss_chunk=loss_chunk,
                                              moe_balance=balance, moe_slots=slots),
                          TrainConfig(batch_size=B, microbatches=microbatches),
                          ParallelConfig(dp=dp, ep=ep, tp=tp, cp=cp, impl=impl, fsdp=fsdp)))
    layout = Layout.of(cfg)
    step = compile_train_step(abstract_train_state(cfg, layout.mesh()), B, MOE.seq_len)
    return cfg, layout.sizes, hlo.collectives(step.as_text())


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
@pytest.mark.parametrize("factor", [1.0, 2.0, 0.0], ids=["cf1", "cf2", "dropless"])
def test_the_all_to_alls_are_the_ep_ledgers(impl, factor):
    cfg, sizes, colls = compiled(impl, factor)
    a2a = [c for c in colls if c.kind == "all-to-all"]
    assert check(a2a, per_step(expected_ep(cfg, impl), schedule_of(cfg)), sizes) is None
    # and the whole step: the dense budget at dp x ep, the experts' tp and router rows
    assert check(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None
    # by hand: each rank's 16/4 = 4 groups of 32 tokens, C slots per expert
    C = {1.0: 8, 2.0: 16, 0.0: 32}[factor]
    assert capacity(32, 2, 8, factor) == C
    per_layer = 8 * 4 * C * 32  # E * G_r * C * D
    for pass_ in ("forward", "backward"):
        ops = [c for c in a2a if c.pass_ == pass_]
        assert sum(c.elements * c.count for c in ops) == 2 * MOE.n_layers * per_layer
        assert {c.group_size for c in ops} == {4} and {c.axes(sizes) for c in ops} == {("ep",)}
    # in the MoE layers, over ep otherwise only the router's small sums (its
    # statistics, its gradient: no gather of the routing over ep)
    others = [c for c in colls if "ep" in c.axes(sizes) and c.kind != "all-to-all"
              and c.scope == "moe"]
    assert others and max(c.elements for c in others) <= MOE.d_model * MOE.n_experts
    assert all(c.kind == "all-reduce" for c in others)


test_the_all_to_alls_are_the_ep_ledgers.fast_cases = {"cf1-gspmd"}


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_the_loss_chunks_count_an_ep_ranks_rows(impl):
    """The chunked loss cuts `loss_chunk` tokens of the rows one rank holds:
    16 / ep 4 = 4 rows of 32 positions, so 64 tokens are 2 chunks of 16
    positions under every impl (gspmd once took ep's rows for 16: 8 chunks,
    8 sets of the loss's reductions, off the ledger)."""
    from jaxtp.model.vocab import loss_chunks
    assert loss_chunks(64, 4, 32) == (2, 16)
    cfg, sizes, colls = compiled(impl, 1.0, loss_chunk=64)
    assert check(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None


test_the_loss_chunks_count_an_ep_ranks_rows.fast_cases = {"gspmd"}


def test_the_all_to_all_bytes_follow_the_capacity_factor():
    """cf 2 moves twice cf 1's bytes over ep; dropless (C = s) E/k = 4 times."""
    moved = {f: sum(c.bytes * c.count for c in compiled("gspmd", f)[2]
                    if c.kind == "all-to-all") for f in (1.0, 2.0, 0.0)}
    assert moved[2.0] == 2 * moved[1.0] and moved[0.0] == 4 * moved[1.0]
    assert slots(compiled("gspmd", 1.0)[0]) * 4 * MOE.n_layers * 4 == moved[1.0]


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_remat_full_sends_the_slots_again_and_the_others_keep_them(impl):
    """Under remat "full" the backward repeats the forward's dispatch and
    combine (6 all-to-alls per layer); "minimal" and "dots" keep what they
    delivered ("ep_slots"): 4, as without remat; told to resend them
    (`model.moe_slots=resend`), 6 again, and tp's g over the slots again."""
    moved = {}
    for remat, kept in (("minimal", "keep"), ("dots", "keep"), ("full", "keep"),
                        ("minimal", "resend")):
        cfg, sizes, colls = compiled(impl, 1.0, remat=remat, slots=kept)
        assert check(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None
        moved[remat, kept] = sum(c.bytes * c.count for c in colls if c.kind == "all-to-all")
    cfg, _, _ = compiled(impl, 1.0)
    per_layer = slots(cfg) * 4  # f32 bytes of one rank's buffer, per all-to-all
    assert moved == {("minimal", "keep"): 4 * 2 * per_layer, ("dots", "keep"): 4 * 2 * per_layer,
                     ("full", "keep"): 6 * 2 * per_layer, ("minimal", "resend"): 6 * 2 * per_layer}


test_remat_full_sends_the_slots_again_and_the_others_keep_them.fast_cases = {"gspmd"}


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_minimal_remat_keeps_the_slots_only_where_they_travelled(impl):
    """The residuals "minimal" saves for the backward pass (traced, not
    compiled): at ep 4 the slots each all-to-all delivered, [E, G, C, D]
    twice per layer; at ep 1 (dp 4) none, as nothing was sent (keeping them
    there cost mixtral 2.6x its temporaries, docs/scale.md)."""
    model = dataclasses.replace(MOE, moe_d_ff=48, capacity_factor=1.0, remat="minimal")
    slot = f"f32[{model.n_experts},{B},{capacity(model.seq_len, 2, 8, 1.0)},{model.d_model}]"
    kept = {}
    for dp, ep in ((4, 1), (1, 4)):
        cfg = validate(Config(model, TrainConfig(batch_size=B),
                              ParallelConfig(dp=dp, ep=ep, tp=2, impl=impl)))
        mesh = Layout.of(cfg).mesh()
        state = abstract_train_state(cfg, mesh)
        tokens = jax.ShapeDtypeStruct((B, model.seq_len + 1), jnp.int32)
        out = io.StringIO()
        with jax.set_mesh(mesh), contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(
                lambda p, t: loss_fn(state.graphdef, p, t), state.params, tokens)
        kept[ep] = sum(line.startswith(slot + " ") for line in out.getvalue().splitlines())
    assert kept == {1: 0, 4: 2 * model.n_layers}


@pytest.mark.parametrize("impl, dp, ep, tp, kw", [
    pytest.param(impl, *layout, kw, id=f"{name}-{impl}")
    for impl in ("gspmd", "shard_map", "explicit")
    for name, layout, kw in (
        ("dp2xep2xtp2", (2, 2, 2), {}), ("ep8", (1, 8, 1), {}), ("dp4xtp2", (4, 1, 2), {}),
        # minimal remat at ep 1 recomputes the experts' g (no slots kept), and
        # DeepSeek-V3's sequence-wise balance loss: each sequence's statistics
        ("dp4xtp2-minimal-seq_aux", (4, 1, 2), {"remat": "minimal", "balance": "seq_aux"}),
        # the loss-free bias: its counts summed over the tokens in the forward
        ("dp2xep2xtp2-bias", (2, 2, 2), {"balance": "bias"}),
        # global_aux over 2 slices: aux's sums, none again under a remat (kept)
        ("dp2xep2xtp2-M2-minimal-global_aux", (2, 2, 2),
         {"balance": "global_aux", "microbatches": 2, "remat": "minimal"}),
        ("dp4xtp2-M2-full-every2-global_aux", (4, 1, 2),
         {"balance": "global_aux", "microbatches": 2, "remat": "full", "every": 2}))
    if impl != "explicit" or name == "dp2xep2xtp2"])
def test_the_moe_step_holds_its_ledger(impl, dp, ep, tp, kw):
    """Every collective of the step, by `expected_collectives`: the experts'
    gradients summed over dp alone (an ep rank owns its experts), every
    other weight's over dp x ep; the gradient norm over ep too; without ep
    (dp4 x tp2) the experts' and the dense weights' sums share dp."""
    cfg, sizes, colls = compiled(impl, 1.0, ep, tp, dp, **kw)
    assert check(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None
    experts = [c for c in colls if c.scope == "moe" and c.kind == "all-reduce"
               and c.pass_ == "backward" and "tp" not in c.axes(sizes)
               and "ep" not in c.axes(sizes)]
    assert bool(experts) == (dp > 1) and all(c.axes(sizes) == ("dp",) for c in experts)


test_the_moe_step_holds_its_ledger.fast_cases = set()


@pytest.mark.parametrize("impl, dp, ep, tp, cp", [
    pytest.param(impl, *layout, id=f"{name}-{impl}")
    for impl in ("gspmd", "shard_map", "explicit")
    for name, layout in (("dp2xep2xtp2", (2, 2, 2, 1)), ("dp4xtp2", (4, 1, 2, 1)),
                         ("dp2xep2xcp2-dropless", (2, 2, 1, 2)))
    if impl != "explicit" or name == "dp2xep2xtp2"])
def test_fsdp_gathers_every_weight_over_dp_and_the_ledger_says_how_each_gradient_returns(
        impl, dp, ep, tp, cp):
    """FSDP splits every weight's model dim over dp, the experts' and the
    router's too, not over ep: the ledger, and by hand each weight gathered
    over dp once in the forward (no gather over ep); GSPMD all-reduces every
    gradient whole over its batch axes (no reduce-scatter); shard_map
    reduce-scatters its region weights' and the experts' over dp, the
    experts' n/dp elements a rank, after the sums whole over ep (and cp)."""
    cfg, sizes, colls = compiled(impl, 0.0 if cp > 1 else 1.0, ep, tp, dp, fsdp=True, cp=cp)
    assert check(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None
    shards = param_shards(cfg)
    # (cp's gathers of K and V aside)
    gathered = [c for c in colls if c.kind == "all-gather" and c.pass_ == "forward"
                and c.axes(sizes) != ("cp",)]
    assert {c.axes(sizes) for c in gathered} == {("dp",)}
    assert sum(c.elements * c.count for c in gathered) == \
        sum(s.elements for s in shards if s.dp_split)
    back = [c for c in colls if c.pass_ == "backward" and "dp" in c.axes(sizes)
            and c.kind != "all-to-all"]
    # a rank's experts (E/ep of them, F over tp): SwiGLU's up [D, 2, F/tp], down [F/tp, D]
    m = cfg.model
    experts = m.n_layers * m.n_experts // ep * 3 * m.d_model * m.moe_d_ff // tp
    scattered = [c for c in back if c.kind == "reduce-scatter"]
    if impl != "shard_map":
        assert not scattered
        return
    assert {c.axes(sizes) for c in scattered} == {("dp",)}
    assert sum(c.elements * c.count for c in scattered if c.scope == "moe") == experts // dp


test_fsdp_gathers_every_weight_over_dp_and_the_ledger_says_how_each_gradient_returns.\
    fast_cases = set()


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_a_shared_expert_is_a_dense_mlp_on_the_tp_ledger(impl):
    """A shared expert adds a dense MLP's rows to the step, by hand: its g
    forward and f backward over tp, each B/(dp*ep) * s * D elements a rank,
    per layer; its weights' gradients with the dense ones (over dp x ep);
    the all-to-alls unchanged."""
    cfg, sizes, colls = compiled(impl, 1.0, 2, 2, 2, shared=48)
    assert check(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None
    mlp = [c for c in colls if c.scope == "mlp" and c.axes(sizes) == ("tp",)]
    n = B // 4 * MOE.seq_len * MOE.d_model
    assert {(c.kind, c.pass_, c.elements) for c in mlp} == \
        {("all-reduce", "forward", n), ("all-reduce", "backward", n)}
    assert sum(c.count for c in mlp) == 2 * MOE.n_layers
    a2a = lambda cs: sorted((c.pass_, c.elements, c.count) for c in cs if c.kind == "all-to-all")
    assert a2a(colls) == a2a(compiled(impl, 1.0, 2, 2, 2)[2])


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_every_other_layer_moe_sends_half_the_all_to_alls(impl):
    """model.moe_every 2 of 2 layers (layer 0 dense, layer 1 MoE) at dp2 x
    ep2 x tp2: the ledger, and by hand half the all-to-alls of every layer
    MoE, the dense layer's MLP g and f over tp (B/(dp*ep) * s * D each)."""
    cfg, sizes, colls = compiled(impl, 1.0, 2, 2, 2, every=2)
    assert check(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None
    a2a = lambda cs: [c for c in cs if c.kind == "all-to-all"]
    moved = lambda cs: sum(c.bytes * c.count for c in a2a(cs))
    assert 2 * moved(colls) == moved(compiled(impl, 1.0, 2, 2, 2)[2]) > 0
    mlp = [c for c in colls if c.scope == "mlp" and c.axes(sizes) == ("tp",)]
    assert sorted((c.pass_, c.elements, c.count) for c in mlp) == \
        [("backward", B // 4 * MOE.seq_len * MOE.d_model, 1),
         ("forward", B // 4 * MOE.seq_len * MOE.d_model, 1)]


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_ep_with_microbatches_sends_each_slices_slots(impl):
    """Two microbatches at dp2 x ep2 x tp2 (sliced one after another: the
    dense weights' gradients sum over dp x ep, the experts' over dp): the
    ledger, and by hand the all-to-alls of two slices of half the groups
    each, so the bytes of one whole batch in twice the collectives."""
    cfg, sizes, colls = compiled(impl, 1.0, 2, 2, 2, microbatches=2)
    assert check(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None
    whole = compiled(impl, 1.0, 2, 2, 2)[2]
    moved = lambda cs: sum(c.bytes * c.count for c in cs if c.kind == "all-to-all")
    count = lambda cs: sum(c.count for c in cs if c.kind == "all-to-all")
    assert moved(colls) == moved(whole) and count(colls) == 2 * count(whole)


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_a_float64_step_holds_its_ledger_in_float64(impl):
    """--float64 (the verification mode): the same ledger with every row in
    f64, those booked in the model's dtype and those in fp32 (the router's
    statistics, the loss's mean and vocab-parallel reductions, the gradient
    norm: `jaxtp.parallel.wide`); no collective of the step is left in f32,
    and no computation."""
    with jax.enable_x64(True):
        cfg = validate(Config(dataclasses.replace(MOE, capacity_factor=1.0, dtype="float64",
                                                  param_dtype="float64"),
                              TrainConfig(batch_size=B),
                              ParallelConfig(dp=2, ep=2, tp=2, impl=impl)))
        layout = Layout.of(cfg)
        step = compile_train_step(abstract_train_state(cfg, layout.mesh()), B, MOE.seq_len)
        rows = expected_collectives(cfg, impl, "cpu")
        fp32 = expected_collectives(dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, dtype="float32", param_dtype="float32")), impl, "cpu")
    colls = hlo.collectives(step.as_text())
    assert check(colls, rows, layout.sizes) is None
    assert {c.dtype for c in colls} == {"f64"}
    # the fp32 ledger's rows, each carried over (some of them fp32 there)
    assert [(r.name, r.elements, r.count) for r in fp32] == [
        (r.name, r.elements, r.count) for r in rows]
    assert "f32" in {r.dtype for r in fp32} and {r.dtype for r in rows} == {"f64"}
    # nothing computed in f32 but the step's two control scalars (the spike
    # guard's loss limit, the NaN injection's scale: `step_controls`), f32[2]
    # and its slices
    assert set(re.findall(r"\bf32\[[\d,]*\]", step.as_text())) == {"f32[2]", "f32[1]"}


test_a_float64_step_holds_its_ledger_in_float64.fast_cases = set()


@pytest.mark.slow
def test_compare_hlo_of_moe_tiny_at_ep4_tp2(tmp_path, capsys):
    """The command line: gspmd, shard_map and explicit match, and the
    all-to-alls are on the ep axis."""
    import json

    import train

    assert train.main(["--config", "moe-tiny", "--ep", "4", "--tp", "2", "--compare-hlo",
                       "--out", str(tmp_path), "model.n_layers=1"]) == 0
    printed = capsys.readouterr().out
    assert all(f"{impl}: matches budget" in printed for impl in ("gspmd", "shard_map",
                                                                 "explicit"))
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert report["ok"]
    assert any(line.startswith("ep ") and "all-to-all" in line for line in printed.splitlines())
    # the roofline prices an all-to-all by another model than the ledger: its
    # ep total differs (its ratio said beside "agree" read as a contradiction)
    ep = report["roofline"]["axes"]["ep"]
    said = next(line for line in printed.splitlines() if line.startswith("  ep: roofline"))
    assert ep["agree"] and abs(ep["ratio_roofline_to_ledger"] - 1) > 0.1, ep
    assert "differs by model" in said and said.endswith(
        "agree, priced the roofline's way (the totals differ by model)"), said


@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 4)], ids=["tp2", "dp2xtp4"])
def test_the_ragged_path_at_ep1_holds_its_ledger(impl, dp, tp):
    """The dropless ragged path on CPU (ep 1: no exchange): tp sums the
    layer's weighted output once forward (g) and dX once backward (f), each
    on the rank's N*D tokens (not the slots: 1/(k*cf) of them), plus the
    routing weights' gradient [N, k], whose outputs are partial over tp."""
    cfg, sizes, colls = compiled(impl, 0.0, 1, tp, dp, dispatch="ragged")
    assert check(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None
    N = B // dp * MOE.seq_len  # by hand: the rank's tokens
    moe_tp = sorted((c.pass_, c.elements) for c in colls
                    if c.scope == "moe" and c.axes(sizes) == ("tp",))
    assert moe_tp == sorted([("forward", N * MOE.d_model), ("backward", N * MOE.d_model),
                             ("backward", N * MOE.moe_top_k)] * MOE.n_layers)
    assert not [c for c in colls if c.kind.endswith("all-to-all")]


test_the_ragged_path_at_ep1_holds_its_ledger.fast_cases = {"tp2-gspmd"}


def test_the_ragged_path_at_ep_above_1_is_refused_on_cpu(capsys):
    """XLA:CPU compiles no ragged-all-to-all (jax-ml/jax#34755): refused
    before compiling, naming the way out."""
    import train

    assert train.main(["--config", "moe-tiny", "--ep", "4", "--tp", "2", "--steps", "1",
                       "model.moe_dispatch=ragged", "model.capacity_factor=0"]) == 2
    err = capsys.readouterr().err
    assert "jax-ml/jax#34755" in err and "model.moe_dispatch=dense" in err


def test_compare_hlo_refuses_fsdp_where_its_moe_rows_are_not_written(capsys):
    """--compare-hlo --fsdp of a MoE with --sp (or --pp): refused before
    compiling, naming what is built."""
    import train

    assert train.main(["--config", "moe-tiny", "--ep", "2", "--dp", "2", "--tp", "2",
                       "--fsdp", "--sp", "--compare-hlo", "model.capacity_factor=0"]) == 2
    err = capsys.readouterr().err
    assert "--compare-hlo --fsdp is not built for a mixture of experts with --sp" in err
    assert "without it it is" in err


@pytest.mark.slow
def test_the_ragged_path_holds_its_ledger_compiled_for_an_h100(tmp_path):
    """moe-tiny at ep 4 x tp 2, dropless and ragged, compiled for 8 H100s:
    per layer 2 ragged all-to-alls forward (R = ep*N*min(k, E/ep) rows into
    the worst-case buffer, A = N*k home) and their 2 transposes, the sizes'
    int32 exchanges, every collective as the ledger says under gspmd and
    shard_map, and the roofline agreeing on ep and tp."""
    import importlib.util
    import json

    import train

    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("jax_cuda12_plugin is not installed: cannot compile for h100 here")
    assert train.main(["--config", "moe-tiny", "--ep", "4", "--tp", "2", "--compare-hlo",
                       "--hardware", "h100", "--out", str(tmp_path), "model.n_layers=2",
                       "model.moe_dispatch=ragged", "model.capacity_factor=0"]) == 0
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert report["platform"] == "gpu" and report["ok"]
    assert {i for i, r in report["impls"].items() if r.get("matches_budget")} == {
        "gspmd", "shard_map"}
    N, D = 16 // 4 * 128, 128  # moe-tiny: batch 16 over ep 4, 128 tokens each; d_model
    R, A = 4 * N * 2, N * 2  # ep * N * min(k=2, 8/4); N * k
    ragged = sorted((c["pass"], math.prod(c["shape"]))
                    for c in report["impls"]["gspmd"]["collectives"]
                    if c["kind"] == "ragged-all-to-all" for _ in range(c["count"]))
    assert ragged == sorted([(p, n * D) for p in ("forward", "backward") for n in (R, A)] * 2)


@pytest.mark.slow
@pytest.mark.parametrize("target, package", [("h100", "jax_cuda12_plugin"),
                                             ("tpu-v5p", "libtpu")])
def test_the_all_to_alls_hold_their_ledger_compiled_for_an_accelerator(target, package,
                                                                        tmp_path):
    """moe-tiny at ep 4 x tp 2 (capacity factor 1.25, 2 layers) compiled for
    8 H100s or a v5p 2x2x2: an all-to-all there is one array of the rank's
    whole slot buffer (XLA:CPU's is one operand per peer), 2 per layer and
    pass; libtpu carries the slots (the all-to-alls and tp's g and f inside
    the experts) in bf16, the precision its matmuls read them in. Every impl
    holds the ledger as that compiler carries it out."""
    import importlib.util
    import json

    import train

    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: cannot compile for {target} here")
    assert train.main(["--config", "moe-tiny", "--ep", "4", "--tp", "2", "--compare-hlo",
                       "--hardware", target, "--out", str(tmp_path), "model.n_layers=2"]) == 0
    report = json.loads((tmp_path / "comm_report.json").read_text())
    assert report["ok"] and len(report["impls"]) == 3
    # by hand: E * G_r * C * D = 8 experts x 4 groups (16 over ep 4) x 40
    # slots (ceil(1.25 * 128 * 2 / 8)) x 128
    n, dtype = 8 * 4 * 40 * 128, "bf16" if target == "tpu-v5p" else "f32"
    for impl, r in report["impls"].items():
        a2a = sorted((c["pass"], math.prod(c["shape"]), c["dtype"])
                     for c in r["collectives"] if c["kind"] == "all-to-all"
                     for _ in range(c["count"]))
        assert a2a == sorted([(p, n, dtype) for p in ("forward", "backward")] * 4), impl
        g = [c for c in r["collectives"] if c["kind"] == "all-reduce" and c["scope"] == "moe"
             and math.prod(c["shape"]) == n]  # E/ep x (ep x G) x C x D: the rank's slots
        assert sum(c["count"] for c in g) == 4 and {c["dtype"] for c in g} == {dtype}, impl


@pytest.mark.parametrize("remat", ["none", "full"])
def test_slices_reduced_once_transpose_the_router_statistics_means(remat):
    """dp 2 x tp 4, 2 microbatches reduced once (dp manual in the slices):
    the statistics' means are psums there, transposed in the backward: P's
    (E elements) in each MoE layer and slice, the z-loss's scalar once (XLA:CPU
    hoists it out of the loop), or with a remat 1 + E in each; the step holds
    its ledger."""
    cfg, sizes, colls = compiled("gspmd", 1.0, ep=1, tp=4, dp=2, microbatches=2, remat=remat)
    assert check(colls, expected_collectives(cfg, "gspmd", "cpu"), sizes) is None
    L, M, E = cfg.model.n_layers, 2, cfg.model.n_experts
    back: dict[int, int] = {}  # elements -> collectives of that size
    for c in colls:
        if c.pass_ == "backward" and c.scope == "moe" and c.axes(sizes) == ("dp",):
            back[c.elements] = back.get(c.elements, 0) + c.count
    if remat == "none":
        assert back == {1: 1, E: L * M}
    else:  # (with the remat's f summed again: 1 + 2E a layer and slice in all)
        assert sum(n * k for n, k in back.items()) == L * M * (1 + 2 * E)
