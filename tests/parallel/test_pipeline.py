"""Pipeline parallelism (jaxtp.parallel.pipeline): each layout's one compiled
train step computes one device's loss and gradients, and its collectives
on the pp axis are the pp ledger's (jaxtp.analysis.pp), counted by hand."""

import dataclasses
from collections import Counter
import functools
import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtp import hlo
from jaxtp.groups import hops_on
from jaxtp.analysis.budget import expected_collectives
from jaxtp.analysis.pp import block_flops, bubble, cells, compiled_ticks, expected_pp, picture
from jaxtp.analysis.rows import check as check_rows
from jaxtp.analysis.rows import per_step, schedule_of
from jaxtp.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig, validate
from jaxtp.model import stack_layers
from jaxtp.parallel import Layout
from jaxtp.parallel.pipeline_table import (decode, in_flight, phases, reading, slots,
                                          table as f1b_table, weights)
from jaxtp.train.data import to_mesh
from jaxtp.train.state import abstract_train_state, place_params
from jaxtp.train.step import compile_train_step, cross_entropy_of
from cached import (assert_same, initial_values, loss_and_grads, stacked_grads,
                    step_loss_and_grads)

# 8 layers, so that pp = 2, 4 and 8 each hold whole layers
MODEL = ModelConfig(n_layers=8, d_model=32, n_heads=4, d_ff=64, seq_len=16)
GQA = dataclasses.replace(MODEL, style="llama", n_kv_heads=2, use_bias=False,
                          tie_embeddings=False)
B = 64  # pp * dp * M divides it at pp = 8, M = 8
TOKENS = np.random.default_rng(0).integers(0, 256, (B, MODEL.seq_len + 1)).astype(np.int32)


def cfg_of(model, pp, tp=1, dp=1, microbatches=None, **kw):
    par = {k: kw.pop(k) for k in ("impl", "sp", "fsdp", "cp", "cp_attention", "pp_stash")
           if k in kw}
    if "schedule" in kw:
        par["pp_schedule"] = kw.pop("schedule")
    if "repeats" in kw:
        par["pp_repeats"] = kw.pop("repeats")
    return validate(Config(dataclasses.replace(model, **kw),
                           TrainConfig(batch_size=B, microbatches=microbatches or 2 * pp),
                           ParallelConfig(pp=pp, dp=dp, tp=tp, **par)))


@functools.cache
def one_device(model):
    """One batch's loss and gradients on one device, unpipelined, stacked
    like the pipeline's."""
    loss, grads = loss_and_grads(cfg_of(model, 1, microbatches=1), TOKENS)
    return loss, stacked_grads(grads)


@functools.cache
def pp_step(model, pp, tp, dp=1, **kw):
    """(cfg, its train step compiled): one program per layout, read by the
    ledger case and run by the parity case."""
    cfg = cfg_of(model, pp, tp, dp, **kw)
    layout = Layout.of(cfg)
    return cfg, compile_train_step(abstract_train_state(cfg, layout.mesh()), B, model.seq_len)


