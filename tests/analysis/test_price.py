"""The op-by-op step price (`jaxtp.analysis.price`) on hand-written HLO,
whose every op's cost the test states; the published constants where
their class says; the program's flops against XLA's and across a scan."""

from __future__ import annotations

import pytest

from jaxtp.analysis.cluster import H100, PRESETS
from jaxtp.analysis.price import (CALCULON_TIERS, Costs, Curve, NCCL_NVLINK_FRACTION,
                                  accelerator_costs, price)
from jaxtp.hlo_ops import flops, program

MATMUL, MEMORY, WIRE = 1e12, 1e11, 1.31072e10  # FLOP/s, B/s, all-reduce B/s
COSTS = Costs("hand", Curve(((1.0, MATMUL),)), {}, Curve(((1.0, MEMORY),)),
              collectives={"all-reduce/2": Curve(((1.0, WIRE),))})


def module(between: str = "%f", trip: int = 3) -> str:
    """A dot, an async all-reduce of its result with `between` scheduled
    inside it (the fusion or nothing), and a while loop of `trip` dots."""
    f = "  %f = f32[64,256]{1,0} fusion(%d, %y), kind=kLoop, calls=%fused_scale\n"
    return f"""HloModule m, is_scheduled=true, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%fused_scale (p0: f32[64,256], p1: f32[1024,256]) -> f32[64,256] {{
  %p0 = f32[64,256]{{1,0}} parameter(0)
  %p1 = f32[1024,256]{{1,0}} parameter(1)
  %sl = f32[64,256]{{1,0}} slice(%p1), slice={{[0:64], [0:256]}}
  ROOT %m = f32[64,256]{{1,0}} multiply(%p0, %sl)
}}

%cond (t: (s32[], f32[64,64])) -> pred[] {{
  %t = (s32[], f32[64,64]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant({trip})
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%body (t: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {{
  %t = (s32[], f32[64,64]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[64,64]{{1,0}} get-tuple-element(%t), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %xx = f32[64,64]{{1,0}} dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %r = (s32[], f32[64,64]{{1,0}}) tuple(%j, %xx)
}}

ENTRY %main (x: f32[64,128], w: f32[128,256], y: f32[1024,256], v: f32[64,64]) -> f32[64,256] {{
  %x = f32[64,128]{{1,0}} parameter(0)
  %w = f32[128,256]{{1,0}} parameter(1)
  %y = f32[1024,256]{{1,0}} parameter(2)
  %v = f32[64,64]{{1,0}} parameter(3)
  %zero = s32[] constant(0)
  %d = f32[64,256]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %ars = f32[64,256]{{1,0}} all-reduce-start(%d), replica_groups={{{{0,1}}}}, to_apply=%add
{f if between == "%f" else ""}  %ard = f32[64,256]{{1,0}} all-reduce-done(%ars)
{"" if between == "%f" else f}  %init = (s32[], f32[64,64]{{1,0}}) tuple(%zero, %v)
  %loop = (s32[], f32[64,64]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{trip}"}}}}
  ROOT %out = f32[64,256]{{1,0}} add(%ard, %f)
}}
"""


# each op's time by hand: a matmul is the longer of flops / MATMUL and bytes / MEMORY
DOT = max(2 * 64 * 256 * 128 / MATMUL, 4 * (64 * 256 + 64 * 128 + 128 * 256) / MEMORY)
FUSION = 4 * (64 * 256 + 64 * 256 + 64 * 256) / MEMORY  # out, %d, the slice of %y (not all of it)
ALL_REDUCE = 4 * 64 * 256 / WIRE  # 5 us
BODY = max(2 * 64 ** 3 / MATMUL, 4 * 3 * 64 * 64 / MEMORY) + 3 * 4 / MEMORY  # dot, s32 add
COND = (4 + 4 + 1) / MEMORY  # compare: two s32 in, a pred out
OUT = 3 * 4 * 64 * 256 / MEMORY  # the root add


def test_a_hand_built_program_costs_the_sum_of_its_ops():
    p = price(module(), COSTS)
    exposed = ALL_REDUCE - FUSION  # the fusion runs while the all-reduce does
    assert p["step_s"] == pytest.approx(DOT + FUSION + exposed + 3 * (BODY + COND) + OUT)
    assert p["comm_s"] == pytest.approx(ALL_REDUCE)
    assert p["exposed_s"] == pytest.approx(exposed)
    assert p["flops"] == pytest.approx(2 * 64 * 256 * 128 + 64 * 256 + 3 * (2 * 64 ** 3 + 1 + 1)
                                       + 64 * 256)


@pytest.mark.parametrize("cover, exposed", [(2.0, 0.0), (0.5, 0.5), (0.0, 1.0)],
                         ids=["covered", "half", "not-covered"])
