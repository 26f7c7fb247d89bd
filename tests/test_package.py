"""The public API: every exported name resolves, from the package itself, to the object its module defines."""

import ast
import graphlib
import importlib
import os
import subprocess
import sys

import areal_lite


def test_every_export_resolves():
    for name in areal_lite.__all__:
        obj = getattr(areal_lite, name)
        module = importlib.import_module(f"areal_lite.{areal_lite._EXPORTS[name]}")
        assert obj is getattr(module, name), name


def test_unknown_name_is_an_attribute_error():
    try:
        _ = areal_lite.no_such_thing
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_light():
    """`import areal_lite` must not pull torch in: a notebook's first cell should be instant."""
    code = "import sys, areal_lite; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_export_named_like_its_module_is_the_function():
    """`from areal_lite import train` is the function even after the module `areal_lite.kit.trainer.train` was
    imported."""
    code = (
        "import sys\nfrom areal_lite import TrainConfig\nfrom areal_lite import train\n"
        "print(callable(train) and train is sys.modules['areal_lite.kit.trainer.train'].train)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


# ---- layout: the kit-only parts live in areal_lite.kit -------------------------------------------------------------

PACKAGE = os.path.dirname(os.path.abspath(areal_lite.__file__))

# What AReaL 1.0.4 has no counterpart of, in rooms named for their job, bottom-up: a room imports only rooms below it.
# server: the embedded server, vLLM's worker extension, the launcher and its child processes; rag: the retrieval
# server; notebook: preparation, plots, viewer, checks; trainer: the loop, run folders, the demo; areal: the bridge.
KIT_ROOMS = ["server", "rag", "notebook", "trainer", "areal"]


def _modules():
    """(dotted name, whether it is a package, parsed source) of every module of areal_lite."""
    for folder, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                parts = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].split(os.sep)
                is_pkg = parts[-1] == "__init__"
                name = ".".join(parts[:-1] if is_pkg else parts)
                yield name, is_pkg, ast.parse(open(path, encoding="utf-8").read())


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:`: an import there names a type for annotations and
    never runs, so it is no arrow between modules."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _imported(name: str, is_pkg: bool, tree: ast.AST) -> set[str]:
    """Absolute names of the areal_lite modules that `name` imports at run time (relative imports resolved)."""
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}  # `from areal_lite.kit import launch`
    return {m for m in out if m.startswith("areal_lite.") and _is_module(m)}


def _is_module(dotted: str) -> bool:
    """Whether `dotted` names a module or package of areal_lite (not a name defined in one), without importing it."""
    path = os.path.join(os.path.dirname(PACKAGE), *dotted.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def test_kit_only_modules_live_in_the_kit_rooms():
    kit = os.path.join(PACKAGE, "kit")
    loose = [f for f in os.listdir(kit) if f.endswith(".py") and f != "__init__.py"]
    assert not loose, f"modules loose in areal_lite/kit/ (put each in the room of its job, {KIT_ROOMS}): {loose}"
    rooms = sorted(d for d in os.listdir(kit) if _is_module(f"areal_lite.kit.{d}"))
    assert rooms == sorted(KIT_ROOMS), rooms
    for room in KIT_ROOMS:
        assert not _is_module(f"areal_lite.{room}"), f"areal_lite.{room} is at two paths (one path per module)"
    kit_exports = {m for m in areal_lite._EXPORTS.values() if m.split(".")[0] == "kit"}
    assert all(m.split(".")[1] in KIT_ROOMS for m in kit_exports), kit_exports


def _room(dotted: str) -> str:
    """`kit.<room>` for a kit module, else the top-level package under areal_lite (`api`, `engine`, ...)."""
    parts = dotted.split(".")
    return f"kit.{parts[2]}" if parts[1] == "kit" and len(parts) > 2 else parts[1]


def test_no_kit_room_imports_a_room_above_it():
    """The rooms stack: the server is the leaf, the bridge to AReaL the top (KIT_ROOMS, bottom-up)."""
    order = {f"kit.{r}": i for i, r in enumerate(KIT_ROOMS)}
    up = set()
    for name, is_pkg, tree in _modules():
        here = _room(name) if name.count(".") >= 2 else None
        for m in _imported(name, is_pkg, tree):
            there = _room(m)
            if here in order and there in order and order[there] > order[here]:
                up.add(f"{name} -> {m}")
    assert not up, f"imports that run up the kit's rooms: {sorted(up)}"


def test_nothing_outside_the_kit_imports_it():
    """The kit is built on the AReaL-shaped modules, never the reverse: every module outside `areal_lite/kit/` stands
    without it (the package's `__init__` re-exports kit names lazily and is not counted)."""
    found = {}
    for name, is_pkg, tree in _modules():
        if name == "areal_lite" or name == "areal_lite.kit" or name.startswith("areal_lite.kit."):
            continue
        kit = {m for m in _imported(name, is_pkg, tree) if m.startswith("areal_lite.kit.")}
        if kit:
            found[name] = kit
    assert not found, f"modules outside the kit import it (move them into the kit): {found}"


def test_the_server_imports_nothing_of_the_trainer():
    """The inference server (`kit/server`, with vLLM's worker extension and the launcher) is a leaf: it runs beside
    the trainer, not on top of it, and imports only `api/` and `utils/`. What both sides need (the shared-prefix rule,
    the adapter file names) lives in `utils/`."""
    found = {}
    for name, is_pkg, tree in _modules():
        if name.startswith("areal_lite.kit.server"):
            engine = {m for m in _imported(name, is_pkg, tree) if _room(m) not in ("api", "utils", "kit.server")}
            if engine:
                found[name] = engine
    assert not found, f"server modules import more than api/ and utils/: {found}"


# The AReaL-shaped packages, bottom-up: each imports only packages below it (the kit sits on top of them all).
LAYERS = ["utils", "api", "dataset", "reward", "workflow", "infra", "engine", "experimental", "kit"]


def test_no_import_runs_up_a_layer():
    """utils is the floor (it reads api's configs by attribute; their classes are imported for annotations only), the
    config schema and contracts (api) sit on it, then data and rewards, workflows, the executor and client (infra),
    the engines, the OpenAI-compatible side, and the kit."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    up = set()
    for name, is_pkg, tree in _modules():
        here = name.split(".")[1] if name.count(".") else None
        for m in _imported(name, is_pkg, tree):
            there = m.split(".")[1]
            if here in rank and there in rank and rank[there] > rank[here]:
                up.add(f"{name} -> {m}")
    assert not up, f"imports that run up a layer ({' < '.join(LAYERS)}): {sorted(up)}"


def test_no_import_cycles():
    """No module imports, directly or through others, one that imports it back. Imports inside functions count too:
    they cycle at run time just the same, and two modules that need each other are one job split in two."""
    graph = {name: _imported(name, is_pkg, tree) - {name} for name, is_pkg, tree in _modules()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_kit_package_import_is_light():
    code = "import sys, areal_lite.kit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- layout: outside the kit, a module at an AReaL 1.0.4 path defines that AReaL module's names ------------------


def _areal_root() -> str:
    """The installed AReaL package's folder, found without importing it (its `__init__` is heavy)."""
    import importlib.util

    spec = importlib.util.find_spec("areal")
    assert spec is not None and spec.origin, "AReaL 1.0.4 is a test dependency"
    return os.path.dirname(spec.origin)


def _areal_has(dotted: str) -> bool:
    """Whether AReaL has a module or package at `dotted` (an `areal.` path)."""
    path = os.path.join(os.path.dirname(_areal_root()), *dotted.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def test_every_areal_name_is_defined_at_its_areal_path_in_the_kit():
    """`from areal_lite.<P> import N` converts to AReaL by the prefix alone: every name with an AReaL twin
    (`AREAL_NAMES[N] == "areal.<P>"`) is defined at `areal_lite.<P>`, and the package root exports it from there."""
    from areal_lite.kit.areal.compat import AREAL_NAMES

    for name, areal_module in AREAL_NAMES.items():
        kit = "areal_lite" + areal_module[len("areal") :]
        assert _is_module(kit), f"{name} is AReaL's {areal_module}.{name}: the kit has no module {kit}"
        assert hasattr(importlib.import_module(kit), name), (
            f"{name} is AReaL's {areal_module}.{name}: define it in {kit}"
        )
        assert areal_lite._EXPORTS[name] == kit[len("areal_lite.") :], f"`from areal_lite import {name}`: export {kit}"


def test_the_top_level_holds_only_packages():
    """The tree shows the architecture: AReaL's roles (api, engine, workflow, ...) and the kit, no loose modules."""
    loose = [f for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"]
    assert not loose, f"move these into the package of their role: {loose}"
    roles = {d for d in os.listdir(PACKAGE) if _is_module(f"areal_lite.{d}")}
    assert roles - {"kit"} <= {d for d in roles if _areal_has(f"areal.{d}")}, "a role package AReaL does not have"


def test_areal_names_exist_at_the_same_path_in_areal():
    """The other half: AReaL 1.0.4 defines each of those names at that path."""
    from areal_lite.kit.areal.compat import AREAL_NAMES

    for name, module in AREAL_NAMES.items():
        assert hasattr(importlib.import_module(module), name), f"AReaL's {module} has no {name}"


# ---- size: one job per class and function ------------------------------------------------------------------------

CLASS_MAX_LINES, FUNCTION_MAX_LINES = 350, 80  # the project's guide; a longer one is split by job, not by length
ROOT = os.path.dirname(PACKAGE)
CODE = [
    os.path.join(dirpath, name)
    for folder in ("areal_lite", "bench", "tools")
    for dirpath, _, names in os.walk(os.path.join(ROOT, folder))
    for name in names
    if name.endswith(".py")
]


def test_classes_and_functions_stay_within_the_guide():
    over = []
    for path in sorted(CODE):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            cap = FUNCTION_MAX_LINES if is_function else CLASS_MAX_LINES if isinstance(node, ast.ClassDef) else None
            lines = node.end_lineno - node.lineno + 1 if cap is not None else 0
            if cap is not None and lines > cap:
                over.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not over, f"over {CLASS_MAX_LINES} lines (class) or {FUNCTION_MAX_LINES} (function):\n" + "\n".join(over)
