import math

import jax.numpy as jnp
import numpy as np
import pytest

import shardax as sx
from shardax.cost.hardware import HARDWARE_SPECS, HardwareType
from shardax.cost.memory import STATE_BYTES, estimate, plan_memory, state_bytes
from shardax.cost.roofline import critical_batch_size, hardware_roofline
from shardax.train.precision import PRECISIONS as POLICIES
from shardax.train.precision import resolve


def test_bytes_per_param_formulas():
    assert STATE_BYTES["fp32"].total == 4 + 4 + 0 + 8 == 16
    assert STATE_BYTES["bf16"].total == STATE_BYTES["fp16"].total == 16
    assert (STATE_BYTES["fp32"].compute, STATE_BYTES["bf16"].compute) == (4, 2)
    pure_bf16 = sx.Precision(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    assert state_bytes(pure_bf16).total == 2 + 2 + 0 + 4 == 8


def test_one_precision_the_memory_table_takes_the_train_names():
    """The cost table and the train policies are one set of names with the same dtypes."""
    assert list(STATE_BYTES) == list(POLICIES)
    for name, policy in POLICIES.items():
        row, policy = state_bytes(name), resolve(policy)
        assert row.params == np.dtype(policy.param_dtype).itemsize
        assert row.compute == np.dtype(policy.compute_dtype).itemsize


@pytest.mark.parametrize("precision", list(STATE_BYTES))
def test_dp_fsdp_tp_pp_hybrids_divide_the_states(precision):
    p, n = 7e9, 8
    s = STATE_BYTES[precision].total
    rows = {
        (e.strategy, e.data, e.model, e.stage): e.total_bytes for e in plan_memory(p, n, precision)
    }
    assert rows == pytest.approx(
        {
            ("DP", 8, 1, 1): s * p,
            ("ZeRO-1", 8, 1, 1): pytest.approx(
                (STATE_BYTES[precision].params + STATE_BYTES[precision].grads) * p
                + (STATE_BYTES[precision].master + STATE_BYTES[precision].optimizer) * p / 8
            ),
            ("ZeRO-2", 8, 1, 1): pytest.approx(
                STATE_BYTES[precision].params * p + (s - STATE_BYTES[precision].params) * p / 8
            ),
            ("FSDP", 8, 1, 1): s * p / 8,
            ("TP", 1, 8, 1): s * p / 8,
            ("PP", 1, 1, 8): s * p / 8,
            ("DP×TP", 4, 2, 1): s * p / 2,
            ("FSDP×TP", 4, 2, 1): s * p / 8,
            ("DP×TP", 2, 4, 1): s * p / 4,
            ("FSDP×TP", 2, 4, 1): s * p / 8,
            ("DP×PP", 4, 1, 2): s * p / 2,
            ("FSDP×PP", 4, 1, 2): s * p / 8,
            ("DP×PP", 2, 1, 4): s * p / 4,
            ("FSDP×PP", 2, 1, 4): s * p / 8,
        }
    )


def test_components_sum_to_total():
    e = estimate(1e9, "bf16", data=4, model=2, shard_data=True)
    assert e.strategy == "FSDP×TP"
    assert (e.params_bytes, e.grads_bytes, e.master_bytes, e.optimizer_bytes) == (
        4e9 / 8,
        4e9 / 8,
        0,
        8e9 / 8,
    )
    assert e.total_bytes == 16e9 / 8


def test_seven_billion_dp_does_not_fit_an_h100_but_fsdp_does():
    memory = HARDWARE_SPECS[HardwareType.H100].memory_bytes
    dp, zero1, zero2, fsdp = plan_memory(7e9, 8, "bf16")[:4]
    assert dp.total_bytes > zero1.total_bytes > zero2.total_bytes > fsdp.total_bytes
    assert dp.total_bytes == 112e9 > memory
    assert fsdp.total_bytes == 14e9 < memory


def test_one_device_is_dp_only():
    assert [e.strategy for e in plan_memory(1e6, 1)] == ["DP"]
    assert [(e.data, e.model, e.stage) for e in plan_memory(1e6, 6)] == [
        (6, 1, 1),
        (6, 1, 1),
        (6, 1, 1),
        (6, 1, 1),
        (1, 6, 1),
        (1, 1, 6),
        (3, 2, 1),
        (3, 2, 1),
        (2, 3, 1),
        (2, 3, 1),
        (3, 1, 2),
        (3, 1, 2),
        (2, 1, 3),
        (2, 1, 3),
    ]


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="precision must be one of"):
        state_bytes("int8")
    with pytest.raises(ValueError, match="num_params must be a finite number > 0, got -1"):
        estimate(-1)
    with pytest.raises(ValueError, match="data must be an integer >= 1, got 0"):
        estimate(1e6, data=0)
    with pytest.raises(ValueError, match="stage must be an integer >= 1, got 0"):
        estimate(1e6, stage=0)
    with pytest.raises(ValueError, match="num_devices must be an integer >= 1"):
        plan_memory(1e6, 0)


