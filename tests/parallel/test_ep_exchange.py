"""jaxtp.parallel.ep: the slots reach their experts' ranks and come back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtp.parallel import Layout
from jaxtp.parallel.collectives import varying_axes
from jaxtp.parallel.ep import over_ep

E, G, C, D = 8, 8, 3, 4  # experts, groups (split over ep), slots, model dim


def test_each_expert_sees_its_slots_of_every_group_and_they_return():
    """Each rank's experts get their slots of every ep rank's groups, in ep
    rank order, and the reverse all-to-all brings every output home: an
    expert that adds 1000 * (its global id) + 100 * (the group's global id)
    to its slots shows, per slot, which expert and which group it saw."""
    mesh = Layout.make(ep=4, tp=2).mesh()
    x_EGCD = jnp.asarray(np.random.default_rng(0).normal(size=(E, G, C, D)), jnp.float32)

    def experts(x):  # x: [E/ep, ep*G_r, C, D], this rank's experts
        r = jax.lax.axis_index("ep")
        e = r * x.shape[0] + jnp.arange(x.shape[0])
        g = jnp.arange(x.shape[1])  # over every ep rank's groups, in rank order
        return x + 1000.0 * e[:, None, None, None] + 100.0 * g[None, :, None, None]

    with jax.set_mesh(mesh):
        y = jax.jit(jax.shard_map(lambda x: over_ep(experts, x), mesh=mesh,
                                  in_specs=P(None, "ep"), out_specs=P(None, "ep")))(x_EGCD)
    want = x_EGCD + 1000.0 * jnp.arange(E)[:, None, None, None] + \
        100.0 * jnp.arange(G)[None, :, None, None]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_without_an_ep_axis_the_experts_run_in_place():
    x = jnp.ones((E, G, C, D))
    assert over_ep(lambda v: 2 * v, x).sum() == 2 * x.size


# ---- the dropless ragged path (`jaxtp.parallel.ep.ragged`) -------------------

N, K, F, EXPERTS = 12, 2, 6, 8  # tokens per rank, top-k, expert hidden units, experts
RNG = np.random.default_rng(0)
W_UP = jnp.asarray(RNG.normal(size=(EXPERTS, D, F)) / 2, jnp.float32)
W_DOWN = jnp.asarray(RNG.normal(size=(EXPERTS, F, D)) / 2, jnp.float32)


def routed(n_tokens, seed=1):
    """(x [n, D], top-k distinct experts [n, k], weights [n, k]), skewed so
    that some experts get many rows and some none."""
    r = np.random.default_rng(seed)
    x = r.normal(size=(n_tokens, D)).astype(np.float32)
    p = np.array([8, 4, 2, 1, 1, 0.5, 0.25, 0.25])
    e = np.stack([r.choice(EXPERTS, K, replace=False, p=p / p.sum()) for _ in range(n_tokens)])
    w = r.uniform(0.1, 1.0, size=(n_tokens, K)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(e, jnp.int32), jnp.asarray(w)


def by_token(x, e, w, w_up, w_down):
    """Each token through its k experts, one at a time."""
    rows = []
    for t in range(x.shape[0]):
        y = jnp.zeros(D)
        for j in range(K):
            h = jnp.tanh(x[t] @ w_up[e[t, j]])
            y = y + w[t, j] * (h @ w_down[e[t, j]])
        rows.append(y)
    return jnp.stack(rows)


def ragged_experts(w_up, w_down):
    """The experts on rows grouped by expert (`ep.ragged`'s callable)."""
    return lambda x_RD, sizes: jax.lax.ragged_dot(
        jnp.tanh(jax.lax.ragged_dot(x_RD, w_up, sizes)), w_down, sizes)


def test_ragged_on_one_rank_equals_each_token_through_its_experts():
    from jaxtp.parallel.ep import ragged

    x, e, w = routed(N)
    ct = jnp.asarray(RNG.normal(size=(N, D)), jnp.float32)  # a cotangent for the outputs
    loss = lambda f: lambda x, a, b: jnp.sum(f(x, a, b) * ct)
    got = jax.value_and_grad(loss(lambda x, a, b: ragged(ragged_experts(a, b), x, e, w,
                                                         EXPERTS)), (0, 1, 2))(x, W_UP, W_DOWN)
    want = jax.value_and_grad(loss(lambda x, a, b: by_token(x, e, w, a, b)), (0, 1, 2))(
        x, W_UP, W_DOWN)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
    """`jax.lax.ragged_all_to_all` as its docstring states it, from
    all-gathers (XLA:CPU compiles no ragged-all-to-all, jax-ml/jax#34755):
    source s's rows [input_offsets_s[me], + send_sizes_s[me]) land on this
    rank at output_offsets_s[me]."""
    # the real one's result takes the output buffer's type: one invariant
    # over the axis would type every rank's rows as one value
    assert set(axis_name) <= varying_axes(output), "the output buffer must vary over the axis"
    me = jax.lax.axis_index(axis_name)
    gather = lambda a: jax.lax.all_gather(a, axis_name)
    ops, ins, sends, outs = map(gather, (operand, input_offsets, send_sizes, output_offsets))
    r = jnp.arange(output.shape[0])
    for s in range(ops.shape[0]):
        start, size, src = outs[s, me], sends[s, me], ins[s, me]
        rows = ops[s][jnp.clip(src + r - start, 0, operand.shape[0] - 1)]
        output = jnp.where(((r >= start) & (r < start + size))[:, None], rows, output)
    return output


@pytest.mark.parametrize("ep", [2, 4])
def test_the_ragged_exchange_over_ep_equals_one_rank(ep, monkeypatch):
    """ep ranks, each routing its own N tokens, each holding E/ep experts:
    the outputs and every gradient (tokens, both weights) equal each token
    through its experts on one device, with the exchange's offsets and
    regrouping as written (the collective emulated: see above)."""
    from jaxtp.parallel.ep import ragged

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    mesh = Layout.make(ep=ep).mesh(jax.devices()[:ep])
    x, e, w = routed(ep * N)

    def per_rank(x, e, w, a, b):
        return ragged(ragged_experts(a, b), x, e, w, EXPERTS)

    sharded = jax.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"))
    ct = jnp.asarray(RNG.normal(size=(ep * N, D)), jnp.float32)  # a cotangent for the outputs
    loss = lambda f: lambda x, a, b: jnp.sum(f(x, e, w, a, b) * ct)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss(sharded), (0, 1, 2)))(x, W_UP, W_DOWN)
    want = jax.value_and_grad(loss(lambda x, e, w, a, b: by_token(x, e, w, a, b)), (0, 1, 2))(
        x, W_UP, W_DOWN)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
