"""sx.attention's fused kernels: cuDNN on an H100, splash attention on a TPU, the dense
path elsewhere and for what a kernel cannot do (said once, by reason)."""

from __future__ import annotations

import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cost.hlo import attention_kernel, attention_kernels
from shardax.parallel import fused
from shardax.parallel.fused import choose_kernel

# Several test processes on one machine: libtpu's single-process lockfile is for real
# chips; a compile-only topology needs none (set before libtpu loads).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@pytest.fixture(autouse=True)
def fresh_warnings():
    fused._WARNED.clear()
    yield
    fused._WARNED.clear()


# --------------------------------------------------------------------------- choice


@pytest.mark.parametrize(
    ("platform", "dtype", "head_dim", "masks", "kernel", "why"),
    [
        ("gpu", "bfloat16", 128, ("causal",), "cudnn", "causal"),
        ("gpu", "float16", 64, (), "cudnn", "no mask"),
        ("gpu", "bfloat16", 64, ("segment_ids",), "cudnn", "as a (batch, 1, q_len, kv_len) bias"),
        ("gpu", "float32", 64, ("causal",), "dense", "float32 inputs"),
        ("gpu", "bfloat16", 100, (), "dense", "head_dim 100"),
        ("gpu", "bfloat16", 256, (), "dense", "head_dim 256"),
        ("gpu", "bfloat16", 64, ("causal", "bias"), "dense", "additive bias"),
        ("gpu", "bfloat16", 64, ("window_right",), "dense", "looks ahead"),
        ("tpu", "bfloat16", 64, ("causal", "window", "segment_ids"), "splash", "window"),
        ("tpu", "float32", 128, ("window_right",), "splash", "window_right"),
        ("tpu", "bfloat16", 64, ("causal", "positions"), "dense", "positions offset"),
        ("tpu", "bfloat16", 60, (), "dense", "head_dim 60"),
        ("tpu", "bfloat16", 64, ("bias",), "dense", "additive bias"),
        ("cpu", "bfloat16", 64, ("causal",), "dense", "no fused attention kernel on cpu"),
    ],
)
def test_choose_kernel(platform, dtype, head_dim, masks, kernel, why):
    chosen, reason = choose_kernel(platform, dtype, head_dim, masks, q_len=256, kv_len=256)
    assert chosen == kernel
    assert why in reason


def test_choose_kernel_sequence_rules():
    # Splash works in blocks of 128; cuDNN takes a mask-as-bias only with even lengths.
    assert choose_kernel("tpu", "bfloat16", 64, ("causal",), q_len=200, kv_len=200)[0] == "dense"
    odd = choose_kernel("gpu", "bfloat16", 64, ("segment_ids",), q_len=201, kv_len=201)
    assert odd[0] == "dense" and "odd sequence length" in odd[1]
    assert choose_kernel("gpu", "bfloat16", 64, ("causal",), q_len=201, kv_len=201)[0] == "cudnn"
    with pytest.raises(ValueError, match="masks must be kinds of"):
        choose_kernel("gpu", "bfloat16", 64, ("sliding",))


def test_attention_kernels_reads_hlo():
    hlo = "\n".join([
        '%a = bf16[2,8] custom-call(%q), custom_call_target="__cudnn$fmhaSoftmax"',
        '%b = bf16[2,8] custom-call(%q), custom_call_target="__cudnn$fmhaSoftmaxBackward"',
        '%c = f32[2] custom-call(%q), custom_call_target="tpu_custom_call", '
        'backend_config={"name": "splash_mha_fwd_residuals"}',
        '%d = f32[2] custom-call(%q), custom_call_target="tpu_custom_call", '
        'backend_config={"name": "my_other_kernel"}',
    ])  # fmt: skip
    assert attention_kernels(hlo) == {"cudnn": 2, "splash": 1}
    assert attention_kernel(hlo) == "cudnn"
    assert attention_kernel("") == "dense"


def test_cpu_stays_dense_and_silent(caplog):
    """On CPU nothing changes: the dense path, no warning."""
    q = jnp.ones((1, 16, 2, 8), jnp.bfloat16)
    with caplog.at_level(logging.WARNING, logger="shardax"):
        out = sx.attention(q, q, q, causal=True)
    ref = jax.nn.dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    assert not caplog.records


