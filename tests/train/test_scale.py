"""Training at scale: dp x tp (and FSDP), gradient accumulation, scanned and
rematerialised layers, mixed precision, and skipped steps. Every parallel
result is compared with a single device (dp=1, tp=1, one batch, unscanned)."""

import dataclasses
import functools
import math
import re
import time

import jax
import numpy as np
import pytest

from jaxtp import hlo
from jaxtp.analysis.budget import expected_collectives
from jaxtp.analysis.rows import check as check_rows
from jaxtp.config import REMATS, Config, ModelConfig, ParallelConfig, TrainConfig, validate
from jaxtp.model import stack_layers
from jaxtp.parallel import make_mesh
from jaxtp.train.state import abstract_train_state, init_train_state
from cached import assert_same, initial_values, step_loss_and_grads
from cached import loss_and_grads as cached_loss_and_grads
from jaxtp.train.step import compile_train_step, make_train_step, step_controls

MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, seq_len=16)
GQA = dataclasses.replace(MODEL, style="llama", n_kv_heads=2, use_bias=False,
                          tie_embeddings=False)
TOKENS = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)


def cfg_of(model=MODEL, dp=1, tp=1, **kw):
    par = {k: kw.pop(k) for k in ("impl", "sp", "fsdp", "overlap") if k in kw}
    return validate(Config(dataclasses.replace(model, **{k: kw.pop(k) for k in (
        "scan_layers", "remat", "dtype", "dropout") if k in kw}),
        TrainConfig(batch_size=8, **kw), ParallelConfig(dp=dp, tp=tp, **par)))


def loss_and_grads(cfg, values=None, tokens=TOKENS, key=None):
    """(loss, {path: full gradient}) of one batch; `values` as `place_params` takes them."""
    return cached_loss_and_grads(cfg, tokens, values, key)


@functools.cache
def one_device(model):
    """loss_and_grads on one device (dp=1, tp=1), once per model."""
    return loss_and_grads(cfg_of(model))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gspmd", "shard_map", "explicit"])
def test_dropout_in_microbatches_over_dp_equals_one_device(impl):
    """Dropout masks are drawn per global row (jaxtp.model.layers.dropout), so
    a dp rank's slice inside the dp-local accumulation drops the units one
    device drops for those rows."""
    values, key = initial_values(cfg_of(dropout=0.2)), jax.random.key(3)
    ref = loss_and_grads(cfg_of(dropout=0.2, microbatches=2), values, key=key)
    assert_same(loss_and_grads(cfg_of(dp=2, tp=4, impl=impl, dropout=0.2, microbatches=2),
                               values, key=key), ref)




@pytest.mark.slow
@pytest.mark.parametrize("model, impl", [(MODEL, "shard_map"), (GQA, "shard_map"),
                                         (MODEL, "gspmd")],
                         ids=["gpt2", "llama-gqa", "gpt2-gspmd"])
def test_dp2_tp4_collective_matmul_with_and_without_fsdp_equals_one_device(model, impl):
    """SP's overlap at dp=2 x tp=4 (shard_map's rings; GSPMD's windowed form,
    its entry matmul rematerialised over FSDP's gathered weight), the weights
    replicated over dp or split over it (FSDP): loss and every gradient as on
    one device. (That each gradient is summed over dp once, not once per ring
    step, is the budget's to see: tests/analysis/test_budget.py.)"""
    ref = one_device(model)
    for fsdp in (False, True):
        assert_same(loss_and_grads(cfg_of(model, dp=2, tp=4, impl=impl, sp=True,
                                          fsdp=fsdp, overlap="collective_matmul")), ref)




