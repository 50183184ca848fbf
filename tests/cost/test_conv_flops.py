"""Convolutions' FLOPs from compiled HLO: XLA:CPU's ``convolution`` and, on a GPU target,
cuDNN's convolution calls (forward, fused bias-activation, backward input and filter),
each against XLA:CPU's own ``cost_analysis()`` of the same convolution; and a small
ResNet's training step on a compile-only H100 against XLA's count on the CPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cost.estimation import analyse
from shardax.cost.flops import hlo_flops, line_matmuls, unpriced_calls

NHWC = ("NHWC", "HWIO", "NHWC")
CASES = {  # input, kernel, strides, padding, feature groups
    "3x3": ((8, 16, 16, 32), (3, 3, 32, 64), (1, 1), "SAME", 1),
    "3x3/2": ((8, 16, 16, 32), (3, 3, 32, 64), (2, 2), "SAME", 1),
    "7x7/2": ((4, 32, 32, 3), (7, 7, 3, 16), (2, 2), ((3, 3), (3, 3)), 1),
    "1x1/2": ((8, 16, 16, 32), (1, 1, 32, 64), (2, 2), "VALID", 1),
    "grouped": ((8, 16, 16, 32), (3, 3, 8, 64), (1, 1), "SAME", 4),
}


def _directions(case, sharding=None):
    """The forward convolution of ``case`` and its two backward ones, as ``{name: (fn,
    abstract args)}``."""
    xs, ws, strides, padding, groups = case

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, strides, padding, dimension_numbers=NHWC, feature_group_count=groups
        )

    def s(shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

    ys = jax.eval_shape(conv, s(xs), s(ws)).shape
    return {
        "forward": (conv, (s(xs), s(ws))),
        "input": (lambda w, dy: jax.vjp(lambda x: conv(x, w), jnp.zeros(xs))[1](dy)[0],
                  (s(ws), s(ys))),
        "filter": (lambda x, dy: jax.vjp(lambda w: conv(x, w), jnp.zeros(ws))[1](dy)[0],
                   (s(xs), s(ys))),
    }  # fmt: skip


def _xla_cpu_flops(fn, args):
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((analysis[0] if isinstance(analysis, list) else analysis)["flops"])


@pytest.mark.parametrize("case", CASES)
def test_cpu_convolutions_count_as_xla_does(case):
    """Padding, strides, dilations and groups: each direction's count is XLA's own."""
    for fn, args in _directions(CASES[case]).values():
        compiled = jax.jit(fn).lower(*args).compile()
        assert hlo_flops(compiled.as_text()) == _xla_cpu_flops(fn, args)


def test_unpriced_custom_calls_are_named_with_their_count():
    hlo = (
        "ENTRY %main {\n"
        '  %k = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call"\n'
        '  %t = f32[8]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"\n'
        '  %r = u32[8]{0} custom-call(%a), custom_call_target="cu_threefry2x32"\n'
        "  %c = (f32[8,4]{1,0}, u8[0]{0}) custom-call(%a, %b), window={size=3}, "
        'dim_labels=b0f_0io->b0f, custom_call_target="__cudnn$convForward"\n'
        "}\n"
    )  # the convolution's operands have no known shape here: not priced, so named
    assert unpriced_calls(hlo) == {
        "tpu_custom_call": 1, "__gpu$xla.gpu.triton": 1, "__cudnn$convForward": 1,
    }  # fmt: skip


@pytest.fixture(scope="module")
def h100():
    return sx.make_mesh({"data": 1}, devices=sx.target("1xH100"))


_TARGET = re.compile(r'custom_call_target="__cudnn\$(conv\w*)"')


@pytest.mark.compile_only("gpu")
@pytest.mark.parametrize("case", ["3x3", "grouped"])
def test_cudnn_convolutions_count_as_xla_cpu_does(h100, case):
    """Each direction becomes a cuDNN call on an H100 (convForward, convBackwardInput,
    convBackwardFilter; a grouped backward-input is a forward of the reversed kernel),
    counted as XLA:CPU counts the same convolution."""
    replicated = NamedSharding(h100, P())
    for direction, (fn, args) in _directions(CASES[case], replicated).items():
        hlo = jax.jit(fn).lower(*args).compile().as_text()
        calls = _TARGET.findall(hlo)
        assert len(calls) == 1, (direction, calls)
        if case == "3x3":
            name = {"forward": "Forward", "input": "BackwardInput", "filter": "BackwardFilter"}
            assert calls[0] == "conv" + name[direction]
        cpu_args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        assert hlo_flops(hlo) == _xla_cpu_flops(fn, cpu_args), direction
        assert unpriced_calls(hlo) == {}


@pytest.mark.compile_only("gpu")
def test_cudnn_fused_bias_activation_counts_its_convolution(h100):
    def f(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
        return jax.nn.relu(y + b)

    shapes = ((8, 16, 16, 32), (3, 3, 32, 64), (64,))
    on_gpu = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(h100, P()))
              for s in shapes]  # fmt: skip
    hlo = jax.jit(f).lower(*on_gpu).compile().as_text()
    assert _TARGET.findall(hlo) == ["convBiasActivationForward"]
    (conv,) = [f for _, kind, f in line_matmuls(hlo.splitlines()) if kind == "cudnn-conv"]
    conv_only = _directions(CASES["3x3"])["forward"]
    assert conv == _xla_cpu_flops(*conv_only)


def _resnet_step():
    """A small ResNet in flax's style (a stem, three residual blocks of convolutions and
    BatchNorm, a projection shortcut where the shape changes), its SGD training step and
    its abstract state."""
    import flax.linen as nn

    class Block(nn.Module):
        features: int
        stride: int = 1

        @nn.compact
        def __call__(self, x):
            norm = lambda: nn.BatchNorm(use_running_average=False, momentum=0.9)  # noqa: E731
            y = nn.Conv(self.features, (3, 3), self.stride, use_bias=False)(x)
            y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(nn.relu(norm()(y))))
            if x.shape[-1] != self.features or self.stride != 1:
                x = norm()(nn.Conv(self.features, (1, 1), self.stride, use_bias=False)(x))
            return nn.relu(x + y)

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(16, (3, 3))(x)))
            for i, features in enumerate((16, 32, 64)):
                x = Block(features, 1 if i == 0 else 2)(x)
            return nn.Dense(10)(x.mean((1, 2)))

    model, tx = ResNet(), optax.sgd(0.1, 0.9)

    def init():
        v = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
        return {"params": v["params"], "batch_stats": v["batch_stats"],
                "opt_state": tx.init(v["params"])}  # fmt: skip

    def step(state, batch):
        def loss_fn(params):
            variables = {"params": params, "batch_stats": state["batch_stats"]}
            logits, new = model.apply(variables, batch["image"], mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            return loss.mean(), new["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "batch_stats": stats, "opt_state": opt}, loss

    return step, jax.eval_shape(init)


def _placed(state, mesh, rows=16):
    """``state`` replicated over ``mesh`` and a batch of ``rows`` 32×32 images split."""
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
    batch = {"image": jax.ShapeDtypeStruct((rows, 32, 32, 3), jnp.float32, sharding=split),
             "label": jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=split)}  # fmt: skip
    return placed, batch


@pytest.mark.compile_only("gpu")
def test_resnet_flops_on_an_h100_target_are_xla_cpu_count(h100):
    """Issue 41: a ResNet's training step compiled for an H100 counts its cuDNN
    convolutions (forward, both backwards) within 10% of XLA:CPU's own count of the same
    step (cost_analysis(): every op, elementwise and BatchNorm included). Before, the
    H100's count was the head's GEMMs alone."""
    step, state = _resnet_step()
    cpu = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("data",))
    analysis = jax.jit(step).lower(*_placed(state, cpu)).compile().cost_analysis()
    on_cpu = float((analysis[0] if isinstance(analysis, list) else analysis)["flops"])
    placed, batch = _placed(state, h100)
    compiled = jax.jit(step).lower(placed, batch).compile()
    hlo = compiled.as_text()
    calls = _TARGET.findall(hlo)
    assert {"convForward", "convBackwardInput", "convBackwardFilter"} <= set(calls)
    assert unpriced_calls(hlo) == {}
    assert hlo_flops(hlo) == pytest.approx(on_cpu, rel=0.1)
    # The report: images, not tokens; no 6·N·images (the compiled count, labelled).
    report = analyse(compiled, h100, state=placed, batch=batch)
    assert report.unit == "images" and report.tokens == 16
    assert report.model_flops == report.flops_hlo and report.unpriced_calls == {}
    assert "images/s per device" in str(report)
    assert report.model_flops_note.startswith("unknown for images")
