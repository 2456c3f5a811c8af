"""Replica groups in each form XLA prints, and the mesh axes they span
(jaxtp.groups), against hand-written groups and numpy's reshape/transpose."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxtp import groups, hlo
from jaxtp.parallel import make_mesh


# --- which mesh axes a collective spans ----------------------------------------
# Partition p sits at row-major position p of the mesh (mesh.devices.flat).

def _numpy_groups(dims, perm, size):
    """The iota form's groups, by numpy: arange reshaped, transposed, regrouped."""
    import numpy as np

    ids = np.arange(np.prod(dims)).reshape(dims).transpose(perm).reshape(-1, size)
    return tuple(tuple(int(i) for i in g) for g in ids)


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 4}, {"dp": 4, "tp": 2}], ids=["2x4", "4x2"])
def test_each_form_of_replica_groups_is_attributed_to_its_axes(mesh):
    dp, tp = mesh["dp"], mesh["tp"]
    over_tp = tuple(tuple(range(r * tp, (r + 1) * tp)) for r in range(dp))
    over_dp = tuple(tuple(range(c, dp * tp, tp)) for c in range(tp))
    text = lambda groups: "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"
    cases = {
        f"replica_groups={text(over_tp)}": (over_tp, ("tp",)),
        f"replica_groups={text(over_dp)}": (over_dp, ("dp",)),
        f"replica_groups=[{dp},{tp}]<=[{dp * tp}]": (over_tp, ("tp",)),
        # the transposed iota: groups down the columns, over dp
        f"replica_groups=[{tp},{dp}]<=[{dp},{tp}]T(1,0)": (over_dp, ("dp",)),
        "replica_groups={}": ((tuple(range(dp * tp)),), ("dp", "tp")),
        f"replica_groups=mesh['axis_0'={dp},'axis_1'={tp}] {{'axis_1'}}": (over_tp, ("tp",)),
        f"replica_groups=mesh['axis_0'={dp},'axis_1'={tp}] {{'axis_0'}}": (over_dp, ("dp",)),
        # as XLA prints it for a gradient summed over tp at dp=2 x tp=4: the mesh's
        # devices listed as an iota, here the columns first
        f"replica_groups=mesh['axis_0'={tp},'axis_1'=1,'axis_2'={dp}], "
        f"device_ids=([{dp},{tp}]T(1,0)) {{'axis_0'}}, use_global_device_ids=true":
            (over_tp, ("tp",)),
        # a ring over tp, and one step over dp
        "source_target_pairs=" + text([(r * tp + i, r * tp + (i + 1) % tp)
                                       for r in range(dp) for i in range(tp)]):
            (None, ("tp",)),
        "source_target_pairs=" + text([(c, c + tp) for c in range(tp)]): (None, ("dp",)),
    }
    for attrs, (want, axes) in cases.items():
        got = groups.replica_groups(attrs, dp * tp)
        if want is not None:
            assert sorted(got) == sorted(want), attrs
        assert groups.axes_of(got, mesh) == axes, attrs
    assert _numpy_groups([dp, tp], [1, 0], dp) == over_dp
    assert groups.replica_groups(f"replica_groups=[{tp},{dp}]<=[{dp},{tp}]T(1,0)", None) == \
        _numpy_groups([dp, tp], [1, 0], dp)
    three = groups.replica_groups("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", 8)
    assert three == _numpy_groups([2, 2, 2], [0, 2, 1], 2)
    assert groups.axes_of(three, {"dp": 2, "cp": 2, "tp": 2}) == ("cp",)


def test_a_compiled_dp_by_tp_program_puts_tp_and_dp_traffic_on_their_axes():
    """At dp=2 x tp=4, compiled: a row-parallel matmul's g spans tp, the batch
    mean's reduction dp (the train step's rows: tests/analysis/test_budget.py)."""
    from jaxtp.parallel import Layout

    mesh = make_mesh(2, 4)

    def step(x, w):  # a row-parallel matmul (g over tp), then a mean over the batch (dp)
        y = jax.lax.with_sharding_constraint(x @ w, P("dp", None))
        return jnp.mean(y ** 2)

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=jax.NamedSharding(mesh, P("dp", "tp")))
    w = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=jax.NamedSharding(mesh, P("tp", None)))
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(step, argnums=1)).lower(x, w).compile().as_text()
    sizes = Layout.make(dp=2, tp=4).sizes
    axes = {c.axes(sizes) for c in hlo.collectives(text)}
    assert ("tp",) in axes and ("dp",) in axes, axes
    assert hlo.by_axis(hlo.collectives(text), sizes).keys() <= {"tp", "dp", "dp+tp"}