@pytest.mark.slow
def test_grad_norm_and_update_at_dp_tp_fsdp_equal_one_device():
    """The one-all-reduce gradient norm (weights 1/size over unsplit axes) and
    the clipped AdamW step, against one device."""
    cfg = cfg_of(warmup_steps=0)
    ref = run(cfg, 1, lambda s: step_controls())[-1]
    got = run(cfg_of(dp=2, tp=4, fsdp=True, warmup_steps=0), 1, lambda s: step_controls())[-1]
    np.testing.assert_allclose(got[1]["grad_norm"], ref[1]["grad_norm"], rtol=1e-6)
    # Adam's first step is lr * g / (|g| + eps): near eps it turns the round-off
    # of a gradient that cancels to almost 0 into the update (the key bias's is
    # exactly 0, softmax being shift-invariant; a key weight's measured 4e-9,
    # whose 0.16% moved the update by 1.4e-6 on an AMD EPYC). The update is
    # compared where the (clipped) gradient is past 100 eps; the gradients
    # themselves are compared everywhere (tests/train/test_scale.py's parity).
    _, grads = loss_and_grads(cfg)
    clip = min(1.0, cfg.train.grad_clip / float(ref[1]["grad_norm"]))
    flat = jax.tree_util.tree_flatten_with_path(ref[0][0])[0]
    compared = []
    for (path, b), a in zip(flat, jax.tree.leaves(got[0][0])):
        g = grads[jax.tree_util.keystr(path).removesuffix(".value")] * clip
        well = np.abs(g) > 100 * 1e-8  # optax.adamw's eps
        compared.append(well.ravel())
        np.testing.assert_allclose(np.asarray(a)[well], np.asarray(b)[well], rtol=1e-5,
                                   atol=1e-6)
    assert np.concatenate(compared).mean() > 0.98  # all but the near-zero gradients (98.8%)


