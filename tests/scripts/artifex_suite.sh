#!/usr/bin/env bash
# Runs artifex's own distributed test suite, unedited, against shardax's seed facades.
#
# Usage: tests/scripts/artifex_suite.sh ARTIFEX_GIT_DIR [REV] [-- pytest args...]
#   ARTIFEX_GIT_DIR  a clone of https://github.com/avitai/artifex (a bare one will do)
#   REV              the commit to take the tests from (default HEAD)
#   SHARDAX_VENV=.venv-py312 with SHARDAX_PYTHON=/path/to/python3.12 runs the second CI leg.
#   EXCLUDE_MOCKED_LAX=1 deselects the tests that mock.patch("jax.lax...") (issue 11 leaves
#   them out: they replace the collective and check that it was called, not what it computes).
#
# The tests are copied into a temporary directory beside a shim package `artifex` whose
# `generative_models.training.distributed` modules re-export shardax's facades; nothing of
# artifex's is kept. artifex's conftest runs the tests in place when JAX sees more than one
# device: _ARTIFEX_MULTIDEVICE_SUBPROCESS=1 makes it set
# --xla_force_host_platform_device_count=$JAX_CPU_DEVICE_COUNT (its default, 4) at import.
set -euo pipefail
repo=${1:?usage: $0 ARTIFEX_GIT_DIR [REV] [-- pytest args...]}
shift
rev=HEAD
if [[ $# -gt 0 && $1 != -- ]]; then rev=$1; shift; fi
[[ ${1:-} == -- ]] && shift
shardax=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

suite=tests/artifex/generative_models/training/distributed
git -C "$repo" archive "$rev" "$suite" | tar -x -C "$tmp"
mv "$tmp/$suite" "$tmp/distributed"
echo "artifex $(git -C "$repo" rev-parse "$rev"): $(ls "$tmp"/distributed/test_*.py | wc -l) test files"

shim=$tmp/artifex/generative_models/training/distributed
mkdir -p "$shim"
touch "$tmp/artifex/__init__.py" "$tmp/artifex/generative_models/__init__.py" \
  "$tmp/artifex/generative_models/training/__init__.py"
placement="BatchSizeRecommendation, DevicePlacement, HardwareType, distribute_batch, \
get_batch_size_recommendation, place_on_device"
echo "from shardax import DataParallel, DeviceMeshManager, DistributedMetrics, $placement" \
  >"$shim/__init__.py"
echo "from shardax import DeviceMeshManager" >"$shim/mesh.py"
echo "from shardax import DataParallel" >"$shim/data_parallel.py"
echo "from shardax import DistributedMetrics" >"$shim/metrics.py"
echo "from shardax import $placement" >"$shim/device_placement.py"
printf '[pytest]\n' >"$tmp/pytest.ini"

export _ARTIFEX_MULTIDEVICE_SUBPROCESS=1 JAX_CPU_DEVICE_COUNT=${JAX_CPU_DEVICE_COUNT:-4}
export JAX_PLATFORMS=cpu PYTHONPATH="$tmp${PYTHONPATH:+:$PYTHONPATH}"
cd "$shardax"
run=(uv run)
if [[ -n ${SHARDAX_VENV:-} ]]; then
  export UV_PROJECT_ENVIRONMENT=$SHARDAX_VENV
  run=(uv run --python "${SHARDAX_PYTHON:?set SHARDAX_PYTHON with SHARDAX_VENV}")
fi
deselect=()
if [[ ${EXCLUDE_MOCKED_LAX:-0} == 1 ]]; then
  mapfile -t ids < <("${run[@]}" python - "$tmp" <<'EOF'
import ast, pathlib, sys
root = pathlib.Path(sys.argv[1])
for path in sorted((root / "distributed").glob("test_*.py")):
    for cls in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            if "mock.patch('jax.lax." in ast.unparse(fn):
                print(f"{path.relative_to(root)}::{cls.name}::{fn.name}")
EOF
  )
  for id in "${ids[@]}"; do deselect+=(--deselect "$id"); done
  echo "deselected ${#ids[@]} tests that mock jax.lax"
fi
"${run[@]}" pytest -c "$tmp/pytest.ini" --rootdir "$tmp" "$tmp/distributed" \
  -p no:cacheprovider "${deselect[@]}" "$@"
