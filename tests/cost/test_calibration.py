"""Calibrations as data: the shipped tables are the GPU sessions' measurements, a user's
``shardax calibrate`` file loads and registers for its kind, and bad tables are refused
by name."""

import dataclasses
import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax.cli.main import main as cli
from shardax.cost import calibrate, measurements
from shardax.cost.calibration import (
    CALIBRATIONS,
    H100,
    H200,
    TABLES,
    calibration_for,
    load,
    register,
    using,
)
from shardax.cost.estimation import analyse
from shardax.cost.figures import measured_spec
from shardax.cost.hardware import device_spec
from shardax.cost.measurements import from_tables

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("shipped", sorted(TABLES.glob("*.json")), ids=lambda p: p.name)
def test_shipped_tables_are_what_the_gpu_session_measured(shipped):
    """Each shipped file names the session record it came from; read from that record,
    the tables are the same, figure for figure (no hand transcription)."""
    mine = load(shipped)
    record = re.match(r"(benchmarks/gpu/results/\S+/session\.json)", mine.source).group(1)
    measured = load(ROOT / record)
    fields = ("kind", "jax", "gemm", "stream", "reduce", "attention", "launch_us", "dispatch_us",
              "collectives")  # fmt: skip
    for field in fields:
        assert getattr(mine, field) == getattr(measured, field), field
    assert shipped.name == f"{mine.kind.lower()}-{mine.date}.json" and mine.derived is None
    assert mine.peak_flops == 989e12  # the datasheet's dense bf16 peak (H100, H200)
    latest = max(TABLES.glob(f"{mine.kind.lower()}-*.json"))  # the latest date is used
    assert CALIBRATIONS[mine.kind] == load(latest)


def test_shipped_kinds_and_their_rows():
    assert (H200.device, H100.device) == ("NVIDIA H200", "NVIDIA H100 80GB HBM3")
    assert len(H200.gemm) == 12 and {r[3] for r in H200.gemm} == {"bf16"}
    assert {r[3] for r in H100.gemm} == {"bf16", "f32"} and len(H100.attention) == 12
    assert len(H100.reduce) == 4 and H200.reduce == () and H100.collectives == ()  # one GPU
    assert H100.stream == tuple(sorted(H100.stream))
    assert H100.launch_us == pytest.approx(1.297, 1e-3)
    assert calibration_for("NVIDIA H100 80GB HBM3") is H100 and calibration_for("cpu") is None


@pytest.fixture(scope="module")
def measured_here():
    """``shardax calibrate``'s tables measured on this CPU (small shapes)."""
    return calibrate.tables(quick=True)


def test_tables_measured_here_load_as_a_calibration(measured_here):
    t = measured_here
    assert t["quick"] is True and t["device"] == "cpu" and re.match(r"\d{4}-\d\d-\d\d", t["date"])
    keys = ["dispatch_waited", "per_kernel", "one_kernel_program"]
    assert [r["key"] for r in t["launch"]] == keys
    c = from_tables({**t, "quick": False, "platform": "gpu"})  # as if a GPU's
    assert c.kind == "cpu" and c.device == "cpu" and c.date == t["date"]
    gemms = [r for name in ("gemm", "gemm_f32", "gemm_f32_cublas") for r in t[name]]
    assert len(c.gemm) == len(gemms)
    # a CPU widens fp8 operands: no fp8 rows, the table says why, and nothing is priced by it
    assert t["gemm_fp8"]["skipped"].startswith("fp8 matmuls need fp8 tensor cores")
    assert (
        "cpu devices (cpu): XLA widens" in t["gemm_fp8"]["skipped"] and t["gemm_fp8_seconds"] == 0.0
    )
    assert calibrate.summary(t)["fp8_matmul_tflops"] is None
    assert {r[3] for r in c.gemm} == {"bf16", "f32", "f32-cublas"}
    assert c.stream == tuple(sorted(r["gbs"] for r in t["stream"]))
    # the reductions priced by: a fixed set (norms and sums), the softmax rows for reading
    four = [r["gbs"] for r in t["reduce"] if r["op"] in measurements._REDUCE_ROWS]
    assert c.reduce == tuple(sorted(four)) and len(four) == 4 and len(t["reduce"]) == 7
    assert c.launch_us == t["launch"][1]["us"] and c.dispatch_us == t["launch"][2]["us"]
    assert len(c.attention) == len(t["attention"]) and c.peak_flops > 0  # no datasheet: best GEMM
    # collectives over the 8 devices: the bytes each sends, as the cost model counts a
    # step's (ring algorithms), for a buffer of b bytes per device
    rows = t["collectives"]
    assert {(r["op"], r["devices"]) for r in rows} == {
        (op, 8) for op in ("all-reduce", "all-gather", "reduce-scatter")
    }
    sends = {"all-reduce": 2 * 7 / 8, "all-gather": 7, "reduce-scatter": 7 / 8}
    for r in rows:
        assert r["sent_bytes"] == pytest.approx(sends[r["op"]] * r["bytes"]) and r["ms"] > 0
    for op, n, latency, bandwidth in c.collectives:  # fitted where the sizes resolve a line
        assert op in sends and n == 8 and latency >= 0 and bandwidth > 0
    assert c.name == f"calibrated: cpu, JAX {t['jax']}, {t['date']}"