def test_fsdp_splits_parameters_and_adam_state_over_dp():
    cfg = cfg_of(dp=2, tp=4, fsdp=True)
    state = init_train_state(cfg, make_mesh(2, 4))
    up = state.params["blocks"][0]["mlp"]["up"]["kernel"]  # [D, F]: embed x mlp
    assert up.sharding.spec == jax.sharding.PartitionSpec("dp", "tp")
    assert up.addressable_shards[0].data.shape == (32 // 2, 64 // 4)
    mu = state.opt_state[0].mu["blocks"][0]["mlp"]["up"]["kernel"]
    assert mu.sharding.spec == up.sharding.spec
    norm = state.params["blocks"][0]["ln1"]["scale"]
    assert norm.addressable_shards[0].data.shape == (32 // 2,)


@pytest.mark.slow
def test_four_microbatches_equal_one_batch():
    values = initial_values(cfg_of())
    ref = loss_and_grads(cfg_of(), values)
    assert_same(loss_and_grads(cfg_of(microbatches=4), values), ref)
    assert_same(loss_and_grads(cfg_of(dp=2, tp=2, microbatches=2, fsdp=True), values), ref)
    # explicit: the accumulators typed like the parameters they sum
    assert_same(loss_and_grads(cfg_of(dp=2, tp=2, microbatches=2, impl="explicit"), values), ref)


@functools.cache
def unscanned(impl):
    """(parameter values, loss and gradients) of the unscanned GQA stack with
    dropout, once per impl: what every remat policy's scanned stack must equal."""
    plain = cfg_of(GQA, tp=4, impl=impl, dropout=0.1)
    values = initial_values(plain)
    return values, loss_and_grads(plain, values, key=jax.random.key(3))


@pytest.mark.slow
@pytest.mark.parametrize("impl, remat", [
    ("gspmd", "none"), ("gspmd", "full"), ("shard_map", "full"), ("shard_map", "dots"),
    ("shard_map", "minimal"), ("explicit", "none"), ("explicit-sp", "full")])
def test_scanned_stack_equals_unscanned(impl, remat):
    """Same parameters, stacked on a layer axis: same loss and every gradient,
    with dropout on (the per-layer keys are the same); explicit also under SP.
    Each remat policy under shard_map, whose psums the policies' saved names
    sit beside, and none and full under the other impls."""
    impl, sp = impl.split("-")[0], impl.endswith("-sp")
    values, ref = unscanned(impl)
    scanned = cfg_of(GQA, tp=4, impl=impl, dropout=0.1, scan_layers=True, remat=remat, sp=sp)
    loss, grads = loss_and_grads(scanned, stack_layers(values), key=jax.random.key(3))
    unstacked = {}
    for k, g in grads.items():
        if k.startswith("['blocks']"):
            for i in range(GQA.n_layers):
                unstacked[k.replace("['blocks']", f"['blocks'][{i}]", 1)] = g[i]
        else:
            unstacked[k] = g
    assert_same((loss, unstacked), ref)


# every policy in REMATS is among the cases
assert {r for _, r in test_scanned_stack_equals_unscanned.pytestmark[0].args[1]} == set(REMATS)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gspmd", "shard_map"])
def test_scanned_collectives_per_layer_and_compile_time(impl):
    """The scanned stack is a while loop: jaxtp.hlo multiplies its body's
    collectives by the trip count, and the budget holds at 2 and 8 layers.
    Compile times are printed (-s), not asserted."""
    times = {}
    for L in (2, 8):
        cfg = cfg_of(dataclasses.replace(MODEL, n_layers=L), tp=4, impl=impl, scan_layers=True)
        t0 = time.perf_counter()
        text = compile_train_step(abstract_train_state(cfg, make_mesh(1, 4)), 8,
                                  MODEL.seq_len).as_text()
        times[L] = time.perf_counter() - t0
        assert "while" in text
        colls = hlo.collectives(text)
        assert check_rows(colls, expected_collectives(cfg, impl)) is None
        per_layer = sum(c.count for c in colls if c.scope == "mlp" and c.kind == "all-reduce")
        assert per_layer == 2 * L  # one forward, one backward per layer
    print(f"\ncompile time, scanned, {impl}: 2 layers {times[2]:.1f}s, 8 layers {times[8]:.1f}s")




def run(cfg, n, controls):
    mesh = make_mesh(cfg.parallel.dp, cfg.parallel.tp)
    state = init_train_state(cfg, mesh, initial_values(cfg))
    step = make_train_step(state, use_dropout=False)
    p, o, out = state.params, state.opt_state, []
    with jax.set_mesh(mesh):
        for i in range(n):
            p, o, m = step(p, o, TOKENS, jax.random.key(i), controls(i + 1))
            out.append((jax.device_get((p, o)), jax.device_get(m)))
    return out


@pytest.mark.slow
def test_nan_gradient_skips_exactly_that_step():
    cfg = cfg_of(tp=4, warmup_steps=0)
    steps = run(cfg, 4, lambda s: step_controls(grad_scale=np.nan if s == 3 else 1.0))
    same = lambda a, b: all(np.array_equal(x, y) for x, y in
                            zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert [bool(m["skipped"]) for _, m in steps] == [False, False, True, False]
    assert same(steps[2][0], steps[1][0])  # params and Adam state (and its count) unchanged
    assert not same(steps[3][0], steps[2][0])
    assert not same(steps[1][0], steps[0][0])
    assert np.isnan(steps[2][1]["grad_norm"]) and np.isfinite(steps[2][1]["loss"])


@pytest.mark.slow
def test_spike_guard_skips_a_loss_above_the_limit():
    cfg = cfg_of(tp=2, warmup_steps=0)
    steps = run(cfg, 2, lambda s: step_controls(max_loss=1.0 if s == 2 else np.inf))
    loss = float(steps[1][1]["loss"])
    assert loss > 1.0 and bool(steps[1][1]["skipped"])
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(steps[1][0]),
                                                     jax.tree.leaves(steps[0][0])))


@pytest.mark.slow
def test_mixed_precision_keeps_fp32_master_weights_and_loss():
    """bf16 compute: parameters, Adam moments and the loss stay fp32; the
    bf16 loss is the fp32 one to within one bf16 rounding (2**-8 relative;
    measured 6.7e-6: at initialisation the logits are small and the loss is
    near log V, so bf16's rounding of the matmuls barely moves it)."""
    fp32 = run(cfg_of(tp=4), 2, lambda s: step_controls())
    bf16 = run(cfg_of(tp=4, dtype="bfloat16"), 2, lambda s: step_controls())
    (params, opt), metrics = bf16[-1]
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(opt[0].mu)} == {np.dtype("float32")}
    assert metrics["loss"].dtype == np.float32
    np.testing.assert_allclose(metrics["loss"], fp32[-1][1]["loss"], rtol=2**-8)
    assert metrics["loss"] != fp32[-1][1]["loss"]  # bf16 did run
    cfg = cfg_of(tp=4, dtype="bfloat16")
    text = compile_train_step(abstract_train_state(cfg, make_mesh(1, 4)), 8,
                              MODEL.seq_len).as_text()
    assert re.search(r"= bf16\[[^\]]*\][^=]* (dot|convolution|fusion)\(", text)
    ce = [c for c in hlo.collectives(text) if c.scope == "cross_entropy" and c.pass_ == "forward"]
    assert ce and {c.dtype for c in ce} == {"f32"}  # the loss's tp reductions stay fp32
    assert not bool(metrics["skipped"])


