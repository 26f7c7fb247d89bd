"""From a kit YAML to an AReaL 1.0.4 config: one documented step, with the kit-only keys kept apart.

    python -m areal_lite.kit.areal.config configs/search_agent.yaml --profile gpu -o search_agent_areal.yaml

Design decisions
- The kit YAML is first resolved by the kit's own loader (profile, overrides, derived values), so the AReaL config
  holds exactly the values the kit runs with, defaults included: where a kit default differs from AReaL's, the
  written value is the kit's, never AReaL's silent default.
- Keys are matched against AReaL's config dataclasses by name, recursively. A key AReaL has is copied; a key it
  lacks goes to the second result (`kit_only`, dotted names), never dropped silently.
- AReaL's mandatory keys the kit has no notion of are filled the way AReaL's own example YAMLs fill them: names and
  `fileroot` of every section by interpolation (`${experiment_name}`, `${cluster.fileroot}`), `rollout.backend` and
  `actor.backend` from the kit's backend (`sglang:d1`, `fsdp:d1`).
- Datasets: AReaL's `type` is the training method (`rl`) and `path` a local path or hub dataset; the kit's `type`
  names its packaged data (`gsm8k`, `arith`, `factbook_qa`) and `path: null` means "packaged". GSM8K maps to
  `openai/gsm8k`; the kit's offline sets have no hub twin, so their `path` names them (`areal_lite:arith`) and an
  AReaL experiment must pass its own dataset.
- Model aliases (`smollm2-135m-instruct`) are resolved to their local folder, which AReaL can load.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Dict, Optional, Tuple

__all__ = ["to_areal_config", "main"]

# Sections whose AReaL dataclass needs experiment/trial names (and some a fileroot) that the kit keeps only once.
_NAMED_SECTIONS = ("saver", "evaluator", "stats_logger", "recover", "rollout", "actor", "ref")  # ref: if set
_HUB_DATASETS = {"gsm8k": "openai/gsm8k"}


def _areal_fields(cls) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _field_class(f: dataclasses.Field):
    """The dataclass type of an AReaL field (unwrapping `X | None`), or None for a leaf."""
    import typing

    tp = f.type
    if isinstance(tp, str):  # AReaL uses postponed annotations in places
        return None
    for cand in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(cand):
            return cand
    return None


def _split(values: Dict[str, Any], areal_cls, prefix: str, kit_only: Dict[str, Any]) -> Dict[str, Any]:
    """The part of `values` AReaL's `areal_cls` knows; the rest into `kit_only` (dotted keys)."""
    import typing

    fields = _areal_fields(areal_cls)
    hints = typing.get_type_hints(areal_cls)
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            kit_only[prefix + key] = value
            continue
        sub = hints.get(key)
        sub_cls = next((c for c in (sub, *typing.get_args(sub)) if dataclasses.is_dataclass(c)), None)
        if sub_cls is not None and isinstance(value, dict):
            out[key] = _split(value, sub_cls, f"{prefix}{key}.", kit_only)
        elif sub_cls is not None and isinstance(value, (list, tuple)):  # e.g. scheduling_spec: a list of specs
            out[key] = [_split(v, sub_cls, f"{prefix}{key}.", kit_only) if isinstance(v, dict) else v for v in value]
        elif sub_cls is not None and value is not None:
            kit_only[prefix + key] = value  # same name, another meaning (e.g. the kit's `tensorboard: false`)
        else:
            out[key] = value
    return out


def _dataset(values: Optional[Dict[str, Any]], kit_only: Dict[str, Any], prefix: str) -> Optional[Dict[str, Any]]:
    if values is None:
        return None
    values = dict(values)
    kind, path = values.pop("type"), values.pop("path")
    for key in ("size", "seed"):
        kit_only[prefix + key] = values.pop(key)
    kit_only[prefix + "type"] = kind
    values["type"] = "rl"
    values["path"] = path or _HUB_DATASETS.get(kind, f"areal_lite:{kind}")
    if values.get("max_length") is None:
        values.pop("max_length", None)
    return values


def to_areal_config(path: str, profile: str = "cpu", config_cls: Any = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(AReaL 1.0.4 GRPOConfig as a dict, kit-only keys as a dotted dict) for the kit YAML at `path`.

    `config_cls`: the kit class that loads the YAML (default `TrainConfig`, which knows every key the shipped YAMLs
    use). AReaL's `load_expr_config(["--config", written_yaml], GRPOConfig)` loads the first dict.
    """
    from areal.api.cli_args import GRPOConfig as AReaLGRPOConfig

    from areal_lite.api.cli_args import load_expr_config
    from areal_lite.utils.model_store import resolve_model_path

    if config_cls is None:
        from areal_lite.kit.trainer.train import TrainConfig as config_cls
    config, _ = load_expr_config(["--config", path, f"profile={profile}"], config_cls, verbose=False)
    values = dataclasses.asdict(config)
    kit_only: Dict[str, Any] = {}
    for name in ("train_dataset", "valid_dataset"):
        values[name] = _dataset(values.get(name), kit_only, f"{name}.")
    out = _split(values, AReaLGRPOConfig, "", kit_only)

    out.setdefault("cluster", {})["fileroot"] = values.get("fileroot", "runs")
    for section in _NAMED_SECTIONS:
        if section in out and out[section] is None:
            continue  # e.g. no reference model configured
        sec = out.setdefault(section, {})
        sec["experiment_name"] = "${experiment_name}"
        sec["trial_name"] = "${trial_name}"
        if section in ("saver", "evaluator", "stats_logger", "recover"):
            sec["fileroot"] = "${cluster.fileroot}"
    backend = values.get("backend", "sglang")
    out["rollout"]["backend"] = f"{'vllm' if backend == 'vllm' else 'sglang'}:d1"
    out["actor"]["backend"] = "fsdp:d1"
    for key in ("tokenizer_path",):
        if out.get(key):
            out[key] = _model_path(out[key], resolve_model_path)
    if out["actor"].get("path"):
        out["actor"]["path"] = _model_path(out["actor"]["path"], resolve_model_path)
    for norm in ("reward_norm", "adv_norm"):  # the kit also spells "no normalisation" 'none'; AReaL only null
        for level in ("mean_level", "std_level"):
            if (out["actor"].get(norm) or {}).get(level) == "none":
                out["actor"][norm][level] = None
    return out, kit_only


def _model_path(name: str, resolve) -> str:
    """A kit alias becomes its local folder (AReaL loads folders and hub ids, not the kit's aliases)."""
    if "/" in name:
        return name
    return resolve(name)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m areal_lite.kit.areal.config",
        description="Write the AReaL 1.0.4 config of a kit YAML (kit-only keys listed).",
    )
    ap.add_argument("config", help="a kit YAML, e.g. configs/gsm8k_grpo.yaml")
    ap.add_argument("--profile", default="gpu", help="which profile to resolve (default: gpu, what AReaL runs on)")
    ap.add_argument("-o", "--output", required=True, help="the AReaL YAML to write")
    args = ap.parse_args(argv)
    import yaml

    from areal_lite.api.cli_args import ConfigError

    try:
        areal, kit_only = to_areal_config(args.config, profile=args.profile)
        with open(args.output, "w", encoding="utf-8") as fh:
            yaml.safe_dump(areal, fh, sort_keys=False)
    except (ConfigError, OSError) as e:
        print(f"areal config: {e}", file=sys.stderr)  # one line, no traceback: the message says what to fix
        return 2
    print(f"wrote {args.output}; kit-only keys left out: {', '.join(sorted(kit_only)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
