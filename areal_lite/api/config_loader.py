"""Strict config loading: a command line and a YAML file become one checked dataclass instance.

`cli_args.load_expr_config` (AReaL's entry point) calls `load_layers` here, then fills the fields derived from
others. This module knows YAML, overrides and profiles, and nothing of any one config's fields: it walks whatever
dataclass it is given, so the schema (`cli_args`) imports it and never the reverse.

Design decisions
- Loading is strict. Before OmegaConf merges anything, we walk the YAML (and each dotted override) against the
  dataclass fields ourselves (`_Checker`), so an error can name the file, the dotted key, the expected type and the
  nearest valid key. OmegaConf then does the merge and builds the objects; there is no Hydra and no global state, so
  a config can be loaded any number of times in one kernel.
- One switch picks the hardware profile. A YAML file may hold `profiles: {cpu: {...}, gpu: {...}}`; these are
  overrides applied on top of the base keys, before the command line. `profile=auto` picks `gpu` when CUDA is
  available, else `cpu` (`resolve_profile`), and whatever loads a config prints the profile it chose.
- The environment is the one switch a whole run (CI, `make test-gpu`) flips without editing a notebook:
  `$AREAL_LITE_OVERRIDES` holds overrides applied before the command line's, `$AREAL_LITE_PROFILE` the profile. An
  AREAL_LITE_* name the kit does not read (`ENVIRONMENT`) is refused, as an unknown key is.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import yaml
from omegaconf import OmegaConf

from areal_lite.api.areal_only import ConfigError

__all__ = ["ENVIRONMENT", "LoadedConfig", "check_environment", "load_layers", "resolve_profile", "describe"]


_INTERPOLATION = re.compile(r"\$\{[^{}]+\}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " | ".join(_type_name(a) for a in args) + " | null"
    if origin in (list, List, tuple, Tuple):
        arg = (typing.get_args(tp) or (Any,))[0]
        return f"list[{_type_name(arg)}]"
    if origin in (dict, Dict) or tp is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1 and len(non_none) < len(args):
            return non_none[0], True
    return tp, False


def _dotted_keys(cls: type, prefix: str = "", depth: int = 4) -> List[str]:
    """Every dotted key of config class `cls`, down to `depth` levels: a level's own keys before those below them."""
    here, deeper = [], []
    for f in dataclasses.fields(cls):
        here.append(prefix + f.name)
        inner, _ = _unwrap_optional(typing.get_type_hints(cls)[f.name])
        if dataclasses.is_dataclass(inner) and depth > 1:
            deeper += _dotted_keys(inner, prefix + f.name + ".", depth - 1)
    return here + deeper


