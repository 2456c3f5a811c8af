"""Context parallelism (jaxtp.parallel.context): the sequence split over a cp
axis. Every layout's loss and gradients equal one device's; the compiled
step holds exactly the cp ledger (jaxtp.analysis.cp), checked here also by
hand from the formulas of Liu et al. 2023 and the Llama 3 paper; bad input
is refused before anything compiles."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtp import hlo
from jaxtp.analysis.budget import expected_collectives
from jaxtp.analysis.rows import check
from jaxtp.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig, validate
from jaxtp.model import blockwise, kernels
from jaxtp.parallel import Layout, cp_batch, cp_order
from jaxtp.train.state import abstract_train_state
from jaxtp.train.step import compile_train_step
from cached import assert_same
from cached import loss_and_grads as cached_loss_and_grads

MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, seq_len=16)
GQA = dataclasses.replace(MODEL, style="llama", n_kv_heads=2, use_bias=False,
                          tie_embeddings=False)  # K=2: K < tp at tp=4
MODELS = {"gpt2": MODEL, "llama-gqa": GQA}
TOKENS = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)


def cfg_of(model=MODEL, **kw):
    mk = {k: kw.pop(k) for k in ("scan_layers", "remat", "attention", "attention_block",
                                 "loss_chunk", "dtype") if k in kw}
    tk = {k: kw.pop(k) for k in ("microbatches",) if k in kw}
    return validate(Config(dataclasses.replace(model, **mk), TrainConfig(batch_size=8, **tk),
                           ParallelConfig(**kw)))


def loss_and_grads(cfg):
    return cached_loss_and_grads(cfg, TOKENS)


@functools.cache
def one_device(model):
    return loss_and_grads(cfg_of(model))


def test_cp_order_is_the_dual_chunk_swap():
    # rank r holds chunks r and 2cp-1-r of 2cp; a permutation; identity at cp=1
    assert cp_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert cp_order(8, 4, balance=False).tolist() == list(range(8))
    order = cp_order(48, 4).reshape(4, 12)  # rank r's T/cp positions
    for r in range(4):
        chunks = {int(p) // 6 for p in order[r]}
        assert chunks == {r, 7 - r}
    assert sorted(cp_order(48, 4).tolist()) == list(range(48))
    # a placed batch: inputs and targets reordered alike, no shift across chunks
    pair = cp_batch(TOKENS, 2, True)
    assert pair.shape == (8, 2, 16)
    o = cp_order(16, 2)
    np.testing.assert_array_equal(pair[:, 0], TOKENS[:, :-1][:, o])
    np.testing.assert_array_equal(pair[:, 1], TOKENS[:, 1:][:, o])


@pytest.mark.parametrize("kernel", ["xla", "blockwise"])
def test_parts_merged_by_log_sum_exp_are_causal_attention(kernel):
    """Queries and keys in 4 chunks at their offsets, each pair one `Core.part`
    merged by log-sum-exp (a ring's work, above-diagonal pairs included), and
    each query chunk over all keys (the all-gather's), equal the reference
    xla attention, forward and every gradient."""
    B, T, K, G, H, c = 2, 64, 2, 2, 8, 16
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, K, G, H))
    k, v = jax.random.normal(ks[1], (B, T, K, H)), jax.random.normal(ks[2], (B, T, K, H))
    w = jax.random.normal(ks[3], (B, T, K, G, H))
    core = kernels.Core(kernel, 8)
    tr = lambda x: x.transpose(0, 3, 1, 2)[..., None]

    def ring(q, k, v):
        outs = []
        for i in range(4):
            o, lse = None, None
            for j in range(4):
                oj, lj = core.part(q[:, i * c:(i + 1) * c], k[:, j * c:(j + 1) * c],
                                   v[:, j * c:(j + 1) * c], jnp.int32(i * c), jnp.int32(j * c))
                if o is None:
                    o, lse = oj, lj
                    continue
                new = jnp.logaddexp(lse, lj)
                o, lse = o * tr(jnp.exp(lse - new)) + oj * tr(jnp.exp(lj - new)), new
            outs.append(o)
        return jnp.sum(jnp.concatenate(outs, 1) * w)

    def gathered(q, k, v):
        return jnp.sum(jnp.concatenate([core.part(q[:, i * c:(i + 1) * c], k, v,
                                                  jnp.int32(i * c), jnp.int32(0))[0]
                                        for i in range(4)], 1) * w)

    ref = lambda q, k, v: jnp.sum(kernels.xla_attention(q, k, v) * w)
    want, g_ref = jax.jit(jax.value_and_grad(ref, (0, 1, 2)))(q, k, v)
    for fn in (ring, gathered):  # one program each: the value and its gradients
        got, grads = jax.jit(jax.value_and_grad(fn, (0, 1, 2)))(q, k, v)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(grads, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


test_parts_merged_by_log_sum_exp_are_causal_attention.fast_cases = {"xla"}


def test_a_part_wholly_above_the_diagonal_sees_nothing():
    q = jnp.ones((1, 8, 1, 1, 4))
    o, lse = blockwise.blockwise_chunk(q, q[:, :, :, 0], q[:, :, :, 0], jnp.int32(0),
                                       jnp.int32(8), 4)
    assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()


# (impl, model) x layouts: cp 2, 4, 8; cp x tp 2 x 4 and 4 x 2; dp x cp x tp
# 2 x 2 x 2; SP on and off, balance on and off, both strategies
LAYOUTS = {
    "cp2xtp4-allgather": dict(cp=2, tp=4),
    "cp4xtp2-sp-ring": dict(cp=4, tp=2, sp=True, cp_attention="ring"),
    "dp2xcp2xtp2-sp-ring-unbalanced": dict(dp=2, cp=2, tp=2, sp=True, cp_attention="ring",
                                           cp_balance=False),
    "cp8-allgather-unbalanced": dict(cp=8, cp_balance=False),
    "cp2-ring": dict(cp=2, cp_attention="ring"),
    # the loss in chunks within each rank's positions (2 per rank)
    "cp2xtp2-sp-loss-chunks": dict(cp=2, tp=2, sp=True, loss_chunk=32),
    "cp2xtp4-scan-minimal-blockwise-ring": dict(cp=2, tp=4, cp_attention="ring",
                                                scan_layers=True, remat="minimal",
                                                attention="blockwise", attention_block=2),
}


# which models each layout runs (both where the layout is the core of the
# issue; K < tp is llama-gqa at tp=4)
CASES = [("cp2xtp4-allgather", "gpt2"), ("cp2xtp4-allgather", "llama-gqa"),
         ("cp4xtp2-sp-ring", "llama-gqa"),
         ("dp2xcp2xtp2-sp-ring-unbalanced", "gpt2"), ("cp8-allgather-unbalanced", "llama-gqa"),
         ("cp2-ring", "gpt2"), ("cp2xtp2-sp-loss-chunks", "llama-gqa"),
         ("cp2xtp4-scan-minimal-blockwise-ring", "llama-gqa")]
assert {layout for layout, _ in CASES} == set(LAYOUTS)


@pytest.mark.parametrize("layout, model", CASES, ids=[f"{m}-{layout}" for layout, m in CASES])
@pytest.mark.parametrize("impl", ["gspmd", "shard_map", "explicit"])
def test_cp_equals_one_device(impl, model, layout):
    kw = dict(LAYOUTS[layout])
    # a scanned stack's gradients are stacked: against one device's, scanned
    # too (its attention the xla reference)
    ref = dataclasses.replace(MODELS[model], scan_layers=kw.get("scan_layers", False))
    assert_same(loss_and_grads(cfg_of(MODELS[model], impl=impl, **kw)), one_device(ref))


test_cp_equals_one_device.fast_cases = {"gspmd-llama-gqa-cp2xtp2-sp-loss-chunks",
                                        "shard_map-gpt2-cp2xtp4-allgather",
                                        "explicit-gpt2-dp2xcp2xtp2-sp-ring-unbalanced"}


# The ledger: every collective of the compiled train step, budgeted per axis
LEDGER = {
    "cp4xtp2-allgather": (GQA, dict(cp=4, tp=2)),
    "cp2xtp4-ring-minimal": (GQA, dict(cp=2, tp=4, cp_attention="ring", remat="minimal")),
    "cp2xtp4-ring-full": (GQA, dict(cp=2, tp=4, cp_attention="ring", remat="full")),
    "cp2xtp4-sp-allgather-full": (MODEL, dict(cp=2, tp=4, sp=True, remat="full")),
    "dp2xcp2xtp2-sp-fsdp-2slices": (MODEL, dict(dp=2, cp=2, tp=2, sp=True, fsdp=True,
                                                microbatches=2, cp_attention="ring")),
    "dp2xcp2xtp2-loss-chunks": (MODEL, dict(dp=2, cp=2, tp=2, loss_chunk=16)),
}


@functools.cache
def ledger_case(name, impl):
    model, kw = LEDGER[name]
    cfg = cfg_of(model, impl=impl, **kw)
    mesh = Layout.of(cfg).mesh()
    step = compile_train_step(abstract_train_state(cfg, mesh), 8, model.seq_len)
    return cfg, dict(mesh.shape), hlo.collectives(step.as_text())


@pytest.mark.parametrize("name", LEDGER)
@pytest.mark.parametrize("impl", ["gspmd", "shard_map", "explicit"])
def test_the_compiled_step_holds_the_cp_ledger(impl, name):
    cfg, mesh, colls = ledger_case(name, impl)
    assert check(colls, expected_collectives(cfg, impl, "cpu"), mesh) is None


test_the_compiled_step_holds_the_cp_ledger.fast_cases = {"gspmd-cp4xtp2-allgather"}


def _cp(colls, mesh, kind, pass_):
    """(count, elements each) of the cp collectives of one kind and pass."""
    got = [c for c in colls if c.kind == kind and c.pass_ == pass_ and c.axes(mesh) == ("cp",)
           and c.scope == "attention"]
    sizes = {int(np.prod(c.shape)) for c in got}
    return sum(c.count for c in got), sizes


@pytest.mark.parametrize("impl", ["shard_map"])
def test_the_cp_ledger_by_hand(impl):
    """llama-gqa (K=2, H=8), b=8, s=16, L=2. K and V travel as one array of
    2*b*(s/cp)*Kl*H elements per rank (Kl the kv heads a tp rank holds).
    all-gather at cp=4 x tp=2 (Kl = K/tp = 1): 2*8*4*1*8 = 512; per layer
    one all-gather to the whole sequence (2048) forward, one reduce-scatter
    back to 512. ring at cp=2 x tp=4 (K < tp: the one kv head a rank's
    queries use, Kl = 1): 2*8*8*1*8 = 1024; cp-1 = 1 permute per layer
    forward, 1 backward with the hops' chunks kept (minimal), 2 when remat
    'full' runs the forward ring again (Liu et al. 2023)."""
    _, mesh, colls = ledger_case("cp4xtp2-allgather", impl)
    assert _cp(colls, mesh, "all-gather", "forward") == (2, {2048})
    assert _cp(colls, mesh, "reduce-scatter", "backward") == (2, {512})
    assert _cp(colls, mesh, "all-gather", "backward") == (0, set())
    _, mesh, kept = ledger_case("cp2xtp4-ring-minimal", impl)
    _, mesh, full = ledger_case("cp2xtp4-ring-full", impl)
    assert _cp(kept, mesh, "collective-permute", "forward") == (2, {1024})
    assert _cp(kept, mesh, "collective-permute", "backward") == (2, {1024})
    assert _cp(full, mesh, "collective-permute", "backward") == (4, {1024})


test_the_cp_ledger_by_hand.fast_cases = set()


@pytest.mark.parametrize("kw, needle", [
    (dict(cp=3), "valid --cp here: [1, 2, 4, 8]"),  # 16 tokens in 6 chunks
    (dict(cp=8, model=dataclasses.replace(MODEL, seq_len=12)), "valid --cp here: [1, 2, 3, 6]"),
    (dict(cp=16, cp_balance=True), "multiple of 32"),
    (dict(cp=2, tp=4, sp=True, model=dataclasses.replace(MODEL, seq_len=12)), "SP"),
    (dict(cp=2, attention="cudnn"), "model.attention='cudnn' does not run under --cp"),
    (dict(cp=2, tp=2, sp=True, overlap="collective_matmul"), "not built for --cp"),
    (dict(cp=2, cp_attention="ulysses"), "parallel.cp_attention='ulysses'"),
    (dict(cp=0), "parallel.cp=0 must be positive"),
])
def test_bad_cp_layouts_are_refused_with_the_fix(kw, needle):
    model = kw.pop("model", MODEL)
    with pytest.raises(ConfigError) as e:
        cfg_of(model, **kw)
    assert needle in str(e.value)


def test_more_devices_than_exist_is_refused_naming_each_axis():
    with pytest.raises(ValueError, match=r"dp\*cp\*tp = 2\*4\*2 = 16 devices"):
        Layout.make(dp=2, tp=2, cp=4).mesh()


@pytest.mark.slow
@pytest.mark.parametrize("impl, layout", [("gspmd", "parallel.cp=4"),
                                          ("shard_map", "parallel.cp_attention=ring"),
                                          ("gspmd", "parallel.cp=8")])
def test_the_cp_ledger_holds_compiled_for_an_h100(impl, layout):
    """llama-tiny at cp=4 x tp=2 (and cp=8) compiled for 8 H100s: XLA's GPU
    combiner joins the loss mean and the gradients over cp into one
    all-reduce (jaxtp.analysis.backends). (explicit on the GPU: not yet
    budgeted, docs/scale.md.)"""
    import importlib.util

    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("jax_cuda12_plugin is not installed: cannot compile for h100 here")
    from jaxtp.parallel.targets import target_mesh
    from jaxtp.config import apply_overrides, load_config
    from jaxtp.parallel import mesh_for

    over = ["parallel.cp=4", "parallel.tp=2", f"parallel.impl={impl}", "model.attention=blockwise"]
    cfg = validate(apply_overrides(load_config("llama-tiny"), over + [layout] + (
        ["parallel.tp=1"] if layout == "parallel.cp=8" else [])))
    p = cfg.parallel
    mesh = mesh_for(target_mesh("h100", p.dp, p.tp, cp=p.cp), impl)
    step = compile_train_step(abstract_train_state(cfg, mesh), cfg.train.batch_size,
                              cfg.model.seq_len)
    assert check(hlo.collectives(step.as_text()), expected_collectives(cfg, impl, "gpu"),
                 dict(mesh.shape)) is None


@pytest.mark.slow
@pytest.mark.parametrize("impl, strategy", [("gspmd", "ring"), ("explicit", "allgather")])
def test_cp_in_bf16_is_the_fp32_loss_to_a_bf16_rounding(impl, strategy):
    """bf16 compute under cp (dp=1 x cp=2 x tp=4): the loss is one device's
    fp32 loss to within one bf16 rounding, and the gradient points the same
    way (cosine > 0.999). (shard_map's bf16 psums crash XLA's CPU compiler,
    jax 0.10.2: its bf16 cp core is checked compiled for an H100, below.)"""
    loss, grads = loss_and_grads(cfg_of(GQA, impl=impl, cp=2, tp=4, cp_attention=strategy,
                                        dtype="bfloat16"))
    ref_loss, ref = one_device(GQA)
    np.testing.assert_allclose(loss, ref_loss, rtol=2**-8)
    assert loss != ref_loss  # bf16 did run
    a = np.concatenate([grads[k].ravel() for k in sorted(ref)])
    b = np.concatenate([ref[k].ravel() for k in sorted(ref)])
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


@pytest.mark.slow
def test_the_cp_core_travels_in_bf16_compiled_for_an_h100():
    """llama-tiny in bf16 at cp=4 x tp=2 (shard_map) for 8 H100s: the K/V
    chunks and their gradients cross cp in bf16, in the ledger's counts
    (ring: 3 hops x 4 layers each way; allgather: 4 gathers, 4 scatters)."""
    import importlib.util

    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("jax_cuda12_plugin is not installed: cannot compile for h100 here")
    from jaxtp.parallel.targets import target_mesh
    from jaxtp.config import apply_overrides, load_config
    from jaxtp.parallel import mesh_for

    mesh = mesh_for(target_mesh("h100", 1, 2, cp=4), "shard_map")
    want = {"ring": {("collective-permute", "forward"): 12, ("collective-permute", "backward"): 12},
            "allgather": {("all-gather", "forward"): 4, ("reduce-scatter", "backward"): 4}}
    for strategy, counts in want.items():
        cfg = validate(apply_overrides(load_config("llama-tiny"), [
            "parallel.cp=4", "parallel.tp=2", f"parallel.cp_attention={strategy}",
            "model.attention=blockwise", "parallel.impl=shard_map", "model.dtype=bfloat16"]))
        step = compile_train_step(abstract_train_state(cfg, mesh), 16, 128)
        core = [c for c in hlo.collectives(step.as_text()) if c.scope == "attention"
                and c.kind != "all-reduce" and c.axes(dict(mesh.shape)) == ("cp",)]
        assert {c.dtype for c in core} == {"bf16"}
        got = {}
        for c in core:
            got[(c.kind, c.pass_)] = got.get((c.kind, c.pass_), 0) + c.count
        assert got == counts
