"""A backward pass split in two, nothing computed twice: the input's
gradient (B) first, the weights' (W) later from what B leaves (the
zero-bubble pipelines' split, Qi et al. 2024, Sec. 2: B and W each cost
about a forward, and only B is on the path from one stage to the next).

`split_vjp(f, w, x)` traces `f`'s backward once, as one jaxpr from
(residuals, output cotangent) to (weights' gradient, input gradient), its
calls and rematerialisations inlined. B is the equations the input gradient
needs; W the rest, which read what B made (each weight matmul's output
cotangent, mostly), the residuals and the output cotangent. So B and W
together run exactly the backward's equations: a weight gradient's matmul
in W, an input gradient's in B.

The residuals are kept as `jaxtp.parallel.pipeline_1f1b` keeps them: those
that depend on `x` are the forward's to keep (until W), those of the weights
alone (casts, masks) are made again from `w` where B and W read them, found
by JAX's partial evaluation (private in jax 0.10.2, so tried: without it
every residual is kept).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from flax import nnx

from .collectives import vary, varying_axes

# the name scope of the weight gradients' pass, by which the compiled
# program's reader tells its matmuls from B's (`jaxtp.analysis.pp.block_flops`)
WGRAD = "pp_wgrad"

# call-like primitives whose bodies are inlined so that B and W split inside
# them (a rematerialised block's backward is one `checkpoint` call)
_INLINED = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2")
# equations W may make again from their operands rather than B hand over
# their result: copies, elementwise ops and reductions (no matmul, no
# collective: those stay where the ledger and the FLOP count put them)
_CHEAP = ("reshape", "transpose", "convert_element_type", "broadcast_in_dim", "squeeze",
          "expand_dims", "copy", "copy_p", "slice", "concatenate", "pad", "dynamic_slice",
          "select_n", "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign",
          "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "rsqrt", "sqrt",
          "integer_pow", "pow", "square", "erf", "reduce_sum", "reduce_max", "reduce_min",
          "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "clamp", "iota")


class Split(NamedTuple):
    """`f`'s forward and its backward in two (`split_vjp`); kept and saved:
    lists of arrays."""
    forward: Callable  # (w, x) -> (out, kept)
    backward_input: Callable  # (w, kept, g) -> (x's gradient, saved)
    backward_weights: Callable  # (w, kept, saved) -> w's gradient


def residuals(f: Callable, w, x):
    """(`f`'s forward as (w, x) -> (out, kept), known(w) -> the residuals of
    `w` alone, backward(known, kept, g) -> (g_w, g_x), out's type, kept's
    types): `f`'s VJP with its residuals split by what they depend on."""
    tree = {}

    def run(w, x):  # (output, its VJP's leaves)
        out, vjp = jax.vjp(f, w, x)
        leaves, tree["vjp"] = jax.tree.flatten(vjp)
        return out, leaves

    closed, (out_type, types) = jax.make_jaxpr(run, return_shape=True)(w, x)
    n_w, n_out = len(jax.tree.leaves(w)), len(jax.tree.leaves(out_type))
    try:
        from jax._src.interpreters.partial_eval import partial_eval_jaxpr_nounits
        known_jaxpr, _, unknown, _ = partial_eval_jaxpr_nounits(
            closed, [False] * n_w + [True] * len(jax.tree.leaves(x)), instantiate=False)
    except ImportError:  # pragma: no cover (a later jax)
        known_jaxpr, unknown = None, [True] * (n_out + len(types))
    on_x = unknown[n_out:]
    # (the known jaxpr's outputs: the known outputs, in order, then its own
    # residuals for the unknown part)
    first = unknown[:n_out].count(False)

    def known(w):
        if known_jaxpr is None:
            return []
        outs = jcore.jaxpr_as_fun(known_jaxpr)(*jax.tree.leaves(w))
        return outs[first:first + on_x.count(False)]

    def forward(w, x):
        out, leaves = run(w, x)
        return out, [a for a, u in zip(leaves, on_x) if u]

    def backward(known, kept, g):
        kept, known = iter(kept), iter(known)
        leaves = [next(kept) if u else next(known) for u in on_x]
        return jax.tree.unflatten(tree["vjp"], leaves)(g)

    return forward, known, backward, out_type, [t for t, u in zip(types, on_x) if u]


