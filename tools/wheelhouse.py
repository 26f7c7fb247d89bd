"""Every wheel `make lab` installs, in one folder, so that a workshop's machines install with no internet.

    make wheelhouse                          # online, once per kind of machine: wheelhouse/ (0.9 GB, Linux x86-64)
    make prepare lab WHEELHOUSE=wheelhouse   # on each learner's machine, offline, in a copy of the clone with it

Why: a room of laptops downloading a gigabyte each from PyPI at the same time is the slowest, least reliable part of a
workshop. The models and data already come inside Python packages, so the wheels are all a machine needs.

What goes in: what `.venv` holds after `make install-dev` (`uv pip freeze`, exact versions, the kit itself left out)
and the build backend its editable install needs (pyproject's `build-system`). `pip wheel --no-deps` copies each wheel
an index has and builds one where a package ships only its source (antlr4-python3-runtime 4.9.3, which AReaL's
math-verify pins), so the learners' machines compile nothing. torch's CPU build comes from pip's own settings (a wheel
folder, a mirror), else from PyTorch's CPU index, as `make` takes it. The wheels fit this kind of machine: operating
system, CPU architecture and Python minor version, written into the folder (`PLATFORM`); make one folder per kind.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirements(freeze: str, build_requires: list[str]) -> list[str]:
    """The pins to fetch: `freeze`'s lines (`uv pip freeze`) without editable or local installs, then the build
    backend's requirements not pinned already."""
    pins = [line.strip() for line in freeze.splitlines() if line.strip() and not line.startswith(("-e", "#"))]
    pins = [p for p in pins if " @ " not in p]  # a direct reference (a local path) is nothing an index has
    pinned = {p.split("==")[0].lower() for p in pins}
    extra = [r for r in build_requires if re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() not in pinned]
    return pins + extra


def platform_line() -> str:
    """What the wheels fit, e.g. "Linux x86_64, Python 3.11"."""
    return f"{platform.system()} {platform.machine()}, Python {sys.version_info[0]}.{sys.version_info[1]}"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {sys.argv[0]} UV FOLDER  (run by `make wheelhouse`, with .venv's Python)", file=sys.stderr)
        return 2
    from uv_args import CPU_INDEX  # tools/ is this script's folder, on sys.path when it runs

    uv, folder = argv
    freeze = subprocess.run([uv, "pip", "freeze", "--python", sys.executable], capture_output=True, text=True)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        build_requires = tomllib.load(f)["build-system"]["requires"]
    if freeze.returncode != 0:
        print(f"wheelhouse: `uv pip freeze` failed: {freeze.stderr.strip()}", file=sys.stderr)
        return 1
    pins = requirements(freeze.stdout, build_requires)
    os.makedirs(folder, exist_ok=True)
    listing = os.path.join(folder, "requirements.txt")
    with open(listing, "w", encoding="utf-8") as f:
        f.write("\n".join(pins) + "\n")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--prefer-binary", "-w", folder]
    torch = [p for p in pins if p.lower().startswith("torch==")]
    rest = [p for p in pins if p not in torch]
    # torch's CPU build (2.13.0+cpu) is on PyTorch's index, not PyPI: asked there only if pip's settings lack it
    ok = subprocess.run(cmd + rest).returncode == 0 and (
        not torch
        or subprocess.run(cmd + torch, capture_output=True).returncode == 0
        or subprocess.run(cmd + ["--extra-index-url", CPU_INDEX] + torch).returncode == 0
    )
    if not ok:
        print(f"wheelhouse: pip could not fetch or build every wheel of {listing} (see above)", file=sys.stderr)
        return 1
    with open(os.path.join(folder, "PLATFORM"), "w", encoding="utf-8") as f:
        f.write(platform_line() + "\n")
    wheels = [n for n in os.listdir(folder) if n.endswith(".whl")]
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in wheels) / 1e9
    print(f"{folder}: {len(wheels)} wheels, {size:.1f} GB, for {platform_line()}. On a machine of that kind, in a "
          f"copy of this clone with {folder}/ in it: make prepare lab WHEELHOUSE={folder}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
