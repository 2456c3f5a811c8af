"""jaxtp.hlo on hand-written HLO (every form it must read) and on real compiles."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtp import hlo
from jaxtp.parallel import make_mesh

SNIPPET = """HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %v = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %ar-start = f32[4,8]{1,0} all-reduce-start(%v), channel_id=5, replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="jit(step)/while/body/jvp(mlp)/dot_general"}
  %ar-done = f32[4,8]{1,0} all-reduce-done(%ar-start)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %ar-done)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[16,32], b: bf16[2,8]) -> f32[16,32] {
  %a = f32[16,32]{1,0} parameter(0)
  %b = bf16[2,8]{1,0} parameter(1)
  %all-reduce = f32[16,32]{1,0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(attention))/dot_general"}
  %all-gather = bf16[16,8]{1,0} all-gather(%b), channel_id=2, replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, dimensions={0}, metadata={op_name="jit(step)/jvp(embed)/gather"}
  %reduce-scatter = f32[2,32]{1,0} reduce-scatter(%a), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={0}, to_apply=%add, metadata={op_name="jit(step)/jvp(mlp)/reduce_scatter"}
  %s1 = f32[] constant(1)
  %combined = (f32[16,32]{1,0}, f32[]) all-reduce(%a, %s1), channel_id=4, replica_groups={}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(mlp))/dot_general"}
  %g0 = f32[16,32]{1,0} get-tuple-element(%combined), index=0, metadata={op_name="jit(step)/transpose(jvp(mlp))/dot_general"}
  %g1 = f32[] get-tuple-element(%combined), index=1, metadata={op_name="jit(step)/reduce_sum"}
  %cp = f32[16,32]{1,0} collective-permute(%a), channel_id=6, source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(step)/ppermute"}
  %nop = f32[16,32]{1,0} collective-permute(%a), channel_id=7, source_target_pairs={}, metadata={op_name="jit(step)/transpose(jvp())/add_any"}
  %one = f32[16,32]{1,0} all-reduce(%a), channel_id=8, replica_groups=[8,1]<=[8], to_apply=%add, metadata={op_name="jit(step)/psum"}
  %init = (s32[], f32[4,8]{1,0}) tuple(%s1, %a)
  %loop = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %out = f32[16,32]{1,0} add(%all-reduce, %g0)
}
"""


def by_name(colls):
    return {c.name: c for c in colls}


def test_every_form_in_a_snippet():
    colls = by_name(hlo.collectives(SNIPPET))
    # a collective-permute without pairs and an all-reduce over one device move
    # nothing and are not listed
    assert set(colls) == {"all-reduce", "all-gather", "reduce-scatter", "combined#0",
                          "combined#1", "ar-done", "cp"}
    assert colls["cp"].group_size == 2
    ar = colls["all-reduce"]
    assert (ar.kind, ar.dtype, ar.shape, ar.group_size) == ("all-reduce", "f32", (16, 32), 4)
    assert (ar.pass_, ar.scope, ar.elements, ar.bytes, ar.count) == (
        "backward", "attention", 512, 2048, 1)
    ag = colls["all-gather"]
    assert (ag.dtype, ag.shape, ag.group_size, ag.bytes, ag.pass_) == (
        "bf16", (16, 8), 8, 256, "forward")
    rs = colls["reduce-scatter"]  # bytes of the full input: 2*32 * group 4 * 4 B
    assert (rs.shape, rs.group_size, rs.bytes, rs.scope) == ((2, 32), 4, 1024, "mlp")
    # a combined all-reduce: each element on its own, with its own metadata
    c0, c1 = colls["combined#0"], colls["combined#1"]
    assert (c0.shape, c0.pass_, c0.scope, c0.combined, c0.group_size) == (
        (16, 32), "backward", "mlp", 2, 8)
    assert (c1.shape, c1.pass_, c1.bytes) == ((), "other", 4)
    # async pair counted once, inside a while body with trip count 6
    loop = colls["ar-done"]
    assert (loop.kind, loop.count, loop.group_size, loop.pass_, loop.scope) == (
        "all-reduce", 6, 4, "forward", "mlp")


def test_summarize_counts_trip_counts():
    rows = hlo.summarize(hlo.collectives(SNIPPET))
    loop = [r for r in rows if r["shape"] == [4, 8]]
    assert loop == [{"kind": "all-reduce", "pass": "forward", "scope": "mlp",
                     "count": 6, "shape": [4, 8], "dtype": "f32", "bytes": 128,
                     "group_size": 4}]
    assert sum(r["count"] for r in rows) == 6 + 6  # 6 loop iterations, 6 in the entry


def test_no_collectives_in_plain_text():
    assert hlo.collectives("HloModule m\n\nENTRY %e () -> f32[] {\n  ROOT %c = f32[] "
                           "constant(0)\n}\n") == []


def test_real_compiled_functions():
    mesh = make_mesh(2, 4)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    with jax.set_mesh(mesh):
        # a row-parallel matmul: one all-reduce over tp of the [8, 32] output
        w = jax.ShapeDtypeStruct((16, 32), jnp.float32)
        f = jax.jit(lambda x, w: x @ w, in_shardings=(P(None, "tp"), P("tp", None)),
                    out_shardings=P())
        colls = hlo.collectives(hlo.compiled_text(f, x, w))
        assert [(c.kind, c.shape, c.group_size) for c in colls] == [
            ("all-reduce", (8, 32), 4)]
        # gathering a dp-sharded array: an all-gather over dp
        g = jax.jit(lambda x: x * 2, in_shardings=P("dp"), out_shardings=P())
        colls = hlo.collectives(hlo.compiled_text(g, x))
        assert [(c.kind, c.shape, c.group_size) for c in colls] == [("all-gather", (8, 16), 2)]

        # a scanned stack: the collective sits in a while body, counted 5 times
        def scanned(x, ws):
            return jax.lax.scan(lambda h, w: (jax.lax.with_sharding_constraint(
                h @ w, P()), None), x, ws)[0]

        ws = jax.ShapeDtypeStruct((5, 16, 16), jnp.float32)
        h = jax.jit(scanned, in_shardings=(P(), P(None, "tp", None)), out_shardings=P())
        colls = hlo.collectives(hlo.compiled_text(h, x, ws))
        loop = [c for c in colls if c.kind == "all-reduce"]
        assert [(c.shape, c.group_size, c.count) for c in loop] == [((8, 16), 4, 5)]
        assert "while/body" in loop[0].op_name
        assert loop[0].scope == ""  # loop wrappers are not scopes: a scanned "mlp" stays "mlp"
        assert hlo.scope_of("jit(step)/transpose(jvp())/while/body/closed_call/mlp/dot") == "mlp"


CALLS = """HloModule m, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %r = f32[8]{0} all-reduce(%a), replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="jit(f)/jvp(mlp)/psum"}
}