def split_vjp(f: Callable, w, x) -> Split:
    """`f(w, x)`'s forward, and its backward as B then W (module doc)."""
    forward, known, backward, out_type, kept_types = residuals(f, w, x)
    known_types = jax.eval_shape(known, w)
    closed = jax.make_jaxpr(backward)(_values(known_types), _values(kept_types),
                                      _values(out_type))
    jaxpr, n_in = closed.jaxpr, len(known_types) + len(kept_types)
    consts, eqns = list(zip(jaxpr.constvars, closed.consts)), []
    outs = _inline(jaxpr, {}, eqns, consts)
    n_w = len(jax.tree.leaves(w))
    g_w, g_x, g_vars = outs[:n_w], outs[n_w:], jaxpr.invars[n_in:]
    b_eqns, w_eqns, saved = _cut(eqns, list(g_x), list(g_w), set(g_vars),
                                 jaxpr.invars[:n_in])
    constvars, constvals = [v for v, _ in consts], [c for _, c in consts]
    part = lambda ins, outs, es: jcore.jaxpr_as_fun(jcore.ClosedJaxpr(
        jcore.Jaxpr(constvars, jaxpr.invars[:n_in] + ins, outs, es, jaxpr.effects), constvals))
    run_b = part(list(g_vars), list(g_x) + saved, b_eqns)
    run_w = part(saved, list(g_w), w_eqns)

    def backward_input(w, kept, g):
        outs = run_b(*known(w), *kept, *jax.tree.leaves(g))
        return jax.tree.unflatten(jax.tree.structure(x), outs[:len(g_x)]), outs[len(g_x):]

    def backward_weights(w, kept, saved_):
        return jax.tree.unflatten(jax.tree.structure(w), run_w(*known(w), *kept, *saved_))

    return Split(forward, backward_input, backward_weights)


def chunk_vjp(run: Callable, chunks: list, x, inputs: bool = False):
    """(forward(w, x) -> (out, what its backward needs), backward(i, w, kept,
    g) -> (the chunk's weights' gradient, the input's), the output's type,
    the kept values' types), for `run(w, x)` on any of `chunks` (a stage's
    weights, one per chunk; 1F1B's whole backward). Kept: the VJP's
    residuals that depend on `x`; those of the weights alone are computed
    here once per chunk (`residuals`). With `inputs`: `x` alone, the forward
    run again in the backward."""
    if inputs:
        forward = lambda w, x: (run(w, x), [x])
        out_type, kept_types = jax.eval_shape(forward, chunks[0], x)
        return forward, lambda i, w, kept, g: jax.vjp(run, w, kept[0])[1](g), out_type, \
            kept_types
    forward, known, backward, out_type, kept_types = residuals(run, chunks[0], x)
    stacked = [jnp.stack(vals) for vals in zip(*[known(c) for c in chunks])]
    return (forward, lambda i, w, kept, g: backward([a[i] for a in stacked], kept, g),
            out_type, kept_types)


def chunk_split(unit: Callable, enter: Callable, graphdef, w, x):
    """(forward(w, x) -> (out, kept), backward_input(w, kept, g) -> (g_x,
    saved), backward_weights(w, kept, saved) -> g_w, out's type, kept's
    types, saved's types) of a chunk's units run in order, `unit(module,
    carry) -> carry` from `enter(x)` (x, or (x, what the units add up
    beside it)), `w` its stacked [n, ...] parameters
    (`graphdef`'s): each unit's backward split (`split_vjp`), B a reverse
    loop over the units keeping each one's hand-over to W, W a loop over
    them (their weights' gradients need no order), under `WGRAD`."""
    one = lambda w_l, c: unit(nnx.merge(graphdef, w_l), c)
    s = split_vjp(one, jax.tree.map(lambda a: a[0], w), enter(x))

    def forward(w, x):
        return jax.lax.scan(lambda c, w_l: s.forward(w_l, c), enter(x), w)

    def backward_input(w, kept, g):
        g_c, saved = jax.lax.scan(lambda g, a: s.backward_input(a[0], a[1], g), g, (w, kept),
                                  reverse=True)
        return (g_c[0] if isinstance(g_c, tuple) else g_c), saved  # (`enter`'s transpose)

    def backward_weights(w, kept, saved):
        with jax.named_scope(WGRAD):
            return jax.lax.map(lambda a: s.backward_weights(*a), (w, kept, saved))

    out_type, kept_types = jax.eval_shape(forward, w, x)
    saved_types = jax.eval_shape(
        lambda w: backward_input(w, _values(kept_types), _values(out_type))[1], w)
    return forward, backward_input, backward_weights, out_type, kept_types, saved_types


def _values(types):
    """Zeros of `types` (ShapeDtypeStructs), varying as they do: what types
    are traced on (a ShapeDtypeStruct's vma does not trace in jax 0.10.2)."""
    return jax.tree.map(lambda t: vary(jnp.zeros(t.shape, t.dtype), varying_axes(t)), types)


