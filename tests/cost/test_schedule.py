"""shardax.cost.schedule on hand-written scheduled HLO: async pairs and what runs between
their start and done, synchronous ops, async wrappers, loop bodies, and the exposed time."""

import pytest

from shardax.cost.schedule import exposed_seconds, schedule

HLO = """HloModule m

%fused_dot (a: bf16[64,256], b: bf16[256,128]) -> bf16[64,128] {
  %a = bf16[64,256]{1,0} parameter(0)
  %b = bf16[256,128]{1,0} parameter(1)
  ROOT %d = bf16[64,128]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%wrapped_rs (g: f32[64,128]) -> f32[8,128] {
  %g = f32[64,128]{1,0} parameter(0)
  ROOT %rs = f32[8,128]{1,0} reduce-scatter(%g), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

%body (t: (s32[], bf16[64,256])) -> (s32[], bf16[64,256]) {
  %t = (s32[], bf16[64,256]{1,0}) parameter(0)
  %x = bf16[64,256]{1,0} get-tuple-element(%t), index=1
  %ar = bf16[64,256]{1,0} all-reduce(%x), replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %r = (s32[], bf16[64,256]{1,0}) tuple(%i, %ar)
}

ENTRY %main (p: bf16[32,128], x: bf16[64,256]) -> f32[8,128] {
  %p = bf16[32,128]{1,0} parameter(0)
  %x = bf16[64,256]{1,0} parameter(1)
  %ag = (bf16[32,128]{1,0}, bf16[256,128]{1,0}) all-gather-start(%p), replica_groups=[1,8]<=[8], dimensions={0}
  %y = bf16[64,128]{1,0} fusion(%x, %w0), kind=kCustom, calls=%fused_dot
  %c = bf16[64,256]{1,0} copy(%x)
  %agd = bf16[256,128]{1,0} all-gather-done(%ag)
  %w = bf16[256,128]{1,0} bitcast(%agd)
  %z = bf16[64,128]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %g = f32[64,128]{1,0} convert(%z)
  %rss = ((f32[64,128]{1,0}), f32[8,128]{1,0}) async-start(%g), calls=%wrapped_rs
  %rsd = f32[8,128]{1,0} async-done(%rss)
  %loop = (s32[], bf16[64,256]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,128]{1,0} add(%rsd, %rsd)
}
"""  # noqa: E501


def test_pairs_wrappers_and_synchronous_ops_in_schedule_order():
    ag, ar, rs = sorted(schedule(HLO, 8), key=lambda c: c.op)
    # The all-gather: its result (not its operand) counted; a matmul fusion and a copy
    # run between start and done; its first use is the matmul after its bitcast.
    assert (ag.op, ag.dtypes, ag.bytes, ag.synchronous) == ("all-gather", ("bf16",), 65536, False)
    assert (ag.start, ag.done, ag.first_use) == (2, 5, 7)
    assert ag.ops_between == 2 and ag.flops_between == 2 * 64 * 128 * 256 and ag.overlapped
    # The reduce-scatter an async-start wraps: async, nothing between.
    assert (rs.op, rs.dtypes, rs.synchronous, rs.ops_between, rs.overlapped) == (
        "reduce-scatter", ("f32",), False, 0, False)  # fmt: skip
    assert rs.first_use == 12  # the ROOT add
    # The loop body's all-reduce: synchronous, run once per trip.
    assert (ar.computation, ar.synchronous, ar.collective.count) == ("body", True, 3)
    assert ar.start == ar.done and not ar.overlapped


def test_exposed_time_is_the_wire_time_left_after_the_matmuls_between():
    ag, ar, rs = sorted(schedule(HLO, 8), key=lambda c: c.op)
    flops = ag.flops_between
    assert exposed_seconds(ag, wire_seconds=1.0, flop_rate=flops / 0.25) == pytest.approx(0.75)
    assert exposed_seconds(ag, wire_seconds=1.0, flop_rate=flops / 2) == 0.0  # clamped
    assert exposed_seconds(rs, wire_seconds=1.0, flop_rate=1e15) == 1.0  # nothing between
    assert exposed_seconds(ar, wire_seconds=1.0, flop_rate=1e15) == 3.0  # synchronous, 3 trips


