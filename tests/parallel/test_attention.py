"""sx.attention over a context axis against one device: forward and gradients for every
scheme × mask × GQA/MQA, on data=2,context=4 and context=8, Auto and Explicit meshes,
inside shard_map, under remat; the collectives each scheme compiles to; its refusals.

Each mesh compiles its cases in one program (a module fixture) that the parametrized
tests read, so the file costs a few compilations, not one per case.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.parallel.context import (
    attention,
    choose_impl,
    sequence_sharding,
    unzigzag,
    zigzag,
    zigzag_layout,
    zigzag_order,
)

IMPLS = ("all_gather", "ring", "ulysses")
B, T, D = 2, 32, 8
SEGMENTS = np.repeat([[0] * 7 + [1] * 13 + [2] * 12], B, 0).astype(np.int32)
# name: (causal, segment ids, window, bias, layout); "zigzag" runs as "zigzag:C", C the mesh's
MASKS = {
    "none": (False, False, None, False, "contiguous"),
    "causal": (True, False, None, False, "contiguous"),
    "segment": (False, True, None, False, "contiguous"),
    "window": (False, False, (3, 2), False, "contiguous"),
    "causal_segment_window": (True, True, (5, 0), False, "contiguous"),
    "bias_causal": (True, False, None, True, "contiguous"),
    "zigzag_causal_segment_window": (True, True, (9, 0), False, "zigzag"),
    "zigzag_bias_causal": (True, False, None, True, "zigzag"),
}
# mesh shape, heads, kv heads: GQA with kv heads divisible by C=4; MQA on C=8
MESHES = {"data2_context4_gqa": ((2, 4), 8, 4), "context8_mqa": ((1, 8), 8, 1)}


def reference(q, k, v, causal=False, segment_ids=None, window=None, bias=None):
    """Plain einsum softmax attention on one device, masks from positions 0..T-1."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    pos = np.arange(q.shape[1])
    diff = pos[:, None] - pos[None, :]
    mask = np.ones((q.shape[1],) * 2, bool)
    if causal:
        mask &= diff >= 0
    if window is not None:
        mask &= (diff <= window[0]) & (diff >= -window[1])
    mask = jnp.asarray(mask)[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    logits = jnp.where(mask, logits, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)


def inputs(heads, kv_heads, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, heads, D))
    k = jax.random.normal(ks[1], (B, T, kv_heads, D))
    v = jax.random.normal(ks[2], (B, T, kv_heads, D))
    bias = jax.random.normal(ks[3], (B, heads, T, T))
    w = jax.random.normal(ks[4], (B, T, heads, D))  # a loss weight, so gradients differ
    return q, k, v, bias, w


def value_and_grads(fn, q, k, v, bias, w):
    """Output and the gradients of ``sum(out · w)`` for q, k, v and the bias."""

    def loss(q, k, v, bias):
        out = fn(q, k, v, bias)
        return jnp.sum(out * w), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
    return out, grads


def close(got, want):
    """fp32 rtol 1e-5, with an absolute floor of 1e-5 of the largest entry (entries near
    zero have no meaningful relative error)."""
    want = np.asarray(want)
    np.testing.assert_allclose(
        np.asarray(got), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max())
    )


def case_fn(impl, mask_name, c=1):
    causal, seg, window, has_bias, layout = MASKS[mask_name]
    layout = zigzag_layout(c) if layout == "zigzag" else layout

    def fn(q, k, v, bias, segment_ids):
        return attention(
            q, k, v, causal=causal, segment_ids=segment_ids if seg else None, window=window,
            bias=bias if has_bias else None, impl=impl, layout=layout,
        )  # fmt: skip

    return fn


