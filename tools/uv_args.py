"""Print the `uv pip install` flags that reproduce pip's own index settings on this machine.

`make` installs with uv (tens of seconds where pip took minutes), but uv reads neither pip.conf nor PIP_* variables.
A machine that points pip at a mirror, a wheel folder (`find-links`, e.g. for the CPU build of torch) or a
constraints file would silently lose them, so this reads `pip config list` and passes the same settings on.
`--index-strategy unsafe-best-match` is pip's rule: the best matching version from any index, not the first index's.

`--cpu-torch UV SPEC` prints where the CPU build of torch comes from instead: nothing where these settings already
give it (a wheel folder; macOS, whose PyPI torch is the CPU build), else PyTorch's CPU index. PyPI's Linux torch is
the CUDA build, with 2.7 GB of nvidia-* wheels besides its own 1 GB: a dry run of uv says which wheels `SPEC` brings.
`--cpu-torch pip SPEC` asks pip instead (the TRL and vLLM venvs install with pip, `tools/install_*.sh`).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

# pip option -> uv flag (one flag per value; pip separates several values with whitespace).
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def uv_args(pip_config: str) -> list[str]:
    """Flags for the lines of `pip config list` (`global.find-links='/opt/wheels'`, `:env:.find-links=...`)."""
    args, seen = ["--index-strategy", "unsafe-best-match"], set()
    for line in pip_config.splitlines():
        key, sep, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if not sep or option not in FLAGS:
            continue
        for item in shlex.split(value)[0].split() if value.strip() else []:
            if (option, item) not in seen:
                seen.add((option, item))
                args += [FLAGS[option], item]
    return args


CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# NVML's pure-Python binding (tens of kB, no CUDA): AReaL's and SGLang's imports need it on any machine
NOT_CUDA = {"nvidia-ml-py"}


def is_cuda_package(name: str) -> bool:
    """Whether distribution `name` is part of a CUDA stack (the libraries a CPU install must not pull)."""
    name = name.lower().replace("_", "-")
    return name.startswith(("nvidia-", "triton", "cuda-")) and name not in NOT_CUDA


def would_install(dry_run: str) -> list[str]:
    """The distributions a `uv pip install --dry-run` output would install (its ` + name==version` lines)."""
    return [line.split("+", 1)[1].strip().split("==")[0] for line in dry_run.splitlines() if line.startswith(" + ")]


def pip_would_install(report: str) -> list[str]:
    """The distributions a `pip install --dry-run --report -` JSON report would install."""
    return [item["metadata"]["name"] for item in json.loads(report)["install"]]


def cpu_torch_args(names: list[str]) -> list[str]:
    """Flags that make the torch install the CPU build: PyTorch's CPU index if a dry run brings CUDA packages."""
    return ["--extra-index-url", CPU_INDEX] if any(map(is_cuda_package, names)) else []


def pip_config() -> str:
    try:
        return subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""  # no pip or no config: uv's defaults (PyPI) apply


def dry_run_plan(tool: str, spec: str) -> list[str]:
    """What installing `spec` into this interpreter would install, by a dry run of `tool` ("pip", or uv's path, with
    pip's settings passed on); [] when the dry run fails (the install itself will then fail and say why)."""
    if tool == "pip":
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", spec]
    else:
        cmd = [tool, "pip", "install", "--dry-run", "--python", sys.executable, *uv_args(pip_config()), spec]
    dry = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if dry.returncode != 0:
        return []
    return pip_would_install(dry.stdout) if tool == "pip" else would_install(dry.stdout + dry.stderr)


def main(argv: list[str]) -> int:
    if not argv:
        print(shlex.join(uv_args(pip_config())))
    elif argv[0] == "--cpu-torch" and len(argv) == 3:
        print(shlex.join(cpu_torch_args(dry_run_plan(*argv[1:]))))
    else:
        print(f"usage: {sys.argv[0]} [--cpu-torch UV|pip SPEC]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
