"""What a newcomer trips on, the small points (issue 52): `shardax --version`, piped output's
width from `COLUMNS`, the sharding table at 80 columns, H200 and B200 in `info` and `plan
--hardware`, and `bench`'s caveat on simulated devices."""

import argparse
import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardax as sx
from shardax._format import rich_text
from shardax.cli import bench, digits, info
from shardax.cli.common import UsageError, console
from shardax.cli.main import build_parser
from shardax.cli.main import main as cli
from shardax.cli.plan import make_plan


def test_version_names_shardax_jax_and_python(capsys):
    with pytest.raises(SystemExit) as done:
        cli(["--version"])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"shardax {sx.__version__} (jax {jax.__version__}, Python 3.")
    assert sx.__version__ == importlib.metadata.version("shardax")  # pyproject's version


def test_piped_output_is_as_wide_as_columns_says(monkeypatch):
    args = argparse.Namespace(json=False)
    monkeypatch.delenv("COLUMNS", raising=False)
    assert console(args).width == 120  # piped (pytest's stdout), no COLUMNS
    monkeypatch.setenv("COLUMNS", "87")
    assert console(args).width == 87
    monkeypatch.setenv("COLUMNS", "wide")
    with pytest.raises(UsageError, match=r"\$COLUMNS: expected an integer >= 1, got 'wide'"):
        console(args)


def test_the_sharding_table_keeps_paths_whole_and_specs_on_one_line(mesh_2d):
    long = "attention_with_a_long_name/query_projection/kernel"
    tree = {"blocks": {long: jnp.zeros((4, 16, 8, 2))}, "up": jnp.zeros((16, 64))}
    placed = jax.device_put(tree, sx.fsdp(mesh_2d)(tree))
    text = rich_text(sx.describe(placed), 80)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    spec = str(tuple(placed["blocks"][long].sharding.spec))
    assert spec.count("'") == 2 and any(spec in line for line in text.splitlines())
    folded = "".join(line.split("│")[1].strip() for line in text.splitlines() if "│" in line)
    assert f"blocks/{long}" in folded  # the path whole, folded over lines


def test_info_and_plan_know_the_h200_and_b200():
    table = {row["hardware"]: row for row in info.collect(None)["batch_size_table"]}
    assert table["h200"]["peak_flops"] == 989e12 and table["b200"]["hbm_bandwidth"] == 8000e9
    assert table["b200"]["roofline_critical_batch"] == pytest.approx(2250e12 / 8000e9)
    assert table["h200"]["critical_batch_size"] is None  # not in the recommendation table
    plan = make_plan(7e9, 8, "h200")
    assert plan["device_memory_bytes"] == 143771 * 2**20
    assert not [w for w in plan["warnings"] if "no memory figure" in w or "no roofline" in w]
    assert plan["roofline"]["critical_batch"] == pytest.approx(989e12 / 4800e9)
    args = build_parser(["plan"]).parse_args(["plan", "--params", "7e9", "--hardware", "b200"])
    assert args.hardware == "b200"


def test_bench_says_simulated_devices_measure_no_speedup(mesh, capsys):
    caveat = bench.simulated_caveat(mesh)
    assert "8 devices are simulated CPU devices" in caveat and "not a speed-up" in caveat
    args = build_parser(["bench"]).parse_args(["bench", "--size", "seed"])
    assert args.size == "large"  # the old name still works, with a warning
    assert "shardax: warning: --size seed is now --size large" in capsys.readouterr().err


def test_the_digits_are_read_as_scikit_learn_reads_them_without_importing_it(monkeypatch):
    """The MLP job reads scikit-learn's own digits file (no import of scikit-learn and
    SciPy at each start); the split equals the one from ``sklearn.datasets.load_digits``."""

    def no_import(module, *_):
        raise AssertionError(f"imported {module}")

    with monkeypatch.context() as patched:
        patched.setattr(digits, "require", no_import)
        read = digits.load_digits(7)
    monkeypatch.setattr(digits, "digits_file", lambda: None)  # scikit-learn's own loader
    loaded = digits.load_digits(7)
    assert [a.shape for a in read] == [(1437, 64), (1437,), (360, 64), (360,)]
    for a, b in zip(read, loaded, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