@pytest.fixture(scope="module", params=list(MESHES))
def mesh_results(request):
    """Every impl × mask on one mesh, in one compiled program: the context-parallel
    results (inputs placed batch over data, sequence over context), the one-device
    references, and the placements."""
    shape, heads, kv_heads = MESHES[request.param]
    c = shape[1]
    mesh = jax.make_mesh(shape, ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    q, k, v, bias, w = inputs(heads, kv_heads)
    seg = jnp.asarray(SEGMENTS)
    zig = {}
    (zig["q"], zig["k"], zig["v"], zig["w"], zig["seg"]), _ = zigzag((q, k, v, w, seg), c)
    order = zigzag_order(T, c)
    zig["bias"] = bias[:, :, order][:, :, :, order]  # rows and columns in the layout's order

    def run_all(plain, zigged):
        out = {}
        for impl in IMPLS:
            for name, (_, _, _, _, layout) in MASKS.items():
                x = zigged if layout == "zigzag" else plain
                fn = case_fn(impl, name, c)
                out[impl, name] = value_and_grads(
                    lambda q, k, v, b, fn=fn, s=x["seg"]: fn(q, k, v, b, s),
                    x["q"], x["k"], x["v"], x["bias"], x["w"],
                )  # fmt: skip
        return out

    plain = {"q": q, "k": k, "v": v, "bias": bias, "w": w, "seg": seg}
    seq = sequence_sharding(mesh)
    place = {"q": seq, "k": seq, "v": seq, "w": seq, "seg": seq}
    with jax.set_mesh(mesh):
        placed = [
            {n: jax.device_put(a, place.get(n, NamedSharding(mesh, P()))) for n, a in x.items()}
            for x in (plain, zig)
        ]
        got = jax.jit(run_all)(*placed)

    def references(plain):
        out = {}
        for name, (causal, s, window, has_bias, _) in MASKS.items():
            out[name] = value_and_grads(
                lambda q, k, v, b, causal=causal, s=s, window=window, has_bias=has_bias: (
                    reference(q, k, v, causal, plain["seg"] if s else None, window,
                              b if has_bias else None)
                ),
                plain["q"], plain["k"], plain["v"], plain["bias"], plain["w"],
            )  # fmt: skip
        return out

    want = jax.jit(references)(plain)
    return mesh, c, got, want, placed[0]


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("impl", IMPLS)
def test_forward_and_gradients_equal_one_device(mesh_results, impl, mask):
    _, c, got, want, _ = mesh_results
    (out, grads), (ref_out, ref_grads) = got[impl, mask], want[mask]
    if MASKS[mask][4] == "zigzag":  # back to sequence order
        out = unzigzag(out, c)
        dbias = unzigzag(unzigzag(grads[3], c, seq_axis=2), c, seq_axis=3)
        grads = (*unzigzag(grads[:3], c), dbias)
    close(out, ref_out)
    names = ("dq", "dk", "dv", "dbias") if MASKS[mask][3] else ("dq", "dk", "dv")
    for name, g, r in zip(names, grads, ref_grads, strict=False):
        try:
            close(g, r)
        except AssertionError as e:
            raise AssertionError(f"{name} differs") from e


def test_output_keeps_the_batch_and_sequence_placement(mesh_results):
    mesh, c, got, _, placed = mesh_results
    out, grads = got["ring", "causal"]
    assert out.sharding.is_equivalent_to(placed["q"].sharding, out.ndim)
    assert {s.data.shape for s in out.addressable_shards} == {
        (B // mesh.shape["data"], T // c, *out.shape[2:])
    }
    assert {s.data.shape for s in grads[1].addressable_shards} == {
        (B // mesh.shape["data"], T // c, *grads[1].shape[2:])
    }


def test_no_context_axis_is_dot_product_attention():
    q, k, v, bias, _ = inputs(4, 2)
    seg = jnp.asarray(SEGMENTS)

    @jax.jit
    def both(q, k, v, bias, seg):
        windowed = attention(q, k, v, causal=True, window=(4, 0))
        jax_own = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(4, 0))
        packed = attention(q, k, v, segment_ids=seg, bias=bias)
        return [(windowed, jax_own), (packed, reference(q, k, v, False, seg, None, bias))]

    for got, want in both(q, k, v, bias, seg):
        close(got, want)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):  # a mesh without a context axis: the same call
        close(jax.jit(lambda q: attention(q, k, v, causal=True))(q), reference(q, k, v, True))


def test_explicit_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Explicit,) * 2)
    q, k, v, _, w = inputs(8, 4)
    seg = jnp.asarray(SEGMENTS)
    fns = {impl: case_fn(impl, "causal_segment_window") for impl in IMPLS}

    @jax.jit
    def run(q, k, v, w, s):
        return {
            impl: value_and_grads(lambda *a, fn=fn: fn(*a, s), q, k, v, None, w)
            for impl, fn in fns.items()
        }

    with jax.set_mesh(mesh):
        got = run(*jax.device_put((q, k, v, w, seg), sequence_sharding(mesh)))
    ref_out, ref_grads = jax.jit(
        lambda q, k, v, w: value_and_grads(
            lambda q, k, v, b: reference(q, k, v, True, seg, (5, 0)), q, k, v, None, w
        )
    )(q, k, v, w)
    for impl, (out, grads) in got.items():
        assert out.sharding.spec[:2] == ("data", "context"), impl
        assert grads[0].sharding.spec[:2] == ("data", "context"), impl
        close(out, ref_out)
        for g, r in zip(grads[:3], ref_grads[:3], strict=True):
            close(g, r)