def test_named_kernel_refused_with_reason():
    q = jnp.ones((1, 128, 2, 8))
    bias = jnp.zeros((1, 1, 128, 128))
    with pytest.raises(ValueError, match="kernel='splash' cannot compute this attention: an "):
        sx.attention(q, q, q, bias=bias, kernel="splash")
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        sx.attention(q, q, q, kernel="flash")


# --------------------------------------------------------------------------- numerics


def _loss(kernel, **kw):
    def loss(q, k, v):
        out = sx.attention(q, k, v, kernel=kernel, **kw)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _qkv(b=2, t=128, h=4, kh=2, d=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.normal(size=shape), dtype) for shape in
        ((b, t, h, d), (b, t, kh, d), (b, t, kh, d))
    )  # fmt: skip


def _close(fused_out, dense_out, tol):
    (_, out), grads = fused_out
    (_, ref), ref_grads = dense_out
    for a, b in zip((out, *grads), (ref, *ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=tol, rtol=tol)  # fmt: skip


def test_splash_equals_dense_interpreted():
    """Splash attention in Pallas' interpret mode (any platform): forward and gradients
    equal the dense path, GQA, causal with segment ids and a sliding window."""
    q, k, v = _qkv()
    seg = jnp.asarray(np.repeat([[0] * 50 + [1] * 78], 2, axis=0), jnp.int32)
    kw = {"causal": True, "segment_ids": seg, "window": (40, 0)}
    _close(_loss("splash", **kw)(q, k, v), _loss("dense", **kw)(q, k, v), 2e-5)


def test_splash_equals_dense_under_ulysses(mesh_2d):
    """Inside ulysses' per-device block the kernel runs in a shard_map over the other
    axes (batch over "data"): the same forward and gradients as the dense path."""
    q, k, v = _qkv(t=512, h=4, kh=4, d=8)
    mesh = jax.make_mesh((2, 4), ("data", "context"), devices=jax.devices()[:8])
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v))
    with jax.set_mesh(mesh):
        got = _loss("splash", causal=True, impl="ulysses")(q, k, v)
        ref = _loss("dense", causal=True, impl="ulysses")(q, k, v)
    _close(got, ref, 2e-5)


# cuDNN against the dense path on one GPU: tests/parallel/test_fused_attention_gpu.py.


@pytest.mark.skipif(
    jax.default_backend() != "gpu" or jax.device_count() < 2,
    reason="the ring's cuDNN numerics need 2 or more GPUs (none here)",
)
def test_ring_of_cudnn_blocks_equals_dense_on_gpus():
    """On real GPUs: the ring with cuDNN blocks (forward and the backward from the global
    out and lse) against the dense path, no mask and causal in both layouts."""
    n = 2 if jax.device_count() < 4 else 4
    mesh = jax.make_mesh((1, n), ("data", "context"), devices=jax.devices()[:n])
    q, k, v = _qkv(t=128 * n, d=64, dtype=jnp.bfloat16)
    put = NamedSharding(mesh, P("data", "context"))
    for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, f"zigzag:{n}")):
        args = [jax.device_put(x, put) for x in (q, k, v)]
        kw = {"causal": causal, "impl": "ring", "layout": layout}
        with jax.set_mesh(mesh):
            _close(_loss("cudnn", **kw)(*args), _loss("dense", **kw)(*args), 3e-2)