# (model, pp, tp, dp, options)
LAYOUTS = {
    "gpt2-pp2xtp4": (MODEL, 2, 4, 1, {}),
    "llama-gqa-pp2xtp4-shard_map": (GQA, 2, 4, 1, {"impl": "shard_map"}),
    "gpt2-pp4xtp2": (MODEL, 4, 2, 1, {}),
    "gpt2-pp8": (MODEL, 8, 1, 1, {"microbatches": 8}),
    # one row per microbatch: M = B/dp
    "gpt2-dp2xpp2xtp2-M32": (MODEL, 2, 2, 2, {"microbatches": 32}),
    "llama-gqa-dp2xpp2xtp2-fsdp-sp": (GQA, 2, 2, 2, {"fsdp": True, "sp": True}),
    "gpt2-dp2xpp2xtp2-shard_map-sp": (MODEL, 2, 2, 2, {"impl": "shard_map", "sp": True}),
    "llama-gqa-pp2xtp4-scan-minimal": (GQA, 2, 4, 1, {"scan_layers": True,
                                                      "remat": "minimal"}),
    "gpt2-pp4xtp2-shard_map-full-M8": (MODEL, 4, 2, 1, {"impl": "shard_map", "remat": "full",
                                                       "microbatches": 8}),
    # circular: v = 2 chunks per stage; M > p (the ring's output filed, taken
    # up later) and M = p (taken up at once)
    "gpt2-pp2xtp4-circular": (MODEL, 2, 4, 1, {"schedule": "circular", "repeats": 2}),
    "llama-gqa-dp2xpp2xtp2-circular-M2-shard_map": (
        GQA, 2, 2, 2, {"schedule": "circular", "repeats": 2, "microbatches": 2,
                       "impl": "shard_map"}),
    "gpt2-pp4xtp2-circular-M4-sp": (MODEL, 4, 2, 1, {"schedule": "circular", "repeats": 2,
                                                     "microbatches": 4, "sp": True}),
    # 1f1b: the forward and backward of each stage split (jax.vjp), the head
    # in the loop
    "gpt2-pp2xtp4-1f1b": (MODEL, 2, 4, 1, {"schedule": "1f1b"}),
    "llama-gqa-dp2xpp2xtp2-1f1b-fsdp-sp": (GQA, 2, 2, 2, {"schedule": "1f1b", "fsdp": True,
                                                          "sp": True}),
    # (keeping a stage's input alone, its forward run again in the backward)
    "gpt2-pp2xtp4-1f1b-inputs": (MODEL, 2, 4, 1, {"schedule": "1f1b", "pp_stash": "inputs"}),
    "gpt2-pp4xtp2-1f1b-shard_map-M8": (MODEL, 4, 2, 1, {"schedule": "1f1b", "impl": "shard_map",
                                                       "microbatches": 8}),
    # interleaved 1F1B: circular's chunks in 1F1B's order, microbatches in
    # groups of p, the shifts rings; M = p and M = 2p, pp 4 with SP
    "gpt2-pp2xtp4-interleaved": (MODEL, 2, 4, 1, {"schedule": "interleaved", "repeats": 2}),
    "llama-gqa-dp2xpp2xtp2-interleaved-M2-shard_map": (
        GQA, 2, 2, 2, {"schedule": "interleaved", "repeats": 2, "microbatches": 2,
                       "impl": "shard_map"}),
    "gpt2-pp4xtp2-interleaved-M4-sp": (MODEL, 4, 2, 1, {"schedule": "interleaved",
                                                        "repeats": 2, "microbatches": 4,
                                                        "sp": True}),
    # zero-bubble: the backward split into B and W (`jaxtp.parallel.vjp_split`),
    # W where stage 0 runs B; 1F1B's table and the interleaved one; a
    # rematerialised block's backward split inside its recomputation
    "gpt2-pp2xtp4-zb": (MODEL, 2, 4, 1, {"schedule": "zb"}),
    "gpt2-pp2xtp4-zb-v2": (MODEL, 2, 4, 1, {"schedule": "zb", "repeats": 2}),
    "llama-gqa-pp4xtp2-zb-shard_map-M4-minimal": (GQA, 2 * 2, 2, 1, {
        "schedule": "zb", "impl": "shard_map", "microbatches": 4, "remat": "minimal"}),
    "llama-gqa-dp2xpp2xtp2-zb-v2-fsdp-sp-full": (GQA, 2, 2, 2, {
        "schedule": "zb", "repeats": 2, "fsdp": True, "sp": True, "remat": "full"}),
    # cp: each stage's tokens split along T, the pipeline manual over cp too
    # (under gspmd with the ring: `jaxtp.checks`)
    "gpt2-dp2xcp2xpp2-shard_map-fsdp": (MODEL, 2, 1, 2, {"cp": 2, "impl": "shard_map",
                                                         "fsdp": True}),
    "llama-gqa-dp2xcp2xpp2-fsdp-ring": (GQA, 2, 1, 2, {"cp": 2, "fsdp": True,
                                                       "cp_attention": "ring"}),
    "llama-gqa-cp2xpp2xtp2-shard_map-ring-sp": (GQA, 2, 2, 1, {"cp": 2, "impl": "shard_map",
                                                               "cp_attention": "ring",
                                                               "sp": True}),
    "gpt2-cp2xpp2xtp2-circular-ring": (MODEL, 2, 2, 1, {"cp": 2, "cp_attention": "ring",
                                                        "schedule": "circular", "repeats": 2}),
    "llama-gqa-cp2xpp2xtp2-1f1b-sp": (GQA, 2, 2, 1, {"cp": 2, "schedule": "1f1b", "sp": True,
                                                      "cp_attention": "ring"}),
    "gpt2-cp2xpp2xtp2-1f1b-shard_map": (MODEL, 2, 2, 1, {"cp": 2, "schedule": "1f1b",
                                                        "impl": "shard_map"}),
}


