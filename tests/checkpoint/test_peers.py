"""Peer snapshots (``shardax.checkpoint.peers``): what is refused by name, on one process
(a state with no second copy on another process), and the split of a saved tree into
the arrays orbax's local handler stores and the values kept in its JSON part. The run
in which a replaced host fetches its shards from a peer is in
``tests/runtime/test_launcher_lost.py``."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.checkpoint import peers


def placed(mesh, spec):
    return jax.device_put(np.arange(16.0).reshape(8, 2), NamedSharding(mesh, spec))


def test_a_state_with_no_copy_on_another_process_is_refused_naming_why():
    mesh = sx.make_mesh({"data": 4, "fsdp": 2})
    with pytest.raises(ValueError, match=r"the mesh has no 'data' axis \(axes \{'fsdp': 8\}\)"):
        peers.replica_axis(
            sx.make_mesh({"fsdp": -1}), {"w": placed(sx.make_mesh({"fsdp": -1}), P())}
        )
    with pytest.raises(ValueError, match=r"state leaf 'opt/mu' is sharded over the 'data' axis"):
        peers.replica_axis(mesh, {"w": placed(mesh, P()), "opt": {"mu": placed(mesh, P("data"))}})
    with pytest.raises(
        ValueError, match=r"one process has devices in every replica along 'data' \(4"
    ):
        peers.replica_axis(mesh, {"w": placed(mesh, P(None, "fsdp"))})
    # Sharded over data: snapshotted on the paired mesh, two copies, here on one process.
    with pytest.raises(
        ValueError, match=r"one process has devices in every replica along 'copies' \(2"
    ):
        peers.PeerSnapshots("/nonexistent", {"w": placed(mesh, P("data"))})
    odd = sx.make_mesh({"data": 1, "fsdp": 8})
    with pytest.raises(ValueError, match=r"sharded over 'data', whose 1 devices do not split"):
        peers.PeerSnapshots("/nonexistent", {"w": placed(odd, P(("data", "fsdp")))})
    with pytest.raises(ValueError, match="no array placed on a mesh"):
        peers.PeerSnapshots("/nonexistent", {"w": np.zeros(3)})


def test_the_paired_mesh_keeps_each_spec_and_holds_two_copies():
    mesh = sx.make_mesh({"data": 4, "fsdp": 2})
    pairs = peers.paired_mesh(mesh)
    assert dict(pairs.shape) == {"copies": 2, "data": 2, "fsdp": 2}
    w = placed(mesh, P("data"))
    paired = peers._reshard({"w": w}, peers._on(pairs, {"w": w}))["w"]
    assert paired.sharding.spec == P("data") and paired.sharding.mesh is pairs
    halves = [(s.device.id, s.index) for s in paired.addressable_shards]
    first = {d.id for d in pairs.devices[0].flat}
    # each copy holds the whole array, the same rows in the same place of its half
    for copy in (0, 1):
        rows = sorted(i[0].start for d, i in halves if (d in first) == (copy == 0))
        assert rows == [0, 0, 4, 4], rows
    np.testing.assert_array_equal(np.asarray(paired), np.asarray(w))


def test_the_saved_tree_splits_into_mesh_arrays_and_json_values_and_back():
    mesh = sx.make_mesh({"data": -1})
    w = placed(mesh, P())
    tree = {
        "params": {"w": w, "n": np.asarray(3)},
        "rng": jax.device_get(jax.random.key_data(jax.random.key(1))),
    }
    arrays, host = peers._split(tree)
    assert arrays == {"params": {"w": w}}
    assert host == {
        "params/n": {"dtype": "int64", "shape": [], "data": [3]},
        "rng": {"dtype": "uint32", "shape": [2], "data": tree["rng"].tolist()},
    }
    back = peers._join(arrays, host)
    assert back["params"]["w"] is w
    np.testing.assert_array_equal(back["rng"], tree["rng"])
    assert back["params"]["n"].dtype == np.int64 and back["params"]["n"] == 3
    target, _ = peers._split(
        {
            "w": jax.ShapeDtypeStruct((8, 2), np.float32),
            "v": jax.ShapeDtypeStruct((2,), np.float32, sharding=w.sharding),
        }
    )
    assert list(target) == ["v"]  # an unplaced target leaf comes from the JSON part
