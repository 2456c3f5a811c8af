import pytest
from jax.sharding import AxisType, PartitionSpec as P

from jaxtp.parallel import check_device_count, make_mesh, spec


def test_logical_axes_map_through_the_rules():
    assert spec("embed", "mlp") == P(None, "tp")
    assert spec("mlp", "embed") == P("tp", None)
    assert spec("batch", "seq", "embed") == P("dp", None, None)
    assert spec("embed", None, "heads", "head_dim") == P(None, None, "tp", None)


def test_two_dims_on_one_mesh_axis_is_an_error():
    with pytest.raises(ValueError, match="same mesh axis"):
        spec("heads", "mlp")
    with pytest.raises(KeyError, match="unknown logical axis 'hidden'"):
        spec("hidden")
    rules = {"embed": "tp", "mlp": "tp"}  # an FSDP-like table mistake
    with pytest.raises(ValueError, match="same mesh axis"):
        spec("embed", "mlp", rules=rules)


def test_mesh_is_auto_dp_by_tp():
    mesh = make_mesh(2, 4)
    assert mesh.axis_names == ("dp", "tp") and dict(mesh.shape) == {"dp": 2, "tp": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_too_many_devices_is_a_clear_error():
    with pytest.raises(ValueError, match=r"dp\*tp = 2\*8 = 16 devices requested but this "
                                         r"machine has 8 cpu"):
        make_mesh(2, 8)
    with pytest.raises(ValueError, match=r"has 4 gpu device\(s\).*JAX_PLATFORMS=cpu"):
        check_device_count(8, 4, "gpu", dp=1, tp=8)
    check_device_count(8, 8, "gpu", dp=1, tp=8)