def _cut(eqns: list, g_x: list, g_w: list, g_vars: set, have: list
         ) -> tuple[list, list, list]:
    """(B's equations, W's, the values B hands W): B what `g_x` needs, W the
    rest. A value W reads that B made by an elementwise op, a reduction or a
    copy (`_CHEAP`: no matmul, no collective) is made again in W where it is
    made of what W `have`s (the residuals), or what B would hand over for it
    is no larger (a norm's output from the stage input and the scale; a
    reshape's from its operand), largest first: B hands W its matmuls'
    output cotangents and what only a matmul or a collective makes."""
    b_eqns = _needed(eqns, g_x)
    order = {id(e): k for k, e in enumerate(eqns)}
    in_w = {id(e) for e in eqns} - {id(e) for e in b_eqns}
    made = {v: e for e in b_eqns for v in e.outvars if not isinstance(v, jcore.DropVar)}
    size = lambda v: v.aval.size * v.aval.dtype.itemsize
    have = set(have)  # (and what cheap ops make of it alone)
    for e in b_eqns:
        if e.primitive.name in _CHEAP and all(a in have for a in e.invars
                                              if isinstance(a, jcore.Var)):
            have.update(e.outvars)
    handed = lambda a: isinstance(a, jcore.Var) and (
        a in g_vars or a in made and id(made[a]) not in in_w)

    def saved_now() -> list:
        used = [a for e in eqns if id(e) in in_w for a in e.invars] + g_w
        return list(dict.fromkeys(a for a in used if handed(a)))

    saved = saved_now()
    while True:
        again = next((e for v in sorted(saved, key=size, reverse=True)
                      if (e := made.get(v)) is not None and e.primitive.name in _CHEAP
                      and (v in have or sum(size(a) for a in dict.fromkeys(
                          a for a in e.invars if handed(a)) if a not in saved) <= size(v))),
                     None)
        if again is None:
            break
        in_w.add(id(again))
        saved = saved_now()
    w_eqns = sorted((e for e in eqns if id(e) in in_w), key=lambda e: order[id(e)])
    return _needed(b_eqns, g_x + saved), w_eqns, saved


def _needed(eqns: list, outs: list) -> list:
    """The equations `outs` depend on, in order (whole equations: a loop
    any of whose outputs is needed is needed whole)."""
    need = {a for a in outs if isinstance(a, jcore.Var)}
    kept = []
    for e in reversed(eqns):
        if any(o in need for o in e.outvars if not isinstance(o, jcore.DropVar)) \
                or e.effects:
            kept.append(e)
            need.update(a for a in e.invars if isinstance(a, jcore.Var))
    return kept[::-1]


def _body(eqn):
    """The body of a call-like equation to inline, as a ClosedJaxpr; or None."""
    if eqn.primitive.name not in _INLINED:
        return None
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(body, jcore.Jaxpr):
        return jcore.ClosedJaxpr(body, ())
    return body if isinstance(body, jcore.ClosedJaxpr) else None


def _inline(jaxpr, env: dict, eqns: list, consts: list, names=None) -> list:
    """Appends `jaxpr`'s equations to `eqns`, its calls inlined and every
    variable it defines renamed (a body called twice defines each value
    once per call); `env` maps its inputs to the atoms they are, `consts`
    gathers the bodies' constants, `names` is the name stack a body's
    equations are under (the call's: the compiled program's op names, by
    which its reader tells a pass and a scope, stay as they were). Returns
    its outputs' atoms."""
    read = lambda a: a if isinstance(a, jcore.Literal) else env.get(a, a)
    for eqn in jaxpr.eqns:
        ins, body = [read(a) for a in eqn.invars], _body(eqn)
        where = eqn.source_info if names is None else eqn.source_info.replace(
            name_stack=names + eqn.source_info.name_stack)
        if body is not None:
            inner = dict(zip(body.jaxpr.invars, ins))
            for v, c in zip(body.jaxpr.constvars, body.consts):
                inner[v] = jcore.Var(v.aval)
                consts.append((inner[v], c))
            outs = _inline(body.jaxpr, inner, eqns, consts, where.name_stack)
            env.update((o, a) for o, a in zip(eqn.outvars, outs)
                       if not isinstance(o, jcore.DropVar))
            continue
        outs = [o if isinstance(o, jcore.DropVar) else jcore.Var(o.aval) for o in eqn.outvars]
        env.update((o, n) for o, n in zip(eqn.outvars, outs) if not isinstance(o, jcore.DropVar))
        eqns.append(eqn.replace(invars=ins, outvars=outs, source_info=where))
    return [read(a) for a in jaxpr.outvars]