def test_a_collective_is_charged_only_where_compute_does_not_cover_it(cover, exposed):
    """The fusion scheduled between start and done takes `cover` of the
    all-reduce's time (the memory rate set so): its exposed share is what is left."""
    memory = FUSION * MEMORY / (cover * ALL_REDUCE) if cover else MEMORY
    costs = Costs("hand", COSTS.matmul, {}, Curve(((1.0, memory),)),
                  collectives=COSTS.collectives)
    p = price(module("%f" if cover else ""), costs)
    assert p["exposed_s"] == pytest.approx(exposed * ALL_REDUCE)
    line = next(ln for ln in p["lines"] if ln.cls == "all-reduce")
    assert line.seconds == pytest.approx(ALL_REDUCE) and line.exposed == pytest.approx(
        exposed * ALL_REDUCE)


def test_a_loop_runs_its_trip_count():
    three, six = price(module(trip=3), COSTS), price(module(trip=6), COSTS)
    assert six["step_s"] - three["step_s"] == pytest.approx(3 * (BODY + COND))
    body = next(ln for ln in six["lines"] if ln.name == "xx")
    assert body.count == 6 and body.flops == 6 * 2 * 64 ** 3
    comps, entry = program(module(trip=6))
    assert next(o for o in comps[entry] if o.cls == "loop").trip == 6


def test_each_published_constant_prices_its_class():
    c = accelerator_costs(H100)
    # Calculon's tiers of the bf16 peak, capped at H100's MAMF fraction (792.1 / 989)
    assert [c.matmul(f) for f in (0.5e9, 2e9, 20e9, 200e9)] == pytest.approx(
        [0.1 * 989e12, 0.6 * 989e12, 792.1e12, 792.1e12])
    assert [e for _, e in CALCULON_TIERS] == [0.1, 0.6, 0.9, 0.95]
    assert c.dtypes["f32"] == 0.5 and c.dtypes["bf16"] == 1.0  # TF32 is half bf16's peak
    assert c.attention(8192) == pytest.approx(600e12)  # cuDNN, FA3 paper, head dim 128
    assert c.attention(1024) == pytest.approx(574e12)
    assert c.memory(1e6) == pytest.approx(2.8e12)
    assert c.overhead == 2e-6
    # an all-reduce over 8 GPUs on NVLink at 370 of 450 GB/s, 20 us of latency
    text = module().replace("replica_groups={{0,1}}", "replica_groups={{0,1,2,3,4,5,6,7}}")
    p = price(text.replace("num_partitions=2", "num_partitions=8"), c, {"tp": 8},
              PRESETS["h100x8"])
    ar = next(ln for ln in p["lines"] if ln.cls == "all-reduce")
    assert ar.axes == "tp"
    assert ar.seconds == pytest.approx(20e-6 + 4 * 64 * 256 * 2 * 7 / 8 / (450e9 *
                                                                         NCCL_NVLINK_FRACTION))


def test_the_attention_kernel_is_priced_by_its_flops_and_sequence():
    """A cuDNN attention call as XLA:GPU writes it: 4 B H Sq Sk D flops,
    halved under a causal mask, x 2.5 for the backward."""
    args = ('{"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": '
            '"BF16", "dimensions": ["2", "4", "1024", "1024"]}, "mask_type": "CAUSAL"}}')
    text = f"""HloModule m, is_scheduled=true

ENTRY %main (q: bf16[2,1024,4,64]) -> (bf16[2,4,1024,64], f32[2,4,1024]) {{
  %q = bf16[2,1024,4,64]{{3,2,1,0}} parameter(0)
  ROOT %a = (bf16[2,4,1024,64]{{3,2,1,0}}, f32[2,4,1024]{{2,1,0}}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={args}
}}
"""
    c = accelerator_costs(H100)
    op = program(text)[0]["main"][-1]
    assert op.cls == "attention" and op.seq == 1024
    assert op.flops == 4 * 2 * 4 * 1024 * 1024 * 64 / 2
    p = price(text, c)
    assert p["step_s"] == pytest.approx(2e-6 + max(op.flops / 574e12, op.bytes / 2.8e12))
    back = program(text.replace("fmhaSoftmax", "fmhaSoftmaxBackward"))[0]["main"][-1]
    assert back.flops == 2.5 * op.flops


@pytest.mark.slow
def test_the_program_flops_count_a_scanned_stack_as_its_layers():
    """XLA's cost analysis reads a loop's body once; the op count runs it
    its trip count. The scanned step's flops are the unrolled one's within
    3%: its backward computes the attention scores again (a 1.8% larger
    matmul count, read off the two programs by op name) and stacks and
    slices. The unrolled one's are XLA's own count within 5%."""
    import jax

    from jaxtp.config import apply_overrides, load_config
    from jaxtp.parallel import Layout
    from jaxtp.train.step import compiled_step

    out = {}
    for scan in (False, True):
        cfg = apply_overrides(load_config("tiny"), [f"model.scan_layers={str(scan).lower()}"])
        _, c = compiled_step(cfg, Layout.of(cfg).mesh(devices=jax.devices("cpu")[:1]))
        out[scan] = (flops(c.as_text()), c.cost_analysis()["flops"],
                     flops(c.as_text(), ("matmul",)))
    assert 1 < out[True][2] / out[False][2] < 1.02
    assert out[True][0] == pytest.approx(out[False][0], rel=0.03)
    assert out[False][0] == pytest.approx(out[False][1], rel=0.05)
    assert out[True][1] < 0.6 * out[False][1]  # the body read once: 1 of 4 layers
