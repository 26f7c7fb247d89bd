"""The kit's public API against the real AReaL 1.0.4 (installed by `make test` from requirements/areal.txt).

What a cell touches must copy into AReaL changing only import lines, so for every name in
`areal_compat.AREAL_NAMES`: AReaL has it; the parameters AReaL declares come first in ours, in AReaL's order, with
AReaL's defaults, and anything the kit adds is keyword-only or defaulted; a dataclass has AReaL's fields with
AReaL's defaults. Every `areal_lite` name a notebook imports is listed (AREAL_NAMES or KIT_ONLY), and the AReaL
version of every notebook cell (`to_areal_cell`) differs from the kit's in import lines only and its imports run;
a kit keyword a cell passes to such a name (one AReaL's signature lacks) is named in notebook 08's table.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import glob
import importlib
import inspect
import os
from importlib.metadata import version

import nbformat
import pytest

import areal_lite
from areal_lite.kit.areal import compat as areal_compat
from areal_lite.kit.areal.compat import AREAL_NAMES, AREAL_VERSION, KIT_ONLY, register_with_areal, to_areal_cell

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "en", "*.ipynb")))
INSTALL_HINT = "AReaL 1.0.4 is missing: `make test` installs it (requirements/areal.txt, then --no-deps areal==1.0.4)"

# Methods a notebook cell calls on an instance, per class (checked like functions).
ENGINE_METHODS = [
    "__init__",
    "initialize",
    "destroy",
    "agenerate",
    "rollout_batch",
    "prepare_batch",
    "submit",
    "wait",
    "pause",
    "resume",
    "set_version",
    "get_version",
    "update_weights_from_disk",
]
PPO_ACTOR_METHODS = ["compute_logp", "compute_advantages", "ppo_update"]
METHODS = {
    "RemoteSGLangEngine": ENGINE_METHODS,
    "RemotevLLMEngine": ENGINE_METHODS,  # AReaL gives both engines the same API
    "AsyncRewardWrapper": ["__init__"],
    "InteractionCache": ["set_reward", "set_last_reward", "apply_reward_discount", "export_interactions"],
    "RLVRWorkflow": ["__init__", "arun_episode"],
    "MultiTurnWorkflow": ["__init__", "arun_episode"],
    "RolloutWorkflow": ["arun_episode"],
    "GenerationHyperparameters": ["new", "new_with_stop_and_pad_token_ids"],
    "WeightUpdateMeta": ["with_version", "from_disk", "from_fsdp_xccl"],
    # the contracts: every method the kit's engine_api declares, with AReaL's signature
    "TrainEngine": [
        "create_process_group",
        "initialize",
        "destroy",
        "connect_engine",
        "update_weights",
        "set_version",
        "get_version",
        "step_lr_scheduler",
        "train_batch",
    ],
    "InferenceEngine": [
        "initialize",
        "destroy",
        "agenerate",
        "update_weights_from_disk",
        "set_version",
        "get_version",
        "submit",
        "wait",
        "rollout_batch",
        "prepare_batch",
        "pause",
        "resume",
    ],
    "ModelRequest": ["copy"],
    "FSDPPPOActor": [
        "initialize",
        "create_process_group",
        "connect_engine",
        *PPO_ACTOR_METHODS,
        "step_lr_scheduler",
        "update_weights",
        "set_version",
        "get_version",
        "destroy",
    ],
}
# Dataclasses whose every AReaL field the kit has, with AReaL's default.
FULL_DATACLASSES = ["ModelRequest", "ModelResponse", "WeightUpdateMeta", "FinetuneSpec", "GenerationHyperparameters"]


def areal_object(name):
    try:
        return areal_compat.areal_object(name)
    except ImportError as exc:  # pragma: no cover - the message is the point
        pytest.fail(f"{INSTALL_HINT}: {exc}")


def test_pinned_areal_is_installed():
    assert version("areal") == AREAL_VERSION, INSTALL_HINT


@pytest.mark.parametrize("name", sorted(AREAL_NAMES))
def test_name_exists_on_both_sides(name):
    assert hasattr(areal_object(name), "__name__") or areal_object(name) is not None
    assert name in areal_lite.__all__, f"{name} is listed in AREAL_NAMES but not exported by areal_lite"


def _same_default(a, b) -> bool:
    """Equal defaults; a default *function* (e.g. `default_get_input_ids_fn`) only needs the same name and role."""
    if callable(a) and callable(b) and not isinstance(a, type):
        return getattr(a, "__name__", None) == getattr(b, "__name__", None)
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return dataclasses.asdict(a) == dataclasses.asdict(b)
    return type(a) is type(b) and a == b


def _conforms(ours, theirs, where: str) -> list[str]:
    """Problems with `ours` as a drop-in for `theirs` (empty list: conforms)."""
    problems = []
    po = list(inspect.signature(ours).parameters.values())
    pt = list(inspect.signature(theirs).parameters.values())
    for i, t in enumerate(pt):
        if t.kind in (t.VAR_POSITIONAL, t.VAR_KEYWORD):
            continue
        if i >= len(po) or po[i].name != t.name:
            got = [p.name for p in po]
            order = [p.name for p in pt]
            problems.append(f"{where}: parameter {i} should be {t.name!r} (AReaL order {order}); ours {got}")
            break
        if t.default is not t.empty and not _same_default(po[i].default, t.default):
            problems.append(f"{where}: {t.name} defaults to {po[i].default!r}, AReaL's to {t.default!r}")
    theirs_names = {p.name for p in pt}
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in pt)
    for p in po[len(pt) :]:
        if p.name in theirs_names or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty and p.kind != p.KEYWORD_ONLY and not takes_kwargs:
            problems.append(f"{where}: kit extra {p.name!r} must be keyword-only or have a default")
    return problems


def _method_cases():
    return [(cls, m) for cls, methods in METHODS.items() for m in methods]


# AReaL's FSDPPPOActor passes these on as (*args, **kwargs) to the PPOActor it wraps: that one's signature is the
# contract (a variadic one would conform to anything).
DELEGATED = {("FSDPPPOActor", m): ("areal.trainer.ppo.actor", "PPOActor") for m in PPO_ACTOR_METHODS}
# AReaL's own contract for these is (*args, **kwargs): any signature conforms.
VARIADIC_IN_AREAL = {
    ("TrainEngine", "initialize"),
    ("InferenceEngine", "initialize"),
    ("GenerationHyperparameters", "new"),
}


def _undecorated(f):
    """`f` under its decorators, also one that kept no `__wrapped__` (AReaL's `stats_tracker.scope_func_wrapper`)."""
    f = inspect.unwrap(f)
    inner = [c.cell_contents for c in f.__closure__ or () if inspect.isfunction(c.cell_contents)]
    return _undecorated(inner[0]) if f.__name__ == "wrapper" and len(inner) == 1 else f


@pytest.mark.parametrize("cls,method", _method_cases())
def test_methods_take_arealss_parameters(cls, method):
    ours, theirs = getattr(getattr(areal_lite, cls), method), getattr(areal_object(cls), method)
    if (cls, method) in DELEGATED:
        module, name = DELEGATED[cls, method]
        theirs = _undecorated(getattr(getattr(importlib.import_module(module), name), method))
    params = [p for p in inspect.signature(theirs).parameters.values() if p.name != "self"]
    if (
        (cls, method) not in VARIADIC_IN_AREAL
        and params
        and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
    ):
        pytest.fail(f"AReaL's {cls}.{method} takes only *args/**kwargs: name the method it delegates to in DELEGATED")
    assert not _conforms(ours, theirs, f"{cls}.{method}"), _conforms(ours, theirs, f"{cls}.{method}")


@pytest.mark.parametrize("name", ["concat_padded_tensors", "cycle_dataloader", "load_expr_config", "find_free_ports"])
def test_functions_take_areals_parameters(name):
    problems = _conforms(getattr(areal_lite, name), areal_object(name), name)
    assert not problems, problems


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@pytest.mark.parametrize("name", FULL_DATACLASSES)
def test_dataclass_has_areals_fields_and_defaults(name):
    ours = {f.name: f for f in dataclasses.fields(getattr(areal_lite, name))}
    theirs = dataclasses.fields(areal_object(name))
    missing = [f.name for f in theirs if f.name not in ours]
    assert not missing, f"{name} lacks AReaL's fields {missing}"
    for f in theirs:
        if f.name in ("rid",):  # a fresh uuid each time
            continue
        a, b = _default(ours[f.name]), _default(f)
        assert _same_default(a, b), f"{name}.{f.name}: kit default {a!r}, AReaL's {b!r}"
    order = [f.name for f in dataclasses.fields(getattr(areal_lite, name))][: len(theirs)]
    assert order == [f.name for f in theirs], f"{name}: positional field order differs from AReaL's"


def test_register_with_areal_makes_kit_workflows_areal_workflows():
    from areal.api import RolloutWorkflow as AReaLRolloutWorkflow

    from areal_lite import RLVRWorkflow, RolloutWorkflow

    register_with_areal()
    register_with_areal()  # idempotent
    assert issubclass(RolloutWorkflow, AReaLRolloutWorkflow)
    assert issubclass(RLVRWorkflow, AReaLRolloutWorkflow)


# ------------------------------------------------------------------------------------------------ the notebooks


def _cells(path):
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def _kit_imports(source: str) -> list[tuple[str, str]]:
    """(module, name) of every `from areal_lite... import name` in a cell."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "areal_lite":
            found += [(node.module, a.name) for a in node.names]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_every_kit_name_a_notebook_imports_is_listed(path):
    names = {n for src in _cells(path) for m, n in _kit_imports(src) if m.split(".")[:2] != ["areal_lite", "kit"]}
    unlisted = sorted(n for n in names if n not in AREAL_NAMES | KIT_ONLY)
    assert not unlisted, f"list these in areal_lite.kit.areal.compat (AREAL_NAMES or KIT_ONLY): {unlisted}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_a_notebook_imports_areal_names_from_their_areal_path(path):
    """A cell converts by its prefix alone: every name with an AReaL twin is imported from `areal_lite.<P>`, and AReaL
    1.0.4 defines the same name at `areal.<P>`."""
    for module, name in {i for src in _cells(path) for i in _kit_imports(src)}:
        if name not in AREAL_NAMES:
            continue
        assert module != "areal_lite", f"import {name} from its AReaL-shaped path ({AREAL_NAMES[name]}), not the root"
        areal_module = "areal" + module[len("areal_lite") :]
        assert hasattr(importlib.import_module(areal_module), name), f"AReaL's {areal_module} has no {name}"


def _import_lines(source: str) -> set[int]:
    lines = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_areal_version_of_every_cell_differs_only_in_imports(path):
    for source in _cells(path):
        if source.lstrip().startswith(("%", "!")):
            continue
        converted = to_areal_cell(source)
        kept = [line for i, line in enumerate(source.splitlines(), 1) if i not in _import_lines(source)]
        kept_after = [line for i, line in enumerate(converted.splitlines(), 1) if i not in _import_lines(converted)]
        assert kept == kept_after, "\n".join(difflib.unified_diff(kept, kept_after, lineterm=""))
        original = {ast.unparse(n) for n in ast.parse(source).body if isinstance(n, ast.ImportFrom)}
        for node in ast.parse(converted).body:  # the rewritten AReaL imports really import
            rewritten = isinstance(node, ast.ImportFrom) and ast.unparse(node) not in original
            if rewritten and node.module.startswith("areal."):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                    assert alias.asname is None or alias.asname in AREAL_NAMES


TO_AREAL_SOURCE = os.path.join(ROOT, "notebooks", "src", "08_to_areal.nb.md")


def _kit_keywords(source: str) -> list[tuple[str, str]]:
    """(call, keyword) for each keyword a cell passes to an AReaL-named call that AReaL's signature lacks: `name(...)`
    and `Name.method(...)` of a name in AREAL_NAMES, and `obj.method(...)` of a method METHODS lists (by its name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.keywords:
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in AREAL_NAMES:
            call = f.id
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in AREAL_NAMES:
            call = f"{f.value.id}.{f.attr}"
        elif isinstance(f, ast.Attribute) and any(f.attr in methods for methods in METHODS.values()):
            call = f.attr
        else:
            continue
        accepted = _areal_params(call)
        found += [(call, kw.arg) for kw in node.keywords if kw.arg and accepted is not None and kw.arg not in accepted]
    return found


def _areal_params(call: str):
    """The keywords AReaL 1.0.4 accepts for `call` (None: any, it takes **kwargs)."""
    if "." in call:
        cls, attr = call.split(".")
        targets = [getattr(areal_object(cls), attr)]
    elif call in AREAL_NAMES:
        targets = [areal_object(call)]
    else:  # an instance method: any class with that method in METHODS
        targets = [getattr(areal_object(c), call) for c, ms in METHODS.items() if call in ms and c in AREAL_NAMES]
    names = set()
    for target in targets:
        params = inspect.signature(target).parameters.values()
        if any(p.kind == p.VAR_KEYWORD for p in params):
            return None
        names |= {p.name for p in params}
    return names


def test_every_kit_keyword_a_notebook_passes_is_named_in_the_to_areal_notebook():
    """A kit keyword in a cell (one AReaL's signature lacks) makes the cell fail under AReaL although its imports
    convert, so notebook 08's table of differences names each: a row that has the call and `keyword=`."""
    with open(TO_AREAL_SOURCE, encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| ")]
    unnamed = set()
    for path in NOTEBOOKS:
        for source in _cells(path):
            if source.lstrip().startswith(("%", "!")):
                continue
            for call, kw in _kit_keywords(source):
                short = call.split(".")[-1]
                if not any(short in row and f"{kw}=" in row for row in rows):
                    unnamed.add(f"{os.path.basename(path)}: {call}({kw}=...)")
    assert not unnamed, f"name these in notebook 08's table of differences: {sorted(unnamed)}"


def test_kit_keywords_are_found():
    """The scan above finds a kit keyword in each kind of call it looks at, and passes AReaL's own."""
    cell = (
        "cfg, _ = load_expr_config(argv, GRPOConfig, verbose=False)\n"
        "meta = WeightUpdateMeta.from_disk(path='w', experiment_name='e')\n"
        "engine.rollout_batch(data, workflow=wf, kit_only_knob=1)\n"
    )
    assert sorted(_kit_keywords(cell)) == [
        ("WeightUpdateMeta.from_disk", "path"),
        ("load_expr_config", "verbose"),
        ("rollout_batch", "kit_only_knob"),
    ]


def test_to_areal_cell_rewrites_imports_only():
    source = (
        "from areal_lite.api.io_struct import ModelRequest\n"
        "from areal_lite.reward.math_answer import answer_reward\n"
        "from areal_lite import GRPOConfig, launch_server\n"
        "from areal_lite.kit.areal.compat import to_areal_cell\n"
        "req = ModelRequest(input_ids=[1])\n"
    )
    assert to_areal_cell(source).splitlines() == [
        "from areal.api.io_struct import ModelRequest",  # the prefix swapped
        "from areal_lite.reward.math_answer import answer_reward",  # kit-only: kept
        "from areal.api.cli_args import GRPOConfig",  # from the root: to its AReaL module
        "from areal_lite import launch_server",
        "from areal_lite.kit.areal.compat import to_areal_cell",  # the kit package: kept
        "req = ModelRequest(input_ids=[1])",
    ]
    with pytest.raises(KeyError, match="neither AREAL_NAMES nor KIT_ONLY"):
        to_areal_cell("from areal_lite import not_a_listed_name\n")
    with pytest.raises(KeyError, match="neither AREAL_NAMES nor KIT_ONLY"):
        to_areal_cell("from areal_lite.utils.data import not_a_listed_name\n")


@pytest.mark.parametrize("package", ["api", "engine", "workflow", "reward"])
def test_packages_re_export_what_areals_re_export(package):
    """`from areal_lite.<package> import X` converts: AReaL's package re-exports X, and the kit's package re-exports
    every name of AReaL's that the kit has."""
    ours, theirs = importlib.import_module(f"areal_lite.{package}"), importlib.import_module(f"areal.{package}")
    for name in dir(ours):
        if not name.startswith("_") and not inspect.ismodule(getattr(ours, name)):
            assert name in dir(theirs), f"areal_lite.{package} re-exports {name}, areal.{package} does not"
    for name in dir(theirs):
        if name in AREAL_NAMES and AREAL_NAMES[name].startswith(f"areal.{package}."):
            assert name in dir(ours), f"areal.{package} re-exports {name}; areal_lite.{package} must too"
            assert getattr(ours, name) is getattr(areal_lite, name)


@pytest.mark.parametrize(
    "impl,contract",
    [
        ("FSDPPPOActor", "TrainEngine"),
        ("RemoteSGLangEngine", "InferenceEngine"),
        ("RemotevLLMEngine", "InferenceEngine"),
    ],
)
def test_engines_implement_the_contracts(impl, contract):
    """Each engine subclasses its contract and overrides every method the contract declares (none is left to the
    contract's NotImplementedError)."""
    impl, contract = getattr(areal_lite, impl), getattr(areal_lite, contract)
    assert issubclass(impl, contract)
    declared = [n for n, v in vars(contract).items() if callable(v) and not n.startswith("_")]
    left = [n for n in declared if getattr(impl, n) is getattr(contract, n)]
    assert not left, f"{impl.__name__} leaves {left} of {contract.__name__} unimplemented"


def test_weight_update_meta_from_disk_folder_is_areals(tmp_path):
    from areal.api.io_struct import WeightUpdateMeta as AReaLMeta

    args = ("exp", "trial", str(tmp_path / "root"))
    ours, theirs = areal_lite.WeightUpdateMeta.from_disk(*args, name="actor"), AReaLMeta.from_disk(*args, name="actor")
    assert (ours.type, ours.path, ours.lora_int_id) == (theirs.type, theirs.path, theirs.lora_int_id)
    assert os.path.isdir(os.path.dirname(ours.path))
    kit_folder = areal_lite.WeightUpdateMeta.from_disk(path=str(tmp_path / "w"), keep_last=3)
    assert (kit_folder.path, kit_folder.keep_last) == (str(tmp_path / "w" / "weight_update"), 3)
    with pytest.raises(TypeError, match="path="):
        areal_lite.WeightUpdateMeta.from_disk(str(tmp_path / "w"))  # a folder alone: say the keyword
    xccl = areal_lite.WeightUpdateMeta.from_fsdp_xccl("sglang:d1+d1", weight_chunked_mem_mb=256)
    ref = AReaLMeta.from_fsdp_xccl("sglang:d1+d1", weight_chunked_mem_mb=256)
    assert (xccl.type, xccl.gen_allocation, xccl.weight_chunked_mem_mb) == (ref.type, ref.gen_allocation, 256)


@pytest.mark.parametrize("where", sorted(areal_compat.BETTER_THAN_AREAL))
def test_each_deliberate_difference_names_a_kit_object_with_an_areal_twin(where):
    """A difference kept on purpose is about a name both sides have: the kit's object exists, and so does AReaL's."""
    module, qualname = where.split(":")
    ours = importlib.import_module(module)
    theirs = importlib.import_module("areal" + module[len("areal_lite") :])
    for part in qualname.split("."):
        ours, theirs = getattr(ours, part), getattr(theirs, part)
    assert areal_compat.BETTER_THAN_AREAL[where].strip()


def test_find_free_ports_behaves_as_areals():
    from areal.utils.network import find_free_ports as theirs

    from areal_lite.utils.network import find_free_ports as ours

    exclude = set(range(20000, 20050))
    for fn in (ours, theirs):
        ports = fn(5, port_range=(20000, 20100), exclude_ports=exclude)
        assert len(set(ports)) == 5 and ports == sorted(ports), ports
        assert all(20050 <= p <= 20100 for p in ports), ports
    for fn in (ours, theirs):  # the same refusal when the range is too small
        with pytest.raises(ValueError, match=r"Cannot find 3 ports in range \(20000, 20001\). Only 2 ports available"):
            fn(3, port_range=(20000, 20001))