def test_bad_tables_are_refused_by_name(measured_here, tmp_path):
    t = {**measured_here, "quick": False, "platform": "gpu"}
    no_bf16 = [r for r in t["gemm"] if r["dtype"] != "bf16"]
    g0, a0 = t["gemm"][0], t["attention"][0]
    for tables, says in (
        ({**t, "quick": True}, "measured with --quick (small shapes: a smoke test)"),
        ({**t, "platform": "tpu"}, "measured on a tpu device; the per-op model prices GPU"),
        ({**t, "device": None}, "no 'device'"),
        ({k: v for k, v in t.items() if k != "stream"}, "the 'stream' table is missing"),
        ({**t, "stream": []}, "the 'stream' table is empty"),
        ({**t, "gemm": {"error": "XlaRuntimeError: x"}},
         "the 'gemm' table is a failure on the device (XlaRuntimeError: x)"),
        ({**t, "stream": 3}, "the 'stream' table is not a list of rows: '3'"),
        ({**t, "gemm": no_bf16 or [{**g0, "dtype": "f32"}]}, "no bf16 row that timed the kernel"),
        ({**t, "launch": t["launch"][:1]}, "the 'launch' table has no 'per_kernel' row"),
        ({**t, "stream": [{"op": "x"}]},
         "the 'stream' table's row 0 has gbs=None; it must be a finite number > 0"),
        ({**t, "gemm": [{**g0, "tflops": 0}]}, "row 0 has tflops=0; it must be a finite number"),
        ({**t, "gemm": [{**g0, "tflops": float("nan")}]}, "row 0 has tflops=nan"),
        ({**t, "attention": [{**a0, "causal": "false"}]},
         "the 'attention' table's row 0 has causal='false'; it must be true or false"),
        ({**t, "attention": [{**a0, "pass": "bwd"}]}, "pass='bwd'; it must be one of ['fwd'"),
        ([1, 2], "a JSON object of tables"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(says)):
            from_tables(tables, where="t.json")
    record = tmp_path / "session.json"
    record.write_text(json.dumps({"core": {"device": "NVIDIA H100 80GB HBM3"}}))
    with pytest.raises(ValueError, match=r"a session record without core\.calibration"):
        load(record)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"calibration '.*bad\.json': not a JSON file"):
        load(bad)
    with pytest.raises(ValueError, match=r"calibration '.*none\.json': no such file"):
        load(tmp_path / "none.json")
    with pytest.raises(TypeError, match="a Calibration"):
        register("h100.json")


def test_a_users_tables_register_for_their_kind_and_are_restored(tmp_path):
    mine = tmp_path / "h100.json"
    tables = json.loads((TABLES / "h100-2026-11-27.json").read_text())
    mine.write_text(json.dumps({**tables, "date": "2026-12-01", "source": "my lab"}))
    c = load(mine)
    assert c.name == "calibrated: H100, JAX 0.11.2, 2026-12-01" and c.source == "my lab"
    with using(c) as active:
        assert active is c and calibration_for("NVIDIA H100 80GB HBM3") is c
    assert calibration_for("NVIDIA H100 80GB HBM3") is H100
    l4 = from_tables({**tables, "device": "NVIDIA L4"})  # a kind nothing ships for
    with using(l4):
        assert calibration_for("NVIDIA L4") is l4 and "NVIDIA L4" not in CALIBRATIONS
        with using(c):  # nested: both
            assert calibration_for("NVIDIA L4") is l4
            assert calibration_for("NVIDIA H100 80GB HBM3") is c
        assert calibration_for("NVIDIA H100 80GB HBM3") is H100
    assert calibration_for("NVIDIA L4") is None
    with using(None) as nothing:
        assert nothing is None and calibration_for("NVIDIA H100 80GB HBM3") is H100
    with (
        pytest.raises(TypeError, match=r"using\(calibration\): a Calibration .* got str"),
        using(str(mine)),
    ):
        pass