class _Checker:
    """Walks a plain dict against a dataclass, raising ConfigError on the first problem."""

    def __init__(self, source: str, numbers_as_text: bool = False):
        self.source = source
        # On the command line `trial_name=7` reaches us as the int 7; in a YAML file we insist on the right type.
        self.numbers_as_text = numbers_as_text
        self.root: Optional[type] = None  # the config class checked from the top: where a misplaced key belongs

    def hint(self, key: str, prefix: str, fields: dict) -> str:
        """The "did you mean" of an unknown key's message: a close spelling at this level, else where the same name
        is elsewhere (a key indented one level off, or given without its section), else where a close spelling is
        (both at once: `actor.lrr`), else a looser spelling at this level."""
        at = prefix + "." if prefix else ""

        def spelled(cutoff: float) -> List[str]:
            return [at + n for n in difflib.get_close_matches(key, list(fields), n=1, cutoff=cutoff)]

        near = spelled(0.8)
        if not near and self.root is not None:
            keys = _dotted_keys(self.root)
            leaf = {k: k.rsplit(".", 1)[-1] for k in keys}
            for names in ([key], difflib.get_close_matches(key, sorted(set(leaf.values())), n=1, cutoff=0.8)):
                elsewhere = [k for k in keys if leaf[k] in names]
                near = [k for k in elsewhere if k.startswith(at)] or elsewhere
                if near:
                    break
        near = near or spelled(0.5)
        return f"; did you mean {' or '.join(repr(p) for p in near[:3])}?" if near else ""

    def fail(self, key: str, msg: str) -> None:
        raise ConfigError(f"{self.source}: key '{key}': {msg}")

    def check(self, cls: type, data: Any, prefix: str) -> Any:
        """Validate `data` for dataclass `cls`; returns data with values coerced where that is lossless."""
        if not isinstance(data, dict):
            self.fail(prefix or "<root>", f"expected a mapping ({cls.__name__}), got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if not prefix:
            self.root = cls
        out = {}
        for key, value in data.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if key not in fields:
                valid = ", ".join(sorted(fields))
                hint = self.hint(str(key), prefix, fields)
                self.fail(dotted, f"unknown key for {cls.__name__}{hint} (valid keys: {valid})")
            out[key] = self.value(hints[key], value, dotted, fields[key])
        return out

    def value(self, tp: Any, value: Any, key: str, fld: Optional[dataclasses.Field] = None) -> Any:
        inner, optional = _unwrap_optional(tp)
        expected = _type_name(tp)
        if value is None:
            if optional or tp is Any:
                return None
            self.fail(key, f"expected {expected}, got null")
        if isinstance(value, str) and _INTERPOLATION.fullmatch(value):
            return value  # `${actor.path}` as in AReaL's YAMLs: OmegaConf resolves it, then checks the type
        if dataclasses.is_dataclass(inner):
            return self.check(inner, value, key)
        origin = typing.get_origin(inner)
        if origin in (list, List, tuple, Tuple):
            if not isinstance(value, (list, tuple)):
                self.fail(key, f"expected {expected}, got {type(value).__name__} {value!r}")
            arg = (typing.get_args(inner) or (Any,))[0]
            return [self.value(arg, v, f"{key}[{i}]") for i, v in enumerate(value)]
        if origin in (dict, Dict) or inner is dict:
            if not isinstance(value, dict):
                self.fail(key, f"expected {expected}, got {type(value).__name__} {value!r}")
            return value
        if inner is Any:
            return value
        value = self.scalar(inner, value, key, expected)
        choices = fld.metadata.get("choices") if fld is not None else None
        if choices and value not in choices:
            near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.4)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            self.fail(key, f"expected one of {list(choices)}, got {value!r}{hint}")
        return value

    def scalar(self, tp: Any, value: Any, key: str, expected: str) -> Any:
        bad = f"expected {expected}, got {type(value).__name__} {value!r}"
        if tp is bool:
            if isinstance(value, bool):
                return value
            self.fail(key, bad)
        if tp is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            self.fail(key, bad)
        if tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str):
                # YAML 1.1 reads `1e-5` (no dot) as a string; accept what float() accepts.
                try:
                    return float(value)
                except ValueError:
                    pass
            self.fail(key, bad)
        if tp is str:
            if isinstance(value, str):
                return value
            if self.numbers_as_text and isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            self.fail(key, bad)
        return value


def _parse_override(item: str, origin: str = "command line") -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(
            f"{origin}: '{item}' is not an override; write key=value (for example actor.optimizer.lr=1e-5)"
        )
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"{origin}: '{item}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{origin}: key '{key}': cannot parse value {raw!r}: {e}") from None
    return key, value


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _deep_merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _deep_merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def resolve_profile(requested: str) -> tuple[str, str]:
    """`auto` → `gpu` if CUDA is available else `cpu`. Returns (profile, why)."""
    if requested in ("cpu", "gpu"):
        return requested, "requested"
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: the CPU path is the honest fallback
        has_cuda = False
    return ("gpu", "auto: CUDA is available") if has_cuda else ("cpu", "auto: no CUDA device")


_UNSET = object()  # a key no layer set (None is a value a layer can set)