def _einsum_cudnn_fwd(q, k, v, *, scale, causal):
    """cuDNN's forward contract (compat.cudnn_attention_fwd) in einsums: ``(out, lse)``,
    lse ``(B, N, T)`` fp32; the stand-in for the cuDNN call where no GPU is."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnd,bsnd->bnts", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        s = jnp.where(np.tril(np.ones(s.shape[-2:], bool)), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    return jnp.einsum("bnts,bsnd->btnd", p, v.astype(jnp.float32)).astype(q.dtype), lse


def _einsum_cudnn_bwd(q, k, v, out, lse, dout, *, scale, causal):
    """cuDNN's backward contract (compat.cudnn_attention_bwd) in einsums: the gradients
    at the given ``out`` and ``lse``, P = exp(S - lse), delta = sum(dout · out)."""
    b, _, n, d = q.shape
    kh = k.shape[2]
    kr, vr = (jnp.repeat(x, n // kh, axis=2).astype(jnp.float32) for x in (k, v))
    q32, do, o = (x.astype(jnp.float32) for x in (q, dout, out))
    s = jnp.einsum("btnd,bsnd->bnts", q32, kr) * scale
    if causal:
        s = jnp.where(np.tril(np.ones(s.shape[-2:], bool)), s, -jnp.inf)
    p = jnp.exp(s - lse[..., None])
    delta = jnp.einsum("btnd,btnd->bnt", do, o)
    ds = p * (jnp.einsum("btnd,bsnd->bnts", do, vr) - delta[..., None])
    dq = scale * jnp.einsum("bnts,bsnd->btnd", ds, kr)
    dk = scale * jnp.einsum("bnts,btnd->bsnd", ds, q32)
    dv = jnp.einsum("bnts,btnd->bsnd", p, do)
    dk, dv = (x.reshape(b, -1, kh, n // kh, d).sum(3) for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)], ids=["data2_context4", "context8"])
def test_ring_of_cudnn_blocks_equals_one_device(monkeypatch, shape):
    """The ring with kernel="cudnn" (each K/V block's (out, lse) combined by the online
    softmax; each block's gradients from the GLOBAL out and lse) equals one device's
    dense attention, forward and gradients, GQA, no mask and causal in both layouts.
    No GPU here: the two cuDNN calls (compat) are replaced by einsums keeping their
    contract, so the ring's plumbing (peeled diagonal step, layouts, the shard_map over
    the other axes) runs for real on the 8 CPU devices."""
    from shardax.runtime import compat

    monkeypatch.setattr(compat, "cudnn_attention_fwd", _einsum_cudnn_fwd)
    monkeypatch.setattr(compat, "cudnn_attention_bwd", _einsum_cudnn_bwd)
    q, k, v = _qkv(t=64, h=4, kh=2, d=16, dtype=jnp.bfloat16)
    mesh = jax.make_mesh(shape, ("data", "context"), devices=jax.devices()[:8])
    put = NamedSharding(mesh, P("data", "context"))
    zig = sx.parallel.zigzag_layout(shape[1])
    cases = ((False, "contiguous"), (True, "contiguous"), (True, zig))
    perms = [
        sx.parallel.zigzag(np.arange(64)[None], shape[1])[1] if layout == zig else np.arange(64)
        for _, layout in cases
    ]
    # one program for the references (one device, fp32 softmax), one for the rings
    refs = jax.jit(lambda *a: {c: _loss("dense", causal=c)(*a) for c in (False, True)})(q, k, v)

    @jax.jit
    def rings(placed):
        return [
            [_loss(kernel, impl="ring", layout=layout, causal=causal)(*args)
             for kernel in ("cudnn", "dense")]
            for (causal, layout), args in zip(cases, placed, strict=True)
        ]  # fmt: skip

    placed = [[jax.device_put(x[:, perm], put) for x in (q, k, v)] for perm in perms]
    with jax.set_mesh(mesh):
        results = rings(placed)
    for (causal, _), perm, (((_, out), grads), ((_, dense_out), _)) in zip(
        cases, perms, results, strict=True
    ):
        ref = refs[causal]
        back = np.argsort(perm)
        got = ((None, np.asarray(out)[:, back]), tuple(np.asarray(g)[:, back] for g in grads))
        _close(got, ref, 3e-2)
        # the same bf16 blocks as the dense ring, to bf16 rounding of each block's output
        np.testing.assert_allclose(np.asarray(out, np.float32),
                                   np.asarray(dense_out, np.float32), atol=2e-2)  # fmt: skip
        assert out.sharding.spec[:2] == ("data", "context") or shape[0] == 1


def test_ring_names_what_its_cudnn_blocks_cannot_do():
    q = jnp.ones((1, 64, 2, 16), jnp.bfloat16)
    seg = jnp.zeros((1, 64), jnp.int32)
    mesh = jax.make_mesh((1, 8), ("data", "context"), devices=jax.devices()[:8])
    cases = [
        ({"segment_ids": seg}, "segment ids (the ring's cuDNN blocks take causal or no mask"),
        ({"window": (8, 0)}, "a window (the ring's cuDNN blocks"),
        ({"bias": jnp.zeros((1, 1, 64, 64), jnp.bfloat16)}, "an additive bias"),
        ({"kernel": "splash"}, "splash attention gives no log-sum-exp"),
    ]
    with jax.set_mesh(mesh):
        for kw, why in cases:
            kw = {"kernel": "cudnn", **kw}
            with pytest.raises(ValueError, match=f"kernel='{kw['kernel']}' cannot compute "
                               f"impl='ring': {re.escape(why)}"):  # fmt: skip
                sx.attention(q, q, q, impl="ring", **kw)


# --------------------------------------------------------------------------- compile-only


def _compiled(mesh, spec, shapes, dtype=jnp.bfloat16, seg=False, bias=None, compile=True,
              **kw):  # fmt: skip
    """The compiled text of the gradient of sum(sx.attention) on ``mesh`` (abstract
    inputs, nothing runs); with ``compile=False`` the lowered text (the kernel is chosen
    while tracing, so it shows the choice; a dense GPU compile takes seconds)."""
    q_shape, kv_shape = shapes
    sharding = NamedSharding(mesh, spec)
    args = [jax.ShapeDtypeStruct(q_shape, dtype, sharding=sharding),
            jax.ShapeDtypeStruct(kv_shape, dtype, sharding=sharding),
            jax.ShapeDtypeStruct(kv_shape, dtype, sharding=sharding)]  # fmt: skip
    if seg:
        args.append(jax.ShapeDtypeStruct(q_shape[:2], jnp.int32, sharding=sharding))

    def loss(q, k, v, seg=None):
        out = sx.attention(q, k, v, segment_ids=seg, bias=bias, **kw)
        return out.astype(jnp.float32).sum()

    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args)
    return lowered.compile().as_text() if compile else lowered.as_text()


SHAPES = ((8, 128, 4, 64), (8, 128, 2, 64))
MASKS = [{}, {"causal": True}, {"causal": True, "seg": True}, {"seg": True}]


def _meshes(name):
    target = sx.target(name)
    return {
        "jit": (sx.make_mesh({"data": -1}, devices=target), P("data")),
        "context": (sx.make_mesh({"data": 2, "context": -1}, devices=target),
                    P("data", "context")),
    }  # fmt: skip


@pytest.fixture(scope="module")
def h100_meshes():
    return _meshes("8xH100")


@pytest.mark.compile_only("gpu")
@pytest.mark.parametrize("where", ["jit", "all_gather", "ulysses"])
def test_h100_lowers_to_cudnn(h100_meshes, where, caplog):
    mesh, spec = h100_meshes["jit" if where == "jit" else "context"]
    impl = {} if where == "jit" else {"impl": where}
    with caplog.at_level(logging.WARNING, logger="shardax"):
        for masks in MASKS:
            text = _compiled(mesh, spec, SHAPES, **masks, **impl)
            counts = attention_kernels(text)
            # forward and backward (GQA: 4 query heads over 2 kv heads)
            assert counts["cudnn"] >= 2, (where, masks, counts)
    assert not caplog.records  # nothing fell back


@pytest.mark.compile_only("gpu")
def test_h100_falls_back_by_name(h100_meshes, caplog):
    mesh, spec = h100_meshes["jit"]
    shapes_100 = ((8, 128, 4, 100), (8, 128, 2, 100))
    cases = [
        ({"dtype": jnp.float32, "causal": True}, SHAPES, "float32 inputs"),
        ({"bias": jnp.zeros((1, 1, 128, 128), jnp.bfloat16)}, SHAPES, "additive bias"),
        ({"window": (16, 16)}, SHAPES, "looks ahead"),
        ({"causal": True}, shapes_100, "head_dim 100"),
    ]
    with caplog.at_level(logging.WARNING, logger="shardax"):
        for kw, shapes, why in cases:
            assert attention_kernel(_compiled(mesh, spec, shapes, compile=False, **kw)) == "dense"
            assert why in caplog.records[-1].getMessage()
        n = len(caplog.records)
        _compiled(mesh, spec, SHAPES, dtype=jnp.float32, causal=True, compile=False)  # once
    assert n == len(cases) == len(caplog.records)


@pytest.mark.compile_only("gpu")
def test_h100_ring_runs_its_blocks_through_cudnn(h100_meshes, caplog):
    """The causal ring (data=2 × context=4, blocks of T/C = 32 tokens, head_dim 64) with
    its gradient: cuDNN's forward and backward per block, the blocks passed on by
    collective-permute, and no dense score block left (no dot, no fp32 32×32 or, under
    zig-zag, 16×16 scores). Segment ids, which the ring's cuDNN blocks cannot take, fall
    back to the dense blocks, said once by name."""
    mesh, spec = h100_meshes["context"]
    with caplog.at_level(logging.WARNING, logger="shardax"):
        for layout in ("contiguous", "zigzag:4"):
            text = _compiled(mesh, spec, SHAPES, causal=True, impl="ring", layout=layout)
            calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text)
            assert any("Backward" in c for c in calls), (layout, calls)
            assert any("Backward" not in c for c in calls), (layout, calls)
            assert "collective-permute" in text
            assert not re.search(r" dot\(|__cublas|f32\[[0-9,]*(32,32|16,16)\]", text), layout
        assert not caplog.records  # nothing fell back
        for _ in range(2):
            text = _compiled(mesh, spec, SHAPES, seg=True, impl="ring", compile=False)
            assert attention_kernel(text) == "dense"
    assert [r.getMessage() for r in caplog.records] == [
        "sx.attention: dense attention, not a fused kernel: impl='ring' with cudnn "
        "unsupported: segment ids (the ring's cuDNN blocks take causal or no mask; "
        "impl='all_gather' or 'ulysses' take cuDNN with it)"
    ]


@pytest.fixture(scope="module")
def tpu_meshes():
    return _meshes("v5e-4")


@pytest.mark.compile_only("tpu")
def test_tpu_lowers_to_splash(tpu_meshes, caplog):
    mesh, spec = tpu_meshes["jit"]
    with caplog.at_level(logging.WARNING, logger="shardax"):
        for kw in ({"causal": True, "seg": True}, {"window": (64, 0)}, {}):
            counts = attention_kernels(_compiled(mesh, spec, SHAPES, **kw))
            assert counts["splash"] >= 3, (kw, counts)  # forward, dq, dkv
        mesh, spec = tpu_meshes["context"]
        counts = attention_kernels(_compiled(mesh, spec, SHAPES, causal=True, impl="ulysses"))
        assert counts["splash"] >= 3, counts
    assert not caplog.records


@pytest.mark.compile_only("tpu")
def test_tpu_falls_back_by_name(tpu_meshes, caplog):
    mesh, spec = tpu_meshes["context"]
    with caplog.at_level(logging.WARNING, logger="shardax"):
        text = _compiled(mesh, spec, SHAPES, causal=True, impl="all_gather", compile=False)
    assert attention_kernel(text) == "dense"
    assert "positions offset per device" in caplog.records[0].getMessage()


@pytest.mark.compile_only("gpu")
@pytest.mark.parametrize("where", ["jit", "ring"])
def test_gpt_in_bf16_compiles_to_cudnn_on_h100(h100_meshes, where):
    """The GPT (bf16, as `shardax train --model gpt` runs on a GPU) takes cuDNN's kernel,
    also under `--attention ring` on a context mesh (zig-zag, as the CLI lays it out)."""
    from flax import nnx

    from shardax.models import gpt

    mesh, spec = h100_meshes["jit" if where == "jit" else "context"]
    attn = "auto" if where == "jit" else "ring"
    cfg = gpt.GPTConfig(layers=1, d_model=128, heads=2, max_seq_len=128, attention=attn)
    graph, params = nnx.split(nnx.eval_shape(lambda: gpt.make_gpt(cfg, 0)))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    tokens = jax.ShapeDtypeStruct((8, 128), jnp.int32, sharding=NamedSharding(mesh, spec))

    def loss(params, tokens):
        layout = "contiguous" if where == "jit" else "zigzag:4"
        logits = nnx.merge(graph, params)(tokens, layout=layout)
        return logits.astype(jnp.float32).mean()

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
    assert attention_kernels(text)["cudnn"] >= 2
    assert attention_kernel(text) == "cudnn"  # what `shardax train` reports
