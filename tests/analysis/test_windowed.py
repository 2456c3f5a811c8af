"""XLA's windowed einsum: the loops read out of HLO text, the cap a compile
logs, the report's reasons, and the compile-only proof past the CPU
threshold (a 2-block Llama under explicit; GPT-2 under gspmd is the quick
bench's windowed section, tests/bench/test_suite.py)."""

import pytest

from jaxtp import hlo
from jaxtp.analysis import windowed
from jaxtp.parallel import make_mesh, mesh_for
from jaxtp.parallel.xla_overlap import Forms
from jaxtp.train.step import compiled_step

# a scanned body (trip count 3) holding an all-gather loop (XLA's CPU names)
# and the entry holding a reduce-scatter loop (XLA's GPU names)
HLO = """HloModule m, num_partitions=2

%wide.windowed_dot_general_body_ag.clone (p: (f32[2])) -> (f32[2]) {
  %p = (f32[2]) parameter(0)
  ROOT %t = (f32[2]) tuple(%p)
}

%body (p: (f32[2])) -> (f32[2]) {
  %p = (f32[2]) parameter(0)
  ROOT %w = (f32[2]) while(%p), condition=%cond, body=%wide.windowed_dot_general_body_ag.clone, metadata={op_name="jit(step)/jvp(mlp)/dot_general"}
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %a = f32[2] parameter(0)
  %s = (f32[2]) while(%a), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %r = (f32[2]) while(%a), condition=%c2, body=%unrolled_windowed_dot_general_body_rs.1, metadata={op_name="jit(step)/transpose(jvp(attention))/jvp(attention)/checkpoint/dot_general"}
  ROOT %o = f32[2] get-tuple-element(%s), index=0
}
"""


def test_loops_are_read_per_kind_pass_and_scope_and_counted_per_trip():
    assert hlo.windowed_loops(HLO) == {("all-gather", "forward", "mlp"): 3,
                                       ("reduce-scatter", "backward", "attention"): 1}


def test_the_cpu_compile_logs_its_iteration_cap():
    assert windowed.logged_cap("cpu") == 32


def test_the_report_says_why_no_loop_formed_or_which_did():
    why = Forms(False, False, "the reason")
    assert windowed.report("gspmd", "gpu", why, {}) == [
        "gspmd on gpu: no windowed-einsum loop: the reason"]
    (line,) = windowed.report("explicit", "cpu", why, {("all-gather", "forward", "mlp"): 2,
                                                        ("reduce-scatter", "forward", "mlp"): 2})
    assert line.startswith("explicit on cpu: XLA's windowed einsum formed 4 loops (mlp forward "
                           "2 all-gather, mlp forward 2 reduce-scatter)")


@pytest.mark.slow
def test_every_budgeted_loop_forms_past_the_cpu_threshold():
    """A 2-block Llama (GQA, kv heads split over tp) at 8 x 2^20 tokens of
    8192 in bf16, compile-only under explicit: per block and region one
    all-gather loop at the entry and one reduce-scatter loop at the exit
    forward; backward dX's reduce-scatter loop and the all-gather loop of x
    for dW; the LM head likewise: 19 loops, each tp chunks of the activation,
    every collective as budgeted, and outside the loops only what cannot be
    one (the output gradients read by two dots, the embedding's gather)."""
    cfg = windowed.proof_config("llama", "explicit")
    r = windowed.prove(cfg, mesh_for(make_mesh(1, 8), "explicit"), log=lambda _: None,
                       compile_step=compiled_step)
    assert r["budget"] == "matches" and r["ok"], r
    assert r["loops"] == r["loops_budgeted"] == {
        **{f"{k} {p} {s}": 2 for k in ("all-gather", "reduce-scatter")
           for p in ("forward", "backward") for s in ("attention", "mlp")},
        "all-gather forward cross_entropy": 1, "all-gather backward cross_entropy": 1,
        "reduce-scatter backward cross_entropy": 1}
    assert r["loop_elements_over_activation"] == {"collective-permute": 1.0}
    assert set(r["activation_sized_outside_loops"]) == {
        "all-gather backward attention", "all-gather backward mlp", "all-gather backward embed",
        "all-reduce forward embed"}