ASYNC_FUSIONS = """HloModule m

%fused_dot (a: bf16[64,256], b: bf16[256,128]) -> bf16[64,128] {
  %a = bf16[64,256]{1,0} parameter(0)
  %b = bf16[256,128]{1,0} parameter(1)
  ROOT %d = bf16[64,128]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%ds_rs (g: f32[64,128], i: s32[]) -> f32[8,128] {
  %g = f32[64,128]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %s = f32[64,128]{1,0} dynamic-slice(%g, %i, %i), dynamic_slice_sizes={64,128}
  ROOT %rs = f32[8,128]{1,0} reduce-scatter(%s), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (p: bf16[32,128], x: bf16[64,256], w: bf16[256,128], g: f32[64,128], i: s32[]) -> f32[8,128] {
  %p = bf16[32,128]{1,0} parameter(0)
  %x = bf16[64,256]{1,0} parameter(1)
  %w = bf16[256,128]{1,0} parameter(2)
  %g = f32[64,128]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %ag = (bf16[32,128]{1,0}, bf16[256,128]{1,0}) all-gather-start(%p), replica_groups=[1,8]<=[8], dimensions={0}
  %mm = ((bf16[64,256]{1,0}, bf16[256,128]{1,0}), bf16[64,128]{1,0}, u32[]) fusion-start(%x, %w), kind=kCustom, calls=%fused_dot
  %mmd = bf16[64,128]{1,0} fusion-done(%mm)
  %agd = bf16[256,128]{1,0} all-gather-done(%ag)
  %rss = ((f32[64,128]{1,0}, s32[]), f32[8,128]{1,0}, u32[]) fusion-start(%g, %i), kind=kCustom, calls=%ds_rs
  %rsd = f32[8,128]{1,0} fusion-done(%rss)
  ROOT %out = f32[8,128]{1,0} add(%rsd, %rsd)
}
"""  # noqa: E501


def test_async_fusions_are_compute_and_a_collective_in_one_is_async():
    """XLA:GPU runs some fusions asynchronously (``fusion-start`` / ``fusion-done``): a
    matmul in one covers the collective in flight, and a collective inside one (a
    dynamic-slice fusion around a reduce-scatter) is async, not read from the fusion's
    body as a synchronous op."""
    ag, rs = sorted(schedule(ASYNC_FUSIONS, 8), key=lambda c: c.op)
    assert (ag.ops_between, ag.flops_between) == (1, 2 * 64 * 128 * 256) and ag.overlapped
    assert (rs.op, rs.computation, rs.synchronous) == ("reduce-scatter", "main", False)
    assert (rs.start, rs.done, rs.first_use) == (9, 10, 11)
    # A collective's start reading another's result is its first use.
    fed = ASYNC_FUSIONS.replace("fusion-start(%g, %i)", "fusion-start(%agd, %i)")
    ag, _ = sorted(schedule(fed, 8), key=lambda c: c.op)
    assert ag.first_use == 9


def test_one_program_is_read_once_for_every_analysis():
    """The analyses of one compiled step (collectives, FLOPs, schedule, per-op price)
    share one reading of its text and one call graph (``shardax.cost.hlo.program``)."""
    from shardax.cost.flops import hlo_flops
    from shardax.cost.hlo import collectives, program

    program._read.cache_clear()
    scheduled = schedule(HLO, 8)
    bodies, _ = program.computations(HLO)
    graph = program.call_graph(bodies)
    ops = sorted(c.op for c in collectives(HLO, 8))
    assert hlo_flops(HLO) > 0 and sorted(c.collective.op for c in scheduled) == ops
    assert program.computations(HLO)[0] is bodies and program.call_graph(bodies) is graph
    assert program._read.cache_info().misses == 1
