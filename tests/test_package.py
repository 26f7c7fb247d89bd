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
    """`from areal_lite import train` is the function even after `areal_lite.train` (the module) was imported."""
    code = (
        "import sys\nfrom areal_lite import TrainConfig\nfrom areal_lite import train\n"
        "print(callable(train) and train is sys.modules['areal_lite.train'].train)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


# ---- layout: the kit-only parts live in areal_lite.kit -------------------------------------------------------------

PACKAGE = os.path.dirname(os.path.abspath(areal_lite.__file__))

# What AReaL 1.0.4 has no counterpart of: the embedded server and vLLM's worker extension, the RAG server, the
# launcher and its child processes, the servers' JSON errors, plots, notebook checks, preparation and the demo.
KIT_MODULES = ["serve", "vllm_ext", "rag", "launch", "procs", "jsonhttp", "plot", "checks", "prepare", "demo"]

# The modules outside the kit that import from it (module -> kit modules it imports): everything else outside
# `areal_lite/kit/` stands without the kit. `train` starts the server and plots the run; `chat` answers errors as the
# other servers do. The package's `__init__` re-exports kit names lazily and is not counted.
IMPORTS_OF_KIT = {
    "areal_lite.chat": {"areal_lite.kit.jsonhttp"},
    "areal_lite.train": {"areal_lite.kit.launch", "areal_lite.kit.plot"},
}


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


def _imported(name: str, is_pkg: bool, tree: ast.AST) -> set[str]:
    """Absolute names of the areal_lite modules that `name` imports (relative imports resolved)."""
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
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


def test_kit_only_modules_live_in_the_kit_package():
    for m in KIT_MODULES:
        assert _is_module(f"areal_lite.kit.{m}"), m
        assert not _is_module(f"areal_lite.{m}"), f"areal_lite.{m} is at two paths (one path per module)"
    kit_exports = {m for m in areal_lite._EXPORTS.values() if m.split(".")[0] == "kit"}
    assert kit_exports <= {f"kit.{m}" for m in KIT_MODULES}, kit_exports


def test_outside_the_kit_only_the_listed_modules_import_it():
    found = {}
    for name, is_pkg, tree in _modules():
        if name == "areal_lite" or name == "areal_lite.kit" or name.startswith("areal_lite.kit."):
            continue
        kit = {m for m in _imported(name, is_pkg, tree) if m.startswith("areal_lite.kit.") and m.count(".") == 2}
        if kit:
            found[name] = kit
    assert found == IMPORTS_OF_KIT, "a module outside the kit imports it: move it into the kit or list it here"


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


def test_modules_at_areal_paths_define_areal_names():
    """`from areal_lite.X import N` converts to AReaL by the prefix alone: for every kit module outside `kit/` whose
    path exists in AReaL, each `AREAL_NAMES` entry that names that AReaL module is defined at the kit's same path."""
    from areal_lite.areal_compat import AREAL_NAMES

    by_module: dict[str, set[str]] = {}
    for name, target in AREAL_NAMES.items():
        module, _, _other = target.partition(":")
        by_module.setdefault(module, set()).add(name)
    checked = set()
    for name, _is_pkg, _tree in _modules():
        if name == "areal_lite" or name == "areal_lite.kit" or name.startswith("areal_lite.kit."):
            continue
        areal_name = "areal" + name[len("areal_lite") :]
        if not _areal_has(areal_name):
            continue
        for n in by_module.get(areal_name, ()):
            assert hasattr(importlib.import_module(name), n), f"{n} is AReaL's {areal_name}.{n}: define it in {name}"
            checked.add(n)
    # the kit modules that mirror AReaL's paths cover these (a regression test for the layout, not a wish list)
    assert {"GRPOConfig", "ModelRequest", "RolloutWorkflow", "RemoteSGLangEngine", "RemotevLLMEngine"} <= checked


def test_areal_names_exist_at_the_same_path_in_areal():
    """The other half: for those kit modules, AReaL 1.0.4 defines the same names at the same path."""
    from areal_lite.areal_compat import AREAL_NAMES

    for name, target in AREAL_NAMES.items():
        module, _, other = target.partition(":")
        kit = "areal_lite" + module[len("areal") :]
        if other or not _is_module(kit):
            continue
        assert hasattr(importlib.import_module(module), name), f"AReaL's {module} has no {name}"