def test_using_is_this_threads_and_register_the_processs(tmp_path):
    """Two threads estimating at once with their own tables do not see each other's:
    ``using`` holds for its block in its own thread; ``register`` for every thread."""
    tables = json.loads((TABLES / "h100-2026-11-27.json").read_text())
    mine = from_tables({**tables, "date": "2026-12-01"})
    entered, checked = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        entered.wait(30)
        seen["during"] = calibration_for("NVIDIA H100 80GB HBM3")
        checked.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with using(mine):
        entered.set()
        assert checked.wait(30) and calibration_for("NVIDIA H100 80GB HBM3") is mine
    worker.join(30)
    assert seen["during"] is H100
    try:
        assert register(mine) is H100
        seen.clear()
        worker = threading.Thread(target=lambda: seen.update(after=calibration_for("H100")))
        worker.start()
        worker.join(30)
        assert seen["after"] is mine
    finally:
        register(H100)


def test_cli_calibrate_writes_tables_and_refuses_a_cpu_without_quick(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert cli(["calibrate", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(--quick: a smoke test)" in printed and f"wrote {out}" in printed
    written = json.loads(out.read_text())
    assert written["quick"] is True and written["device"] == "cpu"
    assert "fp8 tensor cores" in written["gemm_fp8"]["skipped"] and "gemm_fp8" in printed
    assert all(
        isinstance(written[k], list) and written[k]
        for k in ("gemm", "gemm_f32", "gemm_f32_cublas", "stream", "reduce", "attention", "launch")
    )
    with pytest.raises(ValueError, match="measured with --quick"):
        load(out)  # it prices nothing
    assert cli(["calibrate", "--quick", "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    for argv, says in (
        (["calibrate"], "this process's devices are cpu devices: run shardax calibrate on"),
        (["calibrate", "--quick", "--out", str(out)], f"--out {out}: exists; --force replaces"),
        (["calibrate", "--quick", "--out", str(tmp_path)], f"--out {tmp_path}: is a directory"),
        (["calibrate", "--quick", "--out", str(tmp_path / "no" / "x.json")], "does not exist"),
    ):  # fmt: skip
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err


def test_a_gpu_with_no_datasheet_is_priced_by_its_registered_calibration():
    """A GPU kind no datasheet row names (an L4) gets a predicted time once its tables
    are registered: its peak and bandwidth are the measured ones, and the report says so.
    The program is this machine's (a CPU's HLO); the devices are the GPU's as JAX gives
    them (kind, platform, allocator)."""
    tables = json.loads((TABLES / "h100-2026-11-27.json").read_text())
    l4 = from_tables({**tables, "device": "NVIDIA L4", "date": "2026-12-01"})
    gpu = SimpleNamespace(platform="gpu", device_kind="NVIDIA L4", id=0, process_index=0,
                          slice_index=0, memory_stats=lambda: {"bytes_limit": 20e9})  # fmt: skip
    mesh = SimpleNamespace(devices=np.array([gpu]), shape={"data": 1})
    x = jnp.ones((512, 512), jnp.bfloat16)
    compiled = jax.jit(lambda a, b: a @ b).lower(x, x).compile()
    alone = analyse(compiled, mesh)
    assert alone.roofline is None and alone.per_op is None and alone.to_dict()["prediction"] is None
    assert any("'shardax calibrate' measures this GPU's tables" in n for n in alone.notes)
    with using(l4):
        report = analyse(compiled, mesh)
    assert report.roofline is not None and report.hbm_bytes == 20e9
    assert report.per_op.calibration == "calibrated: NVIDIA L4, JAX 0.11.2, 2026-12-01"
    assert report.per_op.classes["gemm"].flops == 2 * 512**3
    (note,) = [n for n in report.notes if n.startswith("no datasheet")]
    assert f"peak {l4.peak_flops:.3g} FLOP/s (the best GEMM rate measured; MFU counts" in note
    assert "memory 18.6 GiB (the allocator's budget)" in note
    assert l4.peak_flops == max(r[4] for r in l4.gemm) * 1e12
    # The prediction is the per-op model's, under one name, as the docs' JSON example shows
    predicted = report.to_dict()["prediction"]
    assert predicted["model"] == "per-op" and predicted["step_s"] == report.per_op.step_s
    assert (predicted["low_s"], predicted["high_s"]) == report.interval_s
    assert set(predicted) == set(_docs_json_example()["estimate"]["prediction"])
    assert report.to_dict()["roofline_guide"]["step_s_overlapped"] == report.roofline.overlapped_s
    for old, new in (("prediction", "roofline"), ("cost", "per_op")):
        with pytest.warns(
            DeprecationWarning, match=rf"^sx\.cost\.Estimate\.{old} is now .*{new}"
        ) as seen:
            assert getattr(report, old) is getattr(report, new)
        assert seen[0].filename == __file__  # the user's line: the default filters show it


def _docs_json_example() -> dict:
    """The ``--json`` example of docs/guides/plan-a-cluster.md."""
    page = (Path(__file__).parents[2] / "docs/guides/plan-a-cluster.md").read_text()
    return json.loads(page.split("```json\n", 1)[1].split("```", 1)[0])


def test_measured_figures_are_the_same_on_every_process_and_a_datasheet_wins():
    """Another process's device gives no allocator figures: this process's device of the
    kind stands in (every process plans alike). Collectives measured over a host give the
    link within it. A kind with a datasheet row keeps the datasheet's figures."""
    tables = json.loads((TABLES / "h100-2026-11-27.json").read_text())
    fits = (("all-gather", 8, 2e-5, 3.0e11), ("all-reduce", 8, 3e-5, 2.0e11),
            ("reduce-scatter", 8, 2e-5, 2.5e11))  # fmt: skip
    l4 = dataclasses.replace(from_tables({**tables, "device": "NVIDIA L4"}), collectives=fits)

    def not_mine() -> None:
        raise RuntimeError("FAILED_PRECONDITION: not an addressable device")

    mine = SimpleNamespace(platform="gpu", device_kind="NVIDIA L4",
                           memory_stats=lambda: {"bytes_limit": 2e10})  # fmt: skip
    theirs = SimpleNamespace(platform="gpu", device_kind="NVIDIA L4", memory_stats=not_mine,
                             client=SimpleNamespace(local_devices=lambda: [mine]))  # fmt: skip
    with using(l4):
        here, there = measured_spec(mine), measured_spec(theirs)
        h100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                               memory_stats=lambda: {"bytes_limit": 2e10})  # fmt: skip
        with using(dataclasses.replace(H100, peak_flops=1e12)):
            assert (device_spec(h100) or measured_spec(h100)) is device_spec(h100)
    assert here == there and here.memory_bytes == 2e10 and here.ici_bandwidth == 2.5e11
    assert here.dcn_bandwidth is None and here.source == f"measured: {l4.name}"
    cpu = SimpleNamespace(platform="cpu", device_kind="cpu", memory_stats=lambda: {})
    assert measured_spec(cpu) is None


def test_the_use_line_says_how_a_kind_without_a_datasheet_is_priced():
    from shardax.cli.calibrate import use_line

    line = use_line("NVIDIA L4", Path("l4.json"))
    assert line.startswith("sx.cost.calibration.register(sx.cost.calibration.load('l4.json'))")
    assert "its peak and memory bandwidth are the measured ones" in line
    assert use_line("NVIDIA H100 80GB HBM3", Path("h.json")).startswith("shardax plan --target")


def test_an_fp8_row_is_refused_where_xla_compiled_no_fp8_gemm():
    """The guard against fp8 priced as a wider GEMM: XLA:CPU widens the operands to f32,
    so the row is an error naming what the GEMM took (on a Hopper GPU it takes f8e4m3fn)."""
    from shardax.cost.calibrate_fp8 import gemm_fp8

    (row,) = gemm_fp8([(128, 128, 128)], calibrate.median_seconds, calls=1)
    assert row["dtype"] == "f8" and row["operands"] == "f32" and "ms" not in row
    assert row["error"].startswith("XLA compiled no fp8 GEMM here: its GEMMs took f32")