@dataclass
class LoadedConfig:
    """What `load_layers` built: the config, the file it came from, and what the layers set."""

    config: Any
    path: Optional[str]  # the --config file, None without one
    merged: dict  # the YAML base keys, the chosen profile's and the overrides, merged: what was set explicitly
    profile: str  # "cpu" or "gpu"
    why: str  # why that profile ("requested", "auto: no CUDA device", ...)
    layers: List[Tuple[str, dict]] = field(default_factory=list)  # (where, what it set), in merge order

    def source_of(self, dotted: str) -> Optional[str]:
        """Where `dotted` got its value: the last layer that set it ("cfg.yaml", "command line", ...), else None."""
        found = None
        for where, layer in self.layers:
            node: Any = layer
            for part in dotted.split("."):
                node = node.get(part, _UNSET) if isinstance(node, dict) else _UNSET
            found = where if node is not _UNSET else found
        return found

    def sets(self, dotted: str) -> bool:
        """Whether a layer (file, profile, environment or command line) set `dotted`, rather than the default."""
        node: Any = self.merged
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True


# The environment variables the kit reads (a test checks this list against the code). Any other AREAL_LITE_* name is
# a misspelling that would be ignored without a word, so loading a config refuses it.
ENVIRONMENT = (
    "AREAL_LITE_CACHE",
    "AREAL_LITE_CPU_BF16",
    "AREAL_LITE_GPU_INSTALL",
    "AREAL_LITE_OVERRIDES",
    "AREAL_LITE_PROFILE",
    "AREAL_LITE_SERVER_TRANSFORMERS",
    "AREAL_LITE_SMOKE",
    "AREAL_LITE_SOAK_EXAMPLES",
)


def check_environment() -> None:
    """Raise ConfigError for an AREAL_LITE_* variable the kit does not read, naming the nearest one it does."""
    unknown = sorted(k for k in os.environ if k.startswith("AREAL_LITE_") and k not in ENVIRONMENT)
    if unknown:
        near = difflib.get_close_matches(unknown[0], ENVIRONMENT, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else ""
        raise ConfigError(
            f"environment variable {unknown[0]}: not one the kit reads{hint} (it reads {', '.join(ENVIRONMENT)})"
        )


def load_layers(argv: List[str], config_cls: type) -> LoadedConfig:
    """Parse `["--config", FILE, "a.b=1", ...]` into a checked `config_cls` instance (no derived fields filled).

    Order: dataclass defaults ← YAML base keys ← YAML `profiles.<profile>` ← `$AREAL_LITE_OVERRIDES` ← `argv`.
    The profile comes from `profile=` in argv, else `$AREAL_LITE_PROFILE`, else `profile=` in
    `$AREAL_LITE_OVERRIDES`, else the YAML, else `auto`.
    """
    check_environment()
    path, overrides = _split_argv(argv)
    data, profiles = _read_yaml(path)
    source = path or "<defaults>"
    data = _Checker(source).check(config_cls, data, "")
    profiles = _check_profiles(config_cls, source, profiles)
    override_layers = _override_layers(config_cls, overrides)
    cli: dict = {}
    for _, layer in override_layers:
        cli = _deep_merge(cli, layer)
    env_profile = os.environ.get("AREAL_LITE_PROFILE")
    if env_profile and "profile" not in {o.split("=", 1)[0].strip() for o in overrides}:
        cli["profile"] = _Checker("AREAL_LITE_PROFILE").check(config_cls, {"profile": env_profile}, "")["profile"]
    requested = cli.get("profile", data.get("profile", "auto"))
    chosen, why = resolve_profile(requested)
    merged = _deep_merge(_deep_merge(data, profiles.get(chosen, {})), cli)
    merged["profile"] = chosen
    layers = [(source, data), (f"{source} (profiles.{chosen})", profiles.get(chosen, {})), *override_layers]
    loaded = LoadedConfig(None, path, merged, chosen, why, layers)
    try:
        loaded.config = _build(config_cls, merged)
    except Exception as e:  # a section's own check (__post_init__), or OmegaConf's: name the keys and their layers
        raise ConfigError(_build_error(loaded, config_cls, e)) from None
    return loaded


def _build(cls: type, data: dict) -> Any:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.create(data)))


def _build_error(loaded: LoadedConfig, cls: type, error: Exception) -> str:
    """`error`'s message, led by where the failing section's keys were set: a section's own check (as
    `actor.rejection_sampling`'s "upper must be > 1.0") names no key, and the value may come from the command line."""
    section, keys = _failing_section(cls, loaded.merged, "")
    if not section:  # only the whole config fails (an interpolation across sections): OmegaConf names the key
        return f"{loaded.path or '<defaults>'}: {error}"
    at = f"{section}."
    sources = list(dict.fromkeys(loaded.source_of(at + k) or "defaults" for k in keys))
    settings = ", ".join(f"{at}{k}={v!r}" for k, v in keys.items())
    return f"{' and '.join(sources)}: section '{section}' ({settings}): {error}"