def test_inside_shard_map_and_remat():
    """Inside a user's shard_map binding the context axis (the arrays are blocks), and
    under sx.remat / jax.checkpoint: same forward and gradients."""
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    q, k, v, _, w = inputs(8, 4)
    seg = jnp.asarray(SEGMENTS)
    spec = P("data", "context")

    def blockwise(impl):
        return jax.shard_map(
            lambda q, k, v, s: attention(q, k, v, causal=True, segment_ids=s, impl=impl),
            mesh=mesh, in_specs=(spec,) * 4, out_specs=spec,
        )  # fmt: skip

    def global_(impl, wrap):
        return wrap(lambda q, k, v, s: attention(q, k, v, causal=True, segment_ids=s, impl=impl))

    fns = {f"shard_map-{i}": blockwise(i) for i in IMPLS}
    fns["remat-ring"] = global_("ring", sx.remat)
    fns["checkpoint-all_gather"] = global_("all_gather", jax.checkpoint)

    @jax.jit
    def run(q, k, v, w, s):
        return {
            n: value_and_grads(lambda *a, f=f: f(*a[:3], s), q, k, v, None, w)
            for n, f in fns.items()
        }

    with jax.set_mesh(mesh):
        got = run(*jax.device_put((q, k, v, w, seg), NamedSharding(mesh, spec)))
    ref_out, ref_grads = jax.jit(
        lambda q, k, v, w: value_and_grads(
            lambda q, k, v, b: reference(q, k, v, True, seg), q, k, v, None, w
        )
    )(q, k, v, w)
    for name, (out, grads) in got.items():
        close(out, ref_out)
        for g, r in zip(grads[:3], ref_grads[:3], strict=True):
            try:
                close(g, r)
            except AssertionError as e:
                raise AssertionError(name) from e


def test_each_scheme_compiles_to_its_collective():
    mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Auto,))
    q, k, v, _, _ = inputs(8, 8)
    texts = {}
    with jax.set_mesh(mesh):
        for impl in IMPLS:
            fn = jax.jit(lambda q, k, v, impl=impl: attention(q, k, v, causal=True, impl=impl))
            texts[impl] = fn.lower(q, k, v).compile().as_text()
    assert "collective-permute" in texts["ring"]
    assert "all-gather" not in texts["ring"] and "all-to-all" not in texts["ring"]
    assert "all-to-all" in texts["ulysses"] and "collective-permute" not in texts["ulysses"]
    assert "all-gather" in texts["all_gather"]


def test_the_causal_ring_skips_the_hidden_blocks():
    """Causal (or windowed) ring: each K/V block, or under zig-zag each chunk pair, is
    computed under a lax.cond on whether the mask hides it; without a mask, no cond."""
    mesh = jax.make_mesh((4,), ("context",), axis_types=(AxisType.Auto,))
    q = jnp.zeros((1, 32, 2, 8))

    def hlo(**kw):
        fn = jax.jit(jax.grad(lambda q: attention(q, q, q, impl="ring", **kw).sum()))
        with jax.set_mesh(mesh):
            return fn.lower(q).compile().as_text()

    assert "conditional(" not in hlo()
    for kw in ({"causal": True}, {"window": (3, 0)}, {"causal": True, "layout": "zigzag:4"}):
        assert "conditional(" in hlo(**kw), kw


