"""jaxtp.parallel.ep: the slots reach their experts' ranks and come back."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtp.parallel import Layout
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