def _failing_section(cls: type, data: dict, prefix: str) -> Tuple[str, dict]:
    """The deepest section of `data` (typed by dataclass `cls`) that fails to build alone: (its dotted path, the
    plain keys set in it); ("", {}) when none does alone."""
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        inner, _ = _unwrap_optional(hints.get(key, Any))
        if isinstance(value, dict) and dataclasses.is_dataclass(inner):
            found = _failing_section(inner, value, f"{prefix}{key}.")
            if found[1]:
                return found
    try:
        _build(cls, data)
    except Exception:
        return prefix.rstrip("."), {k: v for k, v in data.items() if not isinstance(v, dict)}
    return "", {}


def _split_argv(argv: List[str]) -> tuple[Optional[str], List[str]]:
    """(the --config file or None, the key=value overrides) of a command line."""
    argv = list(argv)
    path: Optional[str] = None
    overrides: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("command line: --config needs a file path")
            path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("--"):
            raise ConfigError(f"command line: unknown option '{arg}' (only --config FILE and key=value overrides)")
        else:
            overrides.append(arg)
        i += 1
    return path, overrides


def _read_yaml(path: Optional[str]) -> tuple[dict, dict]:
    """(base keys, `profiles` mapping) of a YAML config file; both empty without a file."""
    data: dict = {}
    profiles: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: config file not found (cwd is {os.getcwd()})")
        try:
            with open(path, encoding="utf-8") as fh:
                loaded = yaml.safe_load(fh)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
        profiles = loaded.pop("profiles", None) or {}
        if not isinstance(profiles, dict):
            raise ConfigError(f"{path}: key 'profiles': expected a mapping of profile name to overrides")
        data = loaded
    return data, profiles


def _check_profiles(config_cls: type, source: str, profiles: dict) -> dict:
    for name, prof in profiles.items():
        if name not in ("cpu", "gpu"):
            near = difflib.get_close_matches(str(name), ["cpu", "gpu"], n=1, cutoff=0.3)
            hint = f"; did you mean 'profiles.{near[0]}'?" if near else ""
            raise ConfigError(f"{source}: key 'profiles.{name}': unknown profile (valid: cpu, gpu){hint}")
        profiles[name] = _Checker(f"{source} (profile {name})").check(config_cls, prof or {}, "")
    return profiles


def _override_layers(config_cls: type, overrides: List[str]) -> List[Tuple[str, dict]]:
    """($AREAL_LITE_OVERRIDES, its keys) then ("command line", its keys): key=value overrides, checked, nested."""
    try:  # split as a shell would: `system_prompt='You are helpful'` is one override
        env_overrides = shlex.split(os.environ.get("AREAL_LITE_OVERRIDES", ""))
    except ValueError as e:
        raise ConfigError(f"AREAL_LITE_OVERRIDES: cannot split it into key=value overrides: {e}") from None
    layers = []
    for origin, items in (("AREAL_LITE_OVERRIDES", env_overrides), ("command line", overrides)):
        layer: dict = {}
        for item in items:
            key, value = _parse_override(item, origin)
            nested = _Checker(origin, numbers_as_text=True).check(config_cls, _nest(key, value), "")
            layer = _deep_merge(layer, nested)
        layers.append((origin, layer))
    return layers


def describe(cls: type, prefix: str = "") -> str:
    """One line per field: dotted key, type, default and help — a readable reference of a config class."""
    lines = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        inner, _ = _unwrap_optional(tp)
        key = prefix + f.name
        if dataclasses.is_dataclass(inner):
            lines.append(f"{key}: {f.metadata.get('help', '')}")
            lines.append(describe(inner, key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore
        lines.append(f"{key} ({_type_name(tp)}, default {default!r}): {f.metadata.get('help', '')}")
    return "\n".join(lines)
