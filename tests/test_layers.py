"""The package's rules as tests: imports point down the layer list, and close no cycle.

The layers, top to bottom (a module may import its own layer and those below it):
cli, artifex, models, checkpoint, train, data, parallel, plan, mesh, cost, runtime,
track, checks. Only the CLI and the package's ``__init__`` import ``shardax`` itself
(which pulls in every layer).
"""

import ast
import pathlib

import shardax as sx

SRC = pathlib.Path(sx.__file__).parent
LAYERS = ["cli", "artifex", "models", "checkpoint", "train", "data", "parallel", "plan",
          "mesh", "cost", "runtime", "track", "checks"]  # fmt: skip


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ("shardax", *path.relative_to(SRC).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text())
    return out


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The shardax modules ``tree`` imports, at any depth (function-level imports too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("shardax")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardax"):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found |= (subs & known) or {node.module}
    return found


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else "shardax"


def test_every_module_is_in_a_layer():
    assert {layer(m) for m in modules()} - {"shardax", "__main__"} <= set(LAYERS)


def test_no_import_points_up_the_layer_list():
    mods = modules()
    upward = []
    for name, tree in mods.items():
        src = layer(name)
        for dst_module in imports(tree, set(mods)):
            dst = layer(dst_module)
            if dst_module == "shardax":
                if src not in ("cli", "shardax", "__main__"):
                    upward.append(f"{name} imports shardax (the whole package)")
            elif src in LAYERS and dst in LAYERS and LAYERS.index(dst) < LAYERS.index(src):
                upward.append(f"{name} ({src}) imports {dst_module} ({dst})")
    assert not upward, "imports that point up the layer list:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    mods = modules()
    graph = {
        name: {d for d in imports(tree, set(mods)) if d in mods and d != "shardax"}
        for name, tree in mods.items()
    }
    # A subpackage's __init__ re-exports its modules: it depends on them, not they on it.
    for name in graph:
        graph[name] = {d for d in graph[name] if not name.startswith(d + ".")}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_public_names_are_pinned():
    """``shardax.__all__`` is the public face the guides use; a change here is deliberate."""
    assert sorted(sx.__all__) == sorted(PUBLIC)
    assert all(hasattr(sx, name) for name in sx.__all__)


def test_the_seed_api_is_importable_from_shardax_and_lives_in_one_module():
    from shardax import artifex

    for name in artifex.__all__:
        assert getattr(sx, name) is getattr(artifex, name)


PUBLIC = [
    "AutoPlanOptions", "BatchSizeRecommendation", "CheckpointManager", "DataParallel",
    "DeviceMeshManager", "DevicePlacement", "DistributedMetrics", "HardwareType",
    "MetricWriter", "NonFiniteLossError", "Plan", "Precision", "Preempted", "StepWatchdog",
    "TrainState", "attention", "auto_plan", "batch_sharding", "batches", "compile_cache",
    "constrain",
    "describe", "distribute_batch", "from_linen", "from_nnx", "fsdp",
    "get_batch_size_recommendation", "global_batch", "initialize", "is_main_process",
    "make_eval_step", "make_mesh", "make_train_step", "masked_mean", "moe", "pipeline",
    "pipeline_1f1b", "place_on_device", "prefetch_to_device", "prepare", "print0", "remat",
    "replicate", "restore_checkpoint", "rules", "save_checkpoint", "shard", "verify",
    "watch_preemption", "zero1", "zero2",
]  # fmt: skip