%wrapped (b: f32[2,8]) -> f32[2,8] {
  %b = f32[2,8]{1,0} parameter(0)
  ROOT %t = f32[2,8]{1,0} all-to-all(%b), replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (p: f32[8], q: f32[2,8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %q = f32[2,8]{1,0} parameter(1)
  %c = f32[8]{0} call(%p), to_apply=%inner
  %start = ((f32[2,8]{1,0}), f32[2,8]{1,0}) async-start(%q), calls=%wrapped
  %done = f32[2,8]{1,0} async-done(%start), calls=%wrapped
  ROOT %o = f32[8]{0} add(%c, %c)
}
"""


def test_calls_and_async_wrappers_count_once():
    colls = by_name(hlo.collectives(CALLS))
    assert set(colls) == {"r", "t"}
    assert (colls["r"].kind, colls["r"].count, colls["r"].scope) == ("all-reduce", 1, "mlp")
    assert (colls["t"].kind, colls["t"].count, colls["t"].group_size) == ("all-to-all", 1, 4)


CREATED = """HloModule m, num_partitions=8

ENTRY %main (p: f32[16,128,128]) -> f32[16,16,128] {
  %p = f32[16,128,128]{2,1,0} parameter(0)
  %fusion.3 = f32[16,128,128]{2,1,0} fusion(%p), kind=kOutput, calls=%f, metadata={op_name="jit(step)/transpose(jvp(mlp))/dot_general"}
  %bitcast.9 = f32[16,128,128]{2,1,0} bitcast(%fusion.3)
  %reduce-scatter-start = ((f32[16,128,128]), f32[16,16,128]) reduce-scatter-start(%bitcast.9), channel_id=3, replica_groups=[1,8]<=[8], dimensions={1}, to_apply=%add
  ROOT %reduce-scatter-done = f32[16,16,128]{2,1,0} reduce-scatter-done(%reduce-scatter-start)
}
"""


def test_a_collective_without_metadata_takes_its_operands():
    """XLA's GPU reduce-scatter creator drops op_name: the collective is then
    attributed to the value it reduces (here through a bitcast)."""
    (c,) = hlo.collectives(CREATED)
    assert (c.kind, c.pass_, c.scope, c.group_size) == ("reduce-scatter", "backward", "mlp", 8)
