"""The package's rules as tests: imports point down the layer list, and close no cycle.

The layers, top to bottom (a module may import its own layer and those below it):
cli, artifex, loop, models, checkpoint, train, data, parallel, plan, mesh, cost, runtime,
track, checks, _extras (the optional extras, reached where first used), _format (the byte
formatter), _names (the public names).
Only the CLI and the package's ``__init__`` import ``shardax`` itself (which pulls in every layer).
"""

import ast
import dataclasses
import enum
import importlib
import inspect
import pathlib
import pkgutil

import shardax as sx
from shardax.checks import public_name

SRC = pathlib.Path(sx.__file__).parent
LAYERS = ["cli", "artifex", "loop", "models", "checkpoint", "train", "data", "parallel", "plan",
          "mesh", "cost", "runtime", "track", "checks", "_extras", "_format", "_names"]  # fmt: skip


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


def test_no_layer_attribute_shadows_a_submodule():
    """``shardax.train.verify`` is the module or the function, never the one hiding the
    other: a layer's ``__init__`` binds no name of one of its own modules to anything else.
    The CLI's ``main`` is the exception: ``shardax.cli:main`` is the console script's entry
    point, and ``shardax.cli.main`` its module (not a namespace users read)."""
    shadowed = []
    for name in LAYERS:
        if not (SRC / name / "__init__.py").exists():
            continue
        package = importlib.import_module(f"shardax.{name}")
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"shardax.{name}.{info.name}")
            obj = getattr(package, info.name)
            if obj is not module and (name, info.name) != ("cli", "main"):
                shadowed.append(f"shardax.{name}.{info.name}: {obj!r} hides the module")
    assert not shadowed, "modules shadowed in their layer:\n" + "\n".join(shadowed)


def test_public_names_are_pinned():
    """``shardax.__all__`` is the public face the guides use; a change here is deliberate."""
    assert sorted(sx.__all__) == sorted(PUBLIC)
    assert all(hasattr(sx, name) for name in sx.__all__)


def test_the_seed_api_is_importable_from_shardax_and_lives_in_one_module():
    from shardax import artifex

    for name in artifex.__all__:
        assert getattr(sx, name) is getattr(artifex, name)


def public_callables() -> dict[str, object]:
    """Every public function and class by the name a user writes: ``sx.<name>`` for
    ``shardax.__all__``, ``sx.<layer>.<name>`` for the rest of a layer's ``__all__``
    (exceptions, enums and constants aside: they run no code of shardax's)."""
    found = {}
    spaces = [("sx", sx)] + [
        (f"sx.{layer}", importlib.import_module(f"shardax.{layer}"))
        for layer in LAYERS
        if (SRC / layer / "__init__.py").exists() and layer not in ("cli", "models")
    ]
    for prefix, space in spaces:
        for name in space.__all__:
            obj = getattr(space, name)
            plain = inspect.isclass(obj) and issubclass(obj, BaseException | enum.Enum)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and not plain:
                found.setdefault(id(obj), (f"{prefix}.{name}", obj))
    return dict(found.values())


def methods(cls: type) -> list[str]:
    """The methods of ``cls`` that run shardax's code: public ones, and the constructor,
    call and iteration dunders (the dataclass fields and generated code aside)."""
    dunders = ("__init__", "__post_init__", "__call__", "__iter__", "__next__", "__enter__")
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    out = []
    for attr in dir(cls):
        if (attr.startswith("_") and attr not in (*dunders, "__exit__")) or attr in fields:
            continue
        raw = inspect.getattr_static(cls, attr)
        fn = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
        code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
        if code is not None and code.co_filename.startswith(str(SRC)):
            out.append(attr)
    return out


def test_every_public_callable_names_its_errors():
    """Each public function and method is a door (``shardax.checks.public``) named as the
    user writes it, so that shardax's errors in a call of it start with that name."""
    wrong = []
    for name, obj in public_callables().items():
        if public_name(obj) != name:
            wrong.append(f"{name}: {public_name(obj)}")
        for attr in methods(obj) if inspect.isclass(obj) else []:
            raw = inspect.getattr_static(obj, attr)
            got = public_name(raw.fget if isinstance(raw, property) else getattr(obj, attr))
            if not (got == name or (got or "").startswith(f"{name}.")):
                wrong.append(f"{name}.{attr}: {got}")
    assert not wrong, "not named as the user writes them:\n" + "\n".join(wrong)
    assert {"sx.fsdp", "sx.TrainState", "sx.train.TrainStep", "sx.data.Batches"} <= set(
        public_callables()
    )


PUBLIC = [
    "AutoPlanOptions", "BatchSizeRecommendation", "CheckpointManager", "DataParallel",
    "DeviceMeshManager", "DevicePlacement", "DistributedMetrics", "HardwareType",
    "MetricWriter", "NonFiniteLossError", "Plan", "Precision", "Preempted", "StepWatchdog",
    "TrainState", "attention", "auto_plan", "batch_sharding", "batches", "compile_cache",
    "constrain",
    "describe", "distribute_batch", "estimate", "explain", "from_linen", "from_nnx", "fsdp",
    "get_batch_size_recommendation", "global_batch", "initialize", "is_main_process",
    "keep_plan",
    "make_eval_step", "make_mesh", "make_train_step", "masked_mean", "moe", "pipeline",
    "pipeline_1f1b", "place_on_device", "prefetch_to_device", "prepare", "print0", "remat",
    "replicate", "restore_checkpoint", "rules", "save_checkpoint", "shard", "target", "verify",
    "watch_preemption", "zero1", "zero2", "SearchSpace", "search_plans", "DiLoCo",
]  # fmt: skip
