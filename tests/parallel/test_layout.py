import jax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from jaxtp.parallel import Layout, check_device_count, keep_axes, make_mesh, spec


def test_logical_axes_map_through_the_rules():
    assert spec("embed", "mlp") == P(None, "tp")
    assert spec("mlp", "embed") == P("tp", None)
    # the sequence is split over cp, an axis only a context-parallel mesh
    # has, the batch over pp (outside the pipeline), dp and ep (outside the experts)
    assert spec("batch", "seq", "embed") == P(("pp", "dp", "ep"), "cp", None)
    with jax.sharding.use_abstract_mesh(Layout.make(dp=2, tp=4).abstract_mesh()):
        assert spec("batch", "seq", "embed") == P("dp", None, None)
        assert spec("batch", "sp_seq", "embed") == P("dp", "tp", None)
    with jax.sharding.use_abstract_mesh(Layout.make(dp=1, tp=2, cp=4).abstract_mesh()):
        assert spec("batch", "sp_seq", "embed") == P("dp", ("cp", "tp"), None)
    assert spec("embed", None, "heads", "head_dim") == P(None, None, "tp", None)


def test_two_dims_on_one_mesh_axis_is_an_error():
    with pytest.raises(ValueError, match="same mesh axis"):
        spec("heads", "mlp")
    with pytest.raises(KeyError, match="unknown logical axis 'hidden'"):
        spec("hidden")
    rules = {"embed": ("tp",), "mlp": ("tp",)}  # an FSDP-like table mistake
    with pytest.raises(ValueError, match="same mesh axis"):
        spec("embed", "mlp", rules=rules)
    rules = {"seq": ("cp", "tp"), "mlp": ("tp",)}  # one axis inside a tuple too
    with pytest.raises(ValueError, match="same mesh axis"):
        spec("seq", "mlp", rules=rules)


def test_mesh_is_auto_dp_by_tp():
    mesh = make_mesh(2, 4)
    assert mesh.axis_names == ("dp", "tp") and dict(mesh.shape) == {"dp": 2, "tp": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_too_many_devices_is_a_clear_error():
    with pytest.raises(ValueError, match=r"dp\*tp = 2\*8 = 16 devices requested but this "
                                         r"machine has 8 cpu"):
        make_mesh(2, 8)
    with pytest.raises(ValueError, match=r"has 4 gpu device\(s\).*JAX_PLATFORMS=cpu"):
        check_device_count({"dp": 1, "tp": 8}, 4, "gpu")
    check_device_count({"dp": 1, "tp": 8}, 8, "gpu")


def test_a_layout_takes_any_set_of_named_axes():
    """A third axis is one more entry: the mesh, its abstract twin, the
    device count and a dim split over two axes at once."""
    layout = Layout(axes={"dp": 2, "cp": 2, "tp": 2}, impl="explicit")
    assert layout.axes == (("dp", 2), ("cp", 2), ("tp", 2)) and layout.devices == 8
    assert (layout.dp, layout.tp) == (2, 2)
    mesh = layout.mesh()
    assert mesh.axis_names == ("dp", "cp", "tp") and mesh.axis_types == (AxisType.Explicit,) * 3
    abstract = layout.abstract_mesh()
    assert dict(abstract.shape) == {"dp": 2, "cp": 2, "tp": 2}
    assert abstract.axis_types == (AxisType.Explicit,) * 3
    rules = {"batch": ("dp",), "sp_seq": ("cp", "tp"), "embed": ()}
    assert spec("batch", "sp_seq", "embed", rules=rules) == P("dp", ("cp", "tp"), None)
    assert keep_axes(P("dp", ("cp", "tp"), None), {"tp"}) == P(None, "tp", None)
    with pytest.raises(ValueError, match=r"dp\*cp\*tp = 2\*2\*4 = 16 devices requested"):
        Layout(axes={"dp": 2, "cp": 2, "tp": 4}).mesh()
    with pytest.raises(ValueError, match="mesh axis 'cp' has size 0"):
        Layout(axes={"dp": 1, "cp": 0})
