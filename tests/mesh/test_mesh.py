import jax
import pytest
from jax.sharding import AxisType

import shardax as sx


def test_fill_with_minus_one():
    mesh = sx.make_mesh({"data": -1, "model": 2})
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert sorted(mesh.device_ids.flat) == list(range(8))


def test_default_is_all_devices_on_data():
    assert dict(sx.make_mesh().shape) == {"data": 8}


def test_list_of_pairs_and_explicit_axis_types():
    mesh = sx.make_mesh([("data", 2), ("model", 4)], axis_types=AxisType.Explicit)
    assert mesh.axis_names == ("data", "model")
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)


def test_smaller_mesh_uses_a_subset():
    mesh = sx.make_mesh({"data": 4})
    assert mesh.size == 4


def test_built_by_jax_make_mesh_topology_aware():
    # Same device order as jax.make_mesh would choose for this shape.
    mesh = sx.make_mesh({"data": 4, "model": 2})
    ref = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    assert (mesh.device_ids == ref.device_ids).all()


NOT_ENOUGH = r"^sx\.make_mesh: Not enough devices: mesh requires 16 devices but only 8 available"


@pytest.mark.parametrize(
    "spec,needle",
    [
        (
            {"data": 16},
            NOT_ENOUGH,
        ),
        (
            {"data": 4, "model": 4},
            NOT_ENOUGH,
        ),
        (
            {"data": -1, "model": 16},
            NOT_ENOUGH,
        ),
        ([("data", 2), ("data", 2)], "unique"),
        ({"data": 0}, "'data' size must be an integer >= 1 or -1, got 0"),
        ({"data": -2}, "got -2"),
        ({"data": -1, "model": -1}, "at most one"),
        ({"data": -1, "model": 3}, "does not divide"),
    ],
)
def test_bad_meshes_name_the_sizes(spec, needle):
    with pytest.raises(ValueError, match=needle):
        sx.make_mesh(spec)


def test_manager_facade():
    mgr = sx.DeviceMeshManager()
    assert mgr.num_devices == 8 and len(mgr.devices) == 8
    assert dict(mgr.create_device_mesh({"data": 2, "model": 1}).shape) == {"data": 2, "model": 1}
    assert dict(mgr.create_device_mesh([("data", 2), ("model", 4)]).shape) == {
        "data": 2,
        "model": 4,
    }
    assert dict(mgr.create_data_parallel_mesh().shape) == {"data": 8}
    assert dict(mgr.create_data_parallel_mesh(4).shape) == {"data": 4}
    assert dict(mgr.create_model_parallel_mesh().shape) == {"model": 8}
    hybrid = mgr.create_hybrid_mesh(data_parallel_size=4, model_parallel_size=2)
    assert dict(hybrid.shape) == {"data": 4, "model": 2}
    info = mgr.get_mesh_info(hybrid)
    assert info["total_devices"] == 8 and info["axes"] == {"data": 4, "model": 2}


def test_manager_restricted_devices():
    mgr = sx.DeviceMeshManager(jax.devices()[:4])
    assert mgr.num_devices == 4
    assert set(mgr.create_data_parallel_mesh().device_ids.flat) <= {0, 1, 2, 3}
    with pytest.raises(
        ValueError,
        match=r"^sx\.DeviceMeshManager\.create_data_parallel_mesh: Not enough devices: mesh "
        r"requires 8 devices but only 4 available",
    ):
        mgr.create_data_parallel_mesh(8)
    with pytest.raises(ValueError, match="Not enough devices"):  # the seed's wording
        mgr.create_device_mesh({"data": 8})


def test_multiprocess_layout_never_silently_crosses_the_network():
    from types import SimpleNamespace

    from shardax.mesh.make import _hybrid_grid

    # Two processes with 4 devices each (duck-typed: only their placement is read).
    devices = [SimpleNamespace(id=i, platform="cpu", process_index=i // 4) for i in range(8)]
    with pytest.raises(ValueError, match=r"dcn_axis 'data' \(size None\).*2 processes"):
        _hybrid_grid({"model": 8}, devices, "data")
    with pytest.raises(ValueError, match=r"dcn_axis 'data' \(size 1\).*multiple of 2"):
        _hybrid_grid({"data": 1, "model": 8}, devices, "data")