def _step(name):
    model, pp, tp, dp, kw = LAYOUTS[name]
    return pp_step(model, pp, tp, dp, **kw)


# neighbouring cases share a worker's compiled program
@pytest.mark.parametrize("check", ["ledger", "one-device"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_pipelined_step_holds_the_pp_ledger_and_one_devices_gradients(name, check):
    """one-device: the step's loss and every gradient (read from its first
    Adam moment) are one device's, unpipelined, at rtol 1e-5. ledger: every
    collective of the step is the budget's (`expected_collectives`: tp's
    per layer and tick, the embedding's and head's once on a stage's rows,
    the gradients' sums, the pp rows), exactly; by hand, the permutes over
    pp (the shifts once per tick, M + p - 1 ticks read from the loop's trip
    count; entry and exit once), and the dp gradient sums once per step,
    outside the pipeline's loop. Circular: v*M + p - 1 ticks of L/(p*v)
    layers, the shift a ring."""
    cfg, step = _step(name)
    if check == "one-device":
        values = initial_values(cfg)  # (a scanned model's come stacked)
        values = values if cfg.model.scan_layers else stack_layers(values)
        # (scanning and remat change no value: one reference per model)
        ref = one_device(dataclasses.replace(cfg.model, scan_layers=False, remat="none"))
        assert_same(step_loss_and_grads(cfg, step, TOKENS, values), ref)
        if schedule_of(cfg).runs_head:  # evaluation: GPipe's forward, the same loss
            mesh = Layout.of(cfg).mesh()
            graphdef, params, _ = place_params(cfg, mesh, values)
            with jax.set_mesh(mesh):
                loss = cross_entropy_of(nnx.merge(graphdef, params), to_mesh(TOKENS, mesh))
            np.testing.assert_allclose(float(loss), ref[0], rtol=1e-5)
        return
    sizes = Layout.of(cfg).sizes
    colls = hlo.collectives(step.as_text())
    assert check_rows(colls, expected_collectives(cfg, cfg.parallel.impl, "cpu"), sizes) is None
    pp = _pipeline_own(colls, sizes)
    assert check_rows(pp, per_step(expected_pp(cfg), schedule_of(cfg)), sizes) is None
    p, M, v = cfg.parallel.pp, cfg.train.microbatches, cfg.parallel.pp_repeats
    f1b = schedule_of(cfg).runs_head
    ticks = v * M + p - 1  # (1F1B's: its forwards, in its fill and steady loops)
    sends = schedule_of(cfg).forward_shifts  # (zb at M = p: ticks - 1)
    assert compiled_ticks(colls, sizes) == sends and sends >= ticks - 1
    # by hand: the forward shift, a microbatch's rows of the stream per dp
    # rank, every tick; the entry and exit, a stage's rows once each
    shift = [c for c in pp if c.kind == "collective-permute" and c.pass_ == "forward"]
    dp, split = cfg.parallel.dp, cfg.parallel.tp if cfg.parallel.sp else 1
    s = MODEL.seq_len // cfg.parallel.cp  # a cp rank's positions
    row = s * MODEL.d_model // split
    if f1b:  # the shifts, +1 in the fill and steady loops, -1 in the steady and
        # drain loops (v*M + p - 1 trips, one fewer back: the last tick's goes
        # nowhere; interleaved: rings), in the step's forward program; the
        # entry, the targets' entry and the input gradients' exit once
        trips = Counter()
        for c in shift:
            trips[c.dtype, c.elements, tuple(sorted(hops_on(c.groups, sizes, "pp")))] += c.count
        n_in = B // (p * dp) * row
        on, back = ((1,), (-1,)) if v == 1 else (tuple(sorted({1, 1 - p})),
                                                 tuple(sorted({-1, p - 1})))
        assert trips == Counter({("f32", B // (M * dp) * row, on): sends}) + Counter(
            {("f32", B // (M * dp) * row, back): ticks - 1}) + Counter(
            {("f32", n_in, (-k,)): 1 for k in range(1, p)}) + Counter(
            {("f32", n_in, (k,)): 1 for k in range(1, p)}) + Counter(
            {("s32", B // (p * dp) * s, (p - 1 - k,)): 1 for k in range(p - 1)})
        # the loops: fill (v*p - 1), steady (v(M - p) + p, both ways), drain
        # (v*p - 2: the last tick apart); zb's steady loop in two where W
        # starts (at v*p + p - 2: `phases`)
        loops = sorted(c.count for c in shift if "while" in c.op_name)
        steady = v * (M - p) + p
        if not schedule_of(cfg).split:
            assert loops == sorted([v * p - 1, steady, steady] + [v * p - 2] * (v * p > 2))
        else:  # (steady: p - 1 ticks of F and B, then F, B and W; its last
            # forward's shift dropped where that is a loop of one trip)
            forward = [v * p - 1, p - 1] + [steady - p + 1] * (steady - p + 1 > 1)
            assert sends == ticks - (steady - p + 1 == 1)
            assert loops == sorted(forward + [p - 1, steady - p + 1] + [v * p - 2] * (v * p > 2))
        assert not [c for c in pp if c.pass_ == "backward"]
        return
    assert sorted((c.elements, c.count) for c in shift) == sorted(
        [(B // (M * dp) * row, ticks)] + [(B // (p * dp) * row, 1)] * 2 * (p - 1))
    # a ring under circular (p pairs in each of the devices/p pipelines)
    pairs = p if v > 1 else p - 1
    assert [c.group_size for c in shift if c.count == ticks] == [pairs * Layout.of(cfg).devices // p]
    # the blocks' collectives run per layer and tick, nothing else inside the loop
    layers = MODEL.n_layers // (p * v)
    assert {c.count for c in colls} <= {1, ticks, ticks * layers}
    if cfg.parallel.dp > 1:  # the stage weights' gradients, reduced over dp (x cp) once
        over_dp = [c for c in colls if c.axes(sizes) in (("dp",), ("dp", "cp"))]
        assert over_dp and {c.count for c in over_dp} == {1}
    # the other weights' gradients (and the loss) are summed over pp x dp, once
    sums = [c for c in colls if c.kind == "all-reduce" and "pp" in c.axes(sizes)]
    assert sums and {c.count for c in sums} == {1}


def _pipeline_own(colls, sizes):
    """The permutes over pp: the pipeline's own (the all-reduces over pp are
    sums of the gradients of the weights outside the pipeline, and the
    loss's: the gradient ledger's)."""
    return [c for c in colls if c.axes(sizes) == ("pp",) and c.kind != "all-reduce"]


test_the_pipelined_step_holds_the_pp_ledger_and_one_devices_gradients.fast_cases = {
    "gpt2-pp2xtp4-ledger", "gpt2-pp2xtp4-one-device"}


def test_the_1f1b_table_runs_each_op_after_what_it_needs_at_gpipes_cost():
    """1F1B's and interleaved 1F1B's table, checked without JAX, at several
    p, M and v: every stage runs each (microbatch, chunk)'s forward and
    backward once, microbatches in order per chunk; a chunk's forward after
    the virtual stage before it ran it (the stage before; stage 0's chunk i
    after the last stage's chunk i - 1), a backward after the virtual stage
    after it ran its own (the last stage's last chunk: in the tick of its
    forward, after it); no stash slot is written again before its backward
    has read it; v*M + (v+1)p - 2 ticks, whose loops (`phases`) compute
    v*M + p - 1 chunk forwards and as many backwards per stage, GPipe's and
    circular's; stage 0 holds v*p + p - 1 ops (2p - 1 at v = 1; v*M when
    fewer), the most of any stage, the stash's slots; the last stage 1 at
    v = 1."""
    cases = [(2, 1, 1), (2, 2, 1), (2, 8, 1), (4, 4, 1), (4, 16, 1), (8, 8, 1), (3, 7, 1),
             (4, 2, 1), (2, 2, 2), (2, 8, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2)]
    for p, M, v in cases:
        fwd, bwd = f1b_table(p, M, v)
        T = v * M + (v + 1) * p - 2
        fslot, bslot, S = slots(fwd, bwd)
        assert fwd.shape == bwd.shape == (T, p)
        runs = [(f, b) for begin, end, f, b, _ in phases(p, M, v) for _ in range(begin, end)]
        assert len(runs) == T
        assert sum(f for f, _ in runs) == sum(b for _, b in runs) == v * M + p - 1
        at_f = {(r, n): t for r in range(p) for t, n in enumerate(fwd[:, r]) if n >= 0}
        at_b = {(r, n): t for r in range(p) for t, n in enumerate(bwd[:, r]) if n >= 0}
        ops = {(r, n) for r in range(p) for n in range(v * M)}
        assert set(at_f) == set(at_b) == ops and len(at_f) == len(ops)  # each once
        assert all(runs[t][0] for t in at_f.values()) and all(runs[t][1] for t in at_b.values())
        chunk = {n: decode(n, p, v) for n in range(v * M)}  # (microbatch, chunk)
        index = {mi: n for n, mi in chunk.items()}
        assert sorted(chunk.values()) == [(m, i) for m in range(M) for i in range(v)]
        for (r, n), t in at_f.items():
            m, i = chunk[n]
            if r:
                assert t > at_f[r - 1, n]
            elif i:
                assert t > at_f[p - 1, index[m, i - 1]]
            if r < p - 1:
                assert at_b[r, n] > at_b[r + 1, n]
            elif i < v - 1:
                assert at_b[r, n] > at_b[0, index[m, i + 1]]
            else:
                assert at_b[r, n] == t  # (the tick runs its forward first)
            # its backward reads its slot, not written again before that
            j = fslot[t, r]
            assert 0 <= j < S and bslot[at_b[r, n], r] == j
            assert not [k for k in range(v * M) if k != n and fslot[at_f[r, k], r] == j
                        and t < at_f[r, k] <= at_b[r, n]]
        assert in_flight(fwd, bwd) == S == min(v * M, v * p + p - 1)
        assert v > 1 or in_flight(fwd, bwd, p - 1) == 1


def test_the_zb_table_runs_each_w_after_its_b_and_never_on_dropped_data():
    """Without JAX: zb's weight gradients (`weights`) run once per op and
    stage, on every stage in the tick stage 0 runs that op's B (so after
    the stage's own B: r ticks after it on stage r); every tick of the
    loops that run W runs a real one on every stage (v*M of them: none on
    dropped data), and the forwards and input gradients stay 1F1B's (v*M +
    p - 1 ticks each). The forward's stash slot is read by B and freed by
    W, never written between; W's own stash (what B hands W) holds an op
    from its B to its W: r + 1 ops on stage r, p slots."""
    for p, M, v in [(2, 2, 1), (2, 8, 1), (4, 4, 1), (3, 7, 1), (4, 8, 2), (2, 4, 3)]:
        fwd, bwd = f1b_table(p, M, v)
        wgt = weights(bwd)
        runs = [k for b, e, *k in phases(p, M, v, split=True) for _ in range(b, e)]
        assert len(runs) == len(fwd)
        assert [sum(k[j] for k in runs) for j in range(3)] == [v * M + p - 1] * 2 + [v * M]
        fslot, wslot, S = slots(fwd, wgt)
        bslot, vslot, S_W = slots(bwd, wgt)
        read = reading(fwd, fslot, bwd)
        assert S == in_flight(fwd, bwd) and S_W == min(p, v * M)
        for r in range(p):
            at = lambda table: {n: t for t, n in enumerate(table[:, r]) if n >= 0}
            f_at, b_at, w_at = at(fwd), at(bwd), at(wgt)
            assert sorted(w_at) == list(range(v * M)) == sorted(b_at)
            for n, t in w_at.items():
                assert t == b_at[n] + r and runs[t][2]
                j = fslot[f_at[n], r]
                assert read[b_at[n], r] == j == wslot[t, r]
                assert not [k for k in f_at if k != n and fslot[f_at[k], r] == j
                            and f_at[n] < f_at[k] <= t]
                assert vslot[t, r] == bslot[b_at[n], r] and not [
                    k for k in b_at if k != n and bslot[b_at[k], r] == vslot[t, r]
                    and b_at[n] < b_at[k] <= t]
        assert all((wgt[t] >= 0).all() for t in range(len(fwd)) if runs[t][2])


@pytest.mark.slow
def test_1f1b_holds_2p_minus_1_microbatches_where_gpipe_holds_m():
    """The compiled step's temporaries at p = 2, B fixed, M = 4 and 8:
    GPipe's autodiff keeps every tick's residuals (M + p - 1 ticks of B/M
    rows: 5/4 of the batch's, then 9/8), 1F1B's stash 2p - 1 microbatches'
    (3/4, then 3/8): below GPipe's at M = 8, and falling faster with M
    (measured: 6.6 against 3.5 MB at M = 8; under remat full 2.1 against
    1.2, docs/scale.md); zb's between them, its W's inputs held N ticks
    more. M = 4: the ledger cases' own programs."""
    temp = lambda step: step.memory_analysis().temp_size_in_bytes
    gp = {4: temp(_step("gpt2-pp2xtp4")[1]), 8: temp(pp_step(MODEL, 2, 4, 1, microbatches=8)[1])}
    f1 = {4: temp(_step("gpt2-pp2xtp4-1f1b")[1]),
          8: temp(pp_step(MODEL, 2, 4, 1, schedule="1f1b", microbatches=8)[1])}
    assert f1[8] < gp[8] and f1[8] / f1[4] < gp[8] / gp[4]
    # zb: 1F1B's stash and what B hands W (N slots): between the two (5.9 MB)
    zb = temp(pp_step(MODEL, 2, 4, 1, schedule="zb", microbatches=8)[1])
    assert f1[8] < zb < gp[8]


@pytest.mark.slow
def test_each_schedule_computes_its_formulas_block_flops():
    """The blocks' matmul FLOPs read from each compiled step (`hlo.dots`, at
    the loops' trip counts), pp 2 x tp 4, M = 4: 1F1B's equal GPipe's in
    both passes (each (M + p - 1) ticks of a forward and a backward);
    keeping its inputs alone, its forward twice; interleaved's equal
    circular's ((v*M + p - 1) ticks of 1/v of the layers), and circular's
    are GPipe's x (v*M + p - 1)/(v(M + p - 1)) = 9/10. zb: 1F1B's forward;
    its backward's W (weight gradients) at M ticks (v*M over 2 chunks), the
    rest (B) at 1F1B's (circular's), so that the two at 1F1B's ticks are
    1F1B's backward."""
    flops = {name: block_flops(_step(name)[1].as_text()) for name in (
        "gpt2-pp2xtp4", "gpt2-pp2xtp4-1f1b", "gpt2-pp2xtp4-1f1b-inputs",
        "gpt2-pp2xtp4-circular", "gpt2-pp2xtp4-interleaved", "gpt2-pp2xtp4-zb",
        "gpt2-pp2xtp4-zb-v2")}
    gpipe = flops["gpt2-pp2xtp4"]
    assert gpipe["forward"] > 0 and gpipe["backward"] > 2 * gpipe["forward"] - 1
    assert gpipe["weights"] == 0
    assert flops["gpt2-pp2xtp4-1f1b"] == gpipe
    assert flops["gpt2-pp2xtp4-1f1b-inputs"] == {"forward": 2 * gpipe["forward"],
                                                  "backward": gpipe["backward"], "weights": 0}
    assert flops["gpt2-pp2xtp4-interleaved"] == flops["gpt2-pp2xtp4-circular"]
    for k in gpipe:
        assert flops["gpt2-pp2xtp4-circular"][k] * 10 == gpipe[k] * 9
    M, p = 4, 2
    for zb, like in (("gpt2-pp2xtp4-zb", gpipe), ("gpt2-pp2xtp4-zb-v2",
                                                  flops["gpt2-pp2xtp4-circular"])):
        f, v = flops[zb], 1 + zb.endswith("v2")
        ticks = v * M + p - 1
        assert f["forward"] == like["forward"] and 0 < f["weights"] < f["backward"]
        assert (f["backward"] - f["weights"]) + f["weights"] * ticks // (v * M) \
            == like["backward"]
        assert f["weights"] * ticks % (v * M) == 0


def test_the_ledger_catches_a_wrong_tick_count():
    """The ledger's rows are exact: one tick too many (a schedule's M + p,
    not M + p - 1) or a shift of a whole batch instead of a microbatch fails."""
    cfg, step = _step("gpt2-pp2xtp4")
    sizes = Layout.of(cfg).sizes
    pp = _pipeline_own(hlo.collectives(step.as_text()), sizes)
    rows = per_step(expected_pp(cfg), schedule_of(cfg))
    more = [dataclasses.replace(r, count=r.count + 1) if r.kind == "collective-permute" else r
            for r in rows]
    assert check_rows(pp, more, sizes) is not None
    whole = [dataclasses.replace(r, elements=r.elements * cfg.train.microbatches)
             if r.kind == "collective-permute" else r for r in rows]
    assert check_rows(pp, whole, sizes) is not None


def test_the_schedule_picture_has_each_microbatch_once_per_pass_and_the_bubble():
    """GPipe at p=4, M=8 as the loop runs it: each stage runs every
    microbatch's forward once, in order, then every backward in reverse;
    p - 1 bubble ticks per pass; stage r's forward of m at tick m + r."""
    p, M = 4, 8
    grid = cells(p, M)
    for r, row in enumerate(grid):
        F = [c for c in row if c.startswith("F")]
        B = [c for c in row if c.startswith("B")]
        assert F == [f"F{m}" for m in range(M)] and B == [f"B{m}" for m in reversed(range(M))]
        assert row.count("") == 2 * (p - 1)
        assert row[r + 3] == "F3"
    assert picture(p, M).count('data-op="bubble"') == 2 * p * (p - 1)


def test_the_circular_picture_runs_each_chunk_after_the_one_before():
    """Circular at p=2, M=4, v=2: each stage runs every microbatch's chunk 0
    then every chunk 1, forward in order and backward in reverse; chunk
    i+1 of a microbatch starts on stage 0 after chunk i left the last stage
    (M >= p), and stage r runs it the tick after stage r-1; p - 1 bubble
    ticks per pass, (p-1)/(v*M+p-1) of them."""
    p, M, v = 2, 4, 2
    grid = cells(p, M, v)
    order = [f"F{m}:{i}" for i in range(v) for m in range(M)]
    at = {}
    for r, row in enumerate(grid):
        assert [c for c in row if c.startswith("F")] == order
        assert [c for c in row if c.startswith("B")] == [c.replace("F", "B")
                                                         for c in reversed(order)]
        assert row.count("") == 2 * (p - 1)
        at.update({(r, c): t for t, c in enumerate(row) if c.startswith("F")})
    for m in range(M):
        for i in range(v):
            for r in range(1, p):
                assert at[r, f"F{m}:{i}"] == at[r - 1, f"F{m}:{i}"] + 1
            if i:
                assert at[0, f"F{m}:{i}"] > at[p - 1, f"F{m}:{i - 1}"]
    svg = picture(p, M, "circular", v)
    assert svg.count('data-op="bubble"') == 2 * p * (p - 1) and "2 chunks each" in svg
    assert f"bubble {bubble(p, M, v):.1%}" in svg


def test_the_1f1b_picture_draws_its_table_and_what_each_loop_computes():
    """The picture's cells are the table's ("F3/B1": a tick's forward of
    microbatch 3 and backward of 1), a tick's forward above its backward;
    grey where the tick's loop computes a kind the stage drops, white where
    the loop does not compute that kind at all (the fill's backwards, the
    drain's forwards). Interleaved: each cell names its chunk ("F3:1"). zb:
    a third row, the weight gradients, "F3/B1/W0", none dropped."""
    for p, M, v, schedule in ((4, 8, 1, "1f1b"), (2, 4, 2, "interleaved"), (4, 8, 2, "zb")):
        grid = cells(p, M, v, schedule)
        fwd, bwd = f1b_table(p, M, v)
        split = schedule == "zb"
        name = lambda kind, n: f"{kind}{decode(n, p, v)[0]}" + (
            f":{decode(n, p, v)[1]}" if v > 1 else "")
        T = v * M + (v + 1) * p - 2
        for r, row in enumerate(grid):
            assert len(row) == T
            for t, cell in enumerate(row):
                w = bwd[t, 0]  # (zb: W where stage 0 runs B)
                assert cell == "/".join([name("F", fwd[t, r])] * int(fwd[t, r] >= 0)
                                        + [name("B", bwd[t, r])] * int(bwd[t, r] >= 0)
                                        + [name("W", w)] * int(split and w >= 0))
        svg = picture(p, M, schedule, v)
        ops = re.findall(r'data-stage="(\d+)" data-tick="(\d+)" data-op="([^"]+)"', svg)
        assert len(ops) == (2 + split) * p * T
        # per stage: v*M forwards, v*M backwards; p - 1 dropped of each kind;
        # the fill's v*p - 1 backwards and the drain's forwards not computed;
        # zb's v*M weight gradients, none dropped, none in the (v+1)p - 2 others
        for r in range(p):
            mine = [op for stage, _, op in ops if int(stage) == r]
            assert sum(o[0] == "F" for o in mine) == sum(o[0] == "B" for o in mine) == v * M
            assert sum(o[0] == "W" for o in mine) == split * v * M
            assert mine.count("bubble") == 2 * (p - 1)
            assert mine.count("none") == 2 * (v * p - 1) + split * ((v + 1) * p - 2)
        assert ("an input gradient and a weight gradient" if split else
                "a forward (top) and a backward (bottom)") in svg


def test_bubble():
    """(p-1)/(v*M + p - 1): GPipe's p=4, M=8 idles 3 of 11 ticks; 4 repeats
    at M=8 leave 3 of 35."""
    assert bubble(4, 8) == pytest.approx(3 / 11)
    assert bubble(4, 8, 4) == pytest.approx(3 / 35)
    assert bubble(1, 8) == 0


@pytest.mark.parametrize("over, fix", [
    ({"pp": 3}, "valid --pp here: [2, 4, 8]"),
    ({"pp": 2, "microbatches": 1}, "--microbatches 4"),
    ({"pp": 2, "impl": "explicit"}, "--impl explicit"),
    ({"pp": 2, "dropout": 0.1}, "model.dropout"),
    ({"pp": 2, "cp": 2}, "parallel.cp_attention=ring"),
    ({"pp": 2, "attention": "cudnn"}, "use model.attention=blockwise"),
    ({"pp": 2, "microbatches": 3}, "set train.batch_size to a multiple of 6"),
    ({"pp": 2, "schedule": "circular"}, "interleaved schedules run v >= 2 chunks"),
    ({"pp": 2, "schedule": "interleaved"}, "parallel.pp_repeats=2 with circular or interleaved"),
    ({"pp": 2, "repeats": 2}, "parallel.pp_repeats=1 with gpipe"),
    ({"pp": 2, "pp_stash": "inputs"}, "use --pp-schedule 1f1b"),
    (None, None),
    ({"pp": 4, "schedule": "circular", "repeats": 4}, "valid --pp here: [2]"),
])
def test_refusals_name_the_fix(over, fix):
    """A pipeline config the schedules cannot run is refused with the fix
    (an interleaved one's microbatches not in groups of pp: `validate` at a
    batch of 6, M = 3)."""
    if over is None:
        with pytest.raises(ConfigError, match="in groups of pp=2 .* --microbatches 2"):
            validate(Config(MODEL, TrainConfig(batch_size=6, microbatches=3), ParallelConfig(
                pp=2, pp_schedule="interleaved", pp_repeats=2)))
        return
    kw = dict(over)
    pp = kw.pop("pp")
    with pytest.raises(ConfigError, match=fix.replace("[", r"\[").replace("]", r"\]")
                       .replace(".", r"\.")):
        cfg_of(MODEL, pp, **kw)