def test_critical_batch_is_peak_over_bandwidth_in_bf16():
    assert critical_batch_size(1e12, 1e10) == 100.0
    assert critical_batch_size(1e12, 1e10, bytes_per_param=4) == 200.0
    with pytest.raises(ValueError, match="hbm_bandwidth must be > 0, got 0"):
        critical_batch_size(1e12, 0)


@pytest.mark.parametrize("hw", list(HARDWARE_SPECS))
def test_hardware_roofline_uses_the_datasheet(hw):
    spec = HARDWARE_SPECS[hw]
    roof = hardware_roofline(hw)
    assert roof.critical_batch == pytest.approx(spec.peak_flops / spec.hbm_bandwidth)
    assert roof.critical_batch == pytest.approx(spec.critical_intensity)


def test_h100_roofline_is_near_the_seed_table():
    # The seed's table gives 298 for the H100; 989 TFLOP/s ÷ 3.35 TB/s = 295.
    assert math.isclose(hardware_roofline("h100").critical_batch, 298, rel_tol=0.02)


@pytest.mark.parametrize("hw", ["cpu", "unknown"])
def test_no_figures_no_roofline(hw):
    with pytest.raises(ValueError, match=f"hardware '{hw}' has no peak FLOP/s"):
        hardware_roofline(hw)


def test_knee_is_smallest_batch_within_tolerance_of_peak():
    from shardax.cost.roofline import knee_batch_size

    batches = [8, 16, 32, 64, 128]
    # Step time flat until 32 (memory-bound), then linear (compute-bound): peak from 32 on.
    times = [1.0, 1.0, 1.0, 2.0, 4.0]
    assert knee_batch_size(batches, times) == 32
    # Throughputs 8, 16, 29.1, 32, 32: 29.1 is within 10% of 32, 16 is not.
    assert knee_batch_size(batches, [1.0, 1.0, 1.1, 2.0, 4.0]) == 32
    assert knee_batch_size(batches, [1.0, 1.0, 1.1, 2.0, 4.0], tolerance=0.0) == 64
    # Order does not matter; a tolerance of 50% reaches down to 16.
    assert knee_batch_size(batches[::-1], times[::-1], tolerance=0.5) == 16


def test_knee_rejects_bad_input():
    from shardax.cost.roofline import knee_batch_size

    with pytest.raises(ValueError, match="equal length, got 2 and 1"):
        knee_batch_size([1, 2], [1.0])
    with pytest.raises(ValueError, match="tolerance must be in"):
        knee_batch_size([1], [1.0], tolerance=1.5)
    with pytest.raises(ValueError, match="step_seconds must all be > 0"):
        knee_batch_size([1], [0.0])


@pytest.mark.parametrize("precision", list(STATE_BYTES))
def test_zero_gathered_forward_splits_the_params_too(precision):
    """sx.zero1(mesh, gather="forward") keeps the params split (the master): only the
    gradients stay whole under ZeRO-1, nothing under ZeRO-2."""
    p, n, row = 7e9, 8, STATE_BYTES[precision]
    one = estimate(p, precision, data=n, zero=1, gather="forward")
    two = estimate(p, precision, data=n, zero=2, gather="forward")
    assert one.strategy == "ZeRO-1 (gather forward)"
    assert one.total_bytes == pytest.approx(row.grads * p + (row.total - row.grads) * p / n)
    assert two.total_bytes == pytest.approx(row.total * p / n)
    assert one.params_bytes == estimate(p, precision, data=n, zero=1).params_bytes / n


def test_zero_gather_is_checked():
    with pytest.raises(ValueError, match="gather must be 'update' or 'forward', got 'start'"):
        estimate(1e9, data=8, zero=1, gather="start")
    with pytest.raises(ValueError, match=r"ZeRO-1/2 setting .* got zero=3"):
        estimate(1e9, data=8, shard_data=True, gather="forward")
