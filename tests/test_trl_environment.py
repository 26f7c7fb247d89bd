"""Notebook 11's `Warehouse`, unchanged, under TRL 1.16's `GRPOTrainer(environment_factory=...)` (`make test-trl-env`;
marker `trl`, left out of `make test`).

Needs TRL's own venv (`make trl`: `.venv-trl`); skipped without it. The class is the notebook source's code cell,
written to a file as it is; `tools/trl_environment.py` runs in TRL's venv, gives TRL no reward function, and trains
two steps on SmolLM2-135M-Instruct. Checked: both steps ran, TRL found the class's tools and used `get_reward` as
the reward source, and every prompt carried the question `reset` returned. (The untrained model writes no Hermes
tool call in TRL's format, so the rewards are 0: what is proven is the contract, not learning.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from _sources import code_cells

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_PYTHON = os.path.join(ROOT, os.environ.get("TRL_VENV", ".venv-trl"), "bin", "python")

pytestmark = [
    pytest.mark.trl,
    pytest.mark.skipif(not os.path.exists(TRL_PYTHON), reason="TRL's venv is not installed: `make trl`"),
]


def notebook_class_cell(name: str, cls: str) -> str:
    """The code cell of notebook `name`'s source that defines class `cls` (read by the notebooks' own builder)."""
    defines = re.compile(rf"^class {cls}\b", re.M)
    found = [source for source in code_cells(name) if defines.search(source)]
    assert len(found) == 1, f"{name}: {len(found)} code cells define class {cls}"
    return found[0]


def test_the_notebook_environment_trains_two_steps_under_trl(smollm_path, tmp_path):
    env_file = tmp_path / "warehouse.py"
    env_file.write_text(notebook_class_cell("11_environment", "Warehouse") + "\n", encoding="utf-8")
    out = tmp_path / "trl.json"
    cmd = [TRL_PYTHON, "tools/trl_environment.py", "--model", smollm_path, "--seeds", "4", "--steps", "2",
           "--env", f"{env_file}:Warehouse", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ,
                          "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["trl"] == "1.16.0" and result["steps_run"] == 2
    assert result["tools"] == ["count", "report"] and result["reward_sources"] == ["Warehouse"]
    assert all(step["reward_mean"] is not None for step in result["per_step"])
    rollouts = sum(step["rollouts"] for step in result["per_step"])
    assert result["prompts_with_observation"] == rollouts > 0  # reset(**row)'s question reached every prompt