# the layouts of issue 28's ledger: each is its own budget rows (SP's learned
# positions' dp slice and GSPMD's two-step kv gradient; FSDP's gathers and
# reduce-scatters; slices over dp reduced once; a scanned stack's per-layer
# gathers, counted by trip count, and a remat's regathers)
VARIANTS_DP = {"plain": {}, "sp": {"sp": True}, "fsdp": {"fsdp": True},
               "mb2": {"microbatches": 2}, "fsdp-sp": {"fsdp": True, "sp": True},
               "fsdp-sp-mb2": {"fsdp": True, "sp": True, "microbatches": 2},
               "fsdp-scanned-remat": {"fsdp": True, "microbatches": 2, "scan_layers": True,
                                      "remat": "full"}}


@functools.cache
def dp2_tp4_step(model, impl, **kw):
    """(cfg, its train step compiled at dp=2 x tp=4): one program per layout,
    whose HLO the budget reads and whose numbers the parity check runs."""
    cfg = cfg_of(model, dp=2, tp=4, impl=impl, **kw)
    return cfg, compile_train_step(abstract_train_state(cfg, make_mesh(2, 4, impl=impl)), 8,
                                   MODEL.seq_len)


def dp2_tp4_collectives(model, impl, **kw):
    cfg, step = dp2_tp4_step(model, impl, **kw)
    return cfg, hlo.collectives(step.as_text())


# each layout's one compiled step is checked twice, by neighbouring cases (so
# one test worker compiles it once): its collectives against the budget, and
# its gradients against one device
@pytest.mark.parametrize("check", ["budget", "one-device"])
@pytest.mark.parametrize("variant", list(VARIANTS_DP))
@pytest.mark.parametrize("impl", ["gspmd", "shard_map", "explicit"])
@pytest.mark.parametrize("model", [MODEL, GQA], ids=["gpt2", "llama-gqa"])
def test_the_dp2_tp4_step_holds_the_budget_and_one_devices_gradients(model, impl, variant,
                                                                       check):
    """dp=2 x tp=4 in every layout of VARIANTS_DP, for the three impls.

    budget: the tp budget per dp rank and microbatch (b = B/dp/M) plus the dp
    rows; shard_map writes dp out too, so no activation is gathered over dp.
    one-device: the step's loss and gradients (read from its first Adam
    moment: `cached.step_loss_and_grads`) are one batch's on one device (a
    scanned stack's against one device's, scanned too): plain, FSDP, SP, the
    slices in a shard_map manual over dp with their gradient reduced once
    (jaxtp.parallel.schedule), and their combinations.
    """
    if check == "one-device":
        cfg, step = dp2_tp4_step(model, impl, **VARIANTS_DP[variant])
        ref = dataclasses.replace(model, scan_layers=cfg.model.scan_layers)
        assert_same(step_loss_and_grads(cfg, step, TOKENS), one_device(ref))
        return
    cfg, colls = dp2_tp4_collectives(model, impl, **VARIANTS_DP[variant])
    # exact: a collective the budget lacks (an activation gathered over dp) fails too,
    # and so does one over other mesh axes than its row names (tp, dp or both)
    expected = expected_collectives(cfg, impl, jax.default_backend())
    sizes = {"dp": 2, "tp": 4}
    assert check_rows(colls, expected, sizes) is None
    # the same rows with dp's and tp's axes swapped are caught
    swap = {("dp",): ("tp",), ("tp",): ("dp",)}
    wrong = [dataclasses.replace(e, axes=swap.get(e.axes, e.axes)) for e in expected]
    assert "(dp)" in check_rows(colls, wrong, sizes) or "(tp)" in check_rows(colls, wrong, sizes)
    if cfg.parallel.fsdp and cfg.model.remat == "none":
        # by hand, ZeRO-3's forward: every parameter split over dp is gathered
        # over dp once (a loop invariant, hoisted out of the microbatch loop),
        # its gathered tp shard the elements; the state's own shapes say which
        state = abstract_train_state(cfg, make_mesh(2, 4, impl=impl))
        whole = sum(math.prod(x.sharding.shard_shape(x.shape)) * 2
                    for x in jax.tree.leaves(state.params) if "dp" in str(x.sharding.spec))
        gathered = sum(c.elements * c.count for c in colls
                       if c.kind == "all-gather" and c.axes(sizes) == ("dp",))
        assert gathered == whole