def test_refusals_name_the_rule():
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    q, k, v, _, _ = inputs(6, 2)  # 6 heads: not divisible by C=4
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"heads must be divisible by C=4; got heads 6"):
            attention(q, k, v, impl="ulysses")
        with pytest.raises(ValueError, match=r"not divisible by 8 .*layout='zigzag:4'"):
            attention(q[:, :12], k[:, :12], v[:, :12], layout="zigzag:4")
        with pytest.raises(ValueError, match="q_len must equal kv_len"):
            attention(q[:, :16], k, v)
        with pytest.raises(ValueError, match="axis 'seq' is not in the mesh"):
            attention(q, k, v, axis="seq")
    with pytest.raises(ValueError, match=r"window must be \(left, right\).*got 3"):
        attention(q, k, v, window=3)
    with pytest.raises(ValueError, match=r"window must be .*got \(-1, 0\)"):
        attention(q, k, v, window=(-1, 0))
    with pytest.raises(ValueError, match="impl must be 'auto' or one of"):
        attention(q, k, v, impl="flash")
    with pytest.raises(ValueError, match=r"segment_ids must be \(batch, len\) = \(2, 32\)"):
        attention(q, k, v, segment_ids=jnp.zeros((2, 16), jnp.int32))
    with pytest.raises(ValueError, match="bias must be 4-D and broadcastable"):
        attention(q, k, v, bias=jnp.zeros((2, 6, 32, 16)))
    with pytest.raises(ValueError, match="multiple of kv_heads 4"):
        attention(q, jnp.zeros((2, 32, 4, 8)), jnp.zeros((2, 32, 4, 8)))
    for bad in ("zigzag:0", "zigzag:x", "zigzag:", "zig-zag", 4):
        with pytest.raises(ValueError, match=rf"layout must be one of .*'zigzag:C'.*got {bad!r}"):
            attention(q, k, v, layout=bad)
    with pytest.raises(ValueError, match=r"length 32 is not divisible by 6 \(2 × C=3, layout='zig"):
        attention(q, k, v, causal=True, layout="zigzag:3")


def test_a_batch_reordered_for_another_context_size_is_refused():
    """ "zigzag:4" carries its C: on context=2 the causal mask would be another batch's."""
    q, k, v, _, _ = inputs(4, 2)
    (zq, zk, zv), _ = zigzag((q, k, v), 4)
    fn = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, layout=zigzag_layout(4)))
    with (
        jax.set_mesh(jax.make_mesh((4, 2), ("data", "context"))),
        pytest.raises(
            ValueError,
            match=r"^sx.attention: layout='zigzag:4' says the sequence was reordered for 4 "
            r"devices of axis 'context', but it has size 2 here; reorder with "
            r"sx.parallel.zigzag\(batch, 2\) and pass layout='zigzag:2'",
        ),
    ):
        fn(zq, zk, zv)
    # On one device (no context axis) the layout's own C gives the true positions.
    want = reference(q, k, v, causal=True)
    close(unzigzag(np.asarray(fn(zq, zk, zv)), 4), want)


def test_auto_states_why_and_runs():
    impl, reason = choose_impl((1, 4096, 32, 128), (1, 4096, 8, 128), 4)
    assert impl == "all_gather" and "MiB" in reason
    impl, reason = choose_impl((1, 4096, 32, 128), (1, 4096, 32, 128), 4)
    assert impl == "ulysses" and "heads 32 divisible by C=4" in reason
    impl, reason = choose_impl((8, 65536, 32, 128), (8, 65536, 8, 128), 8)
    assert impl == "ring" and "scores per device" in reason
    impl, reason = choose_impl((1, 4096, 6, 128), (1, 4096, 6, 128), 4)
    assert impl == "all_gather" and "not divisible" in reason
    assert choose_impl((1, 64, 4, 8), (1, 64, 4, 8), 1)[0] == "none"


def test_zigzag_helpers():
    assert zigzag_layout(4) == "zigzag:4" and sx.parallel.zigzag_layout is zigzag_layout
    with pytest.raises(ValueError, match="context must be an integer >= 1, got 0"):
        zigzag_layout(0)
    assert zigzag_order(16, 4).tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    tokens = np.arange(32).reshape(2, 16)
    batch, pos = zigzag({"tokens": tokens, "n": np.int32(3)}, 4)
    assert batch["n"] == 3
    np.testing.assert_array_equal(batch["tokens"][0], pos)
    np.testing.assert_array_equal(unzigzag(batch["tokens"], 4), tokens)
    # causal work is even: each device's pair of chunks sees the same number of keys
    per_device = (pos.reshape(4, 4) + 1).sum(axis=1)
    assert len(set(per_device.tolist())) == 1
    with pytest.raises(ValueError, match="length 12 is not divisible by 2 × context = 8"):
        zigzag(np.zeros((1, 12)), 4)
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    assert sequence_sharding(mesh).spec == P("data", "context")
    assert sequence_sharding(jax.make_mesh((8,), ("context",))).spec == P(None, "context")
    with pytest.raises(ValueError, match="seq_axis 'seq' is not in the mesh"):
        sequence_sharding(mesh, seq_axis="seq")