test_the_dp2_tp4_step_holds_the_budget_and_one_devices_gradients.fast_cases = {
    f"{case}-{check}" for case in ("llama-gqa-shard_map-sp", "gpt2-gspmd-fsdp-sp-mb2",
                                   "gpt2-explicit-fsdp") for check in ("budget", "one-device")}


@pytest.mark.parametrize("impl", ["gspmd", "shard_map", "explicit"])
@pytest.mark.parametrize("model", [MODEL, GQA], ids=["gpt2", "llama-gqa"])
def test_a_16bit_step_sums_each_gradient_over_dp_in_the_dtype_it_is_used_in(model, impl):
    """float16 at dp=2 x tp=4 (XLA:CPU carries f16 collectives in f16, as
    XLA:GPU carries bf16): a weight cast to f16 where it is used (kernels,
    biases, learned positions) has its gradient summed over dp in f16, before
    the cast back; the norms and the vocab lookup in fp32; the LM head's
    table in fp32 where GSPMD places its sum (on the head's fp32 dot), in f16
    in shard_map's region. The budget says so, and so do the state's shapes."""
    cfg, colls = dp2_tp4_collectives(model, impl, dtype="float16")
    sizes = {"dp": 2, "tp": 4}
    assert check_rows(colls, expected_collectives(cfg, impl, "cpu"), sizes) is None
    state = abstract_train_state(cfg, make_mesh(2, 4, impl=impl))
    want = {"f16": 0, "f32": 0}
    for path, x in jax.tree_util.tree_leaves_with_path(state.params):
        name = jax.tree_util.keystr(path)
        n = math.prod(x.sharding.shard_shape(x.shape))
        if "'ln" in name:  # a norm, used in fp32
            want["f32"] += n
        elif "'wte'" in name or "'lm_head'" in name:  # the lookup's part; the head's
            want["f32"] += n * ("'wte'" in name)
            if "'lm_head'" in name or model.tie_embeddings:
                want["f16" if impl == "shard_map" else "f32"] += n
        else:
            want["f16"] += n
    over_dp = {dt: sum(c.elements * c.count for c in colls if c.kind == "all-reduce"
                       and c.pass_ == "backward" and c.dtype == dt
                       and c.axes(sizes) == ("dp",)) for dt in want}
    assert over_dp == want


test_a_16bit_step_sums_each_gradient_over_dp_in_the_dtype_it_is_used_in.fast_cases = {
    "gpt2-shard_map"}


@pytest.mark.parametrize("impl", ["gspmd", "explicit"])
def test_fsdp_in_bf16_gathers_the_tied_table_once(impl):
    """bf16 FSDP: every weight is gathered in bf16 but the vocab table, in its
    own fp32 for the lookup and the head alike, so the tied table's two uses
    are one gather (the budget, whose CPU rows carry 16-bit in fp32)."""
    cfg, colls = dp2_tp4_collectives(MODEL, impl, fsdp=True, dtype="bfloat16")
    assert check_rows(colls, expected_collectives(cfg, impl, "cpu"), {"dp": 2, "tp": 4}) is None
    table = MODEL.padded_vocab // 4 * MODEL.d_model
    assert sum(c.count for c in colls if c.kind == "all-gather" and c.elements == table) == 1


test_fsdp_in_bf16_gathers_the_tied_table_once.fast_cases = {"gspmd"}


@pytest.mark.slow
def test_the_dp_gradient_is_reduced_once_per_step_whatever_the_microbatches():
    """Slices over dp are summed on each rank and reduced once (jaxtp.train.
    step): the dp bytes at M=4 are those of one batch (Llama, untied), and
    GPT-2's tied table is reduced once instead of twice (its lookup's and
    head's parts added first: by hand, V/tp x D fewer elements)."""
    sizes = {"dp": 2, "tp": 4}
    dp_bytes = lambda colls: hlo.by_axis(colls, sizes)["dp"]["bytes"]
    for model in (GQA, MODEL):
        one = dp_bytes(dp2_tp4_collectives(model, "gspmd")[1])
        four = dp_bytes(dp2_tp4_collectives(model, "gspmd", microbatches=4)[1])
        tied = model.padded_vocab // 4 * model.d_model * 4 if model.tie_embeddings else 0
        assert four == one - tied, (model.style, one, four)
