"""Exit with a message unless this interpreter is Python 3.11 or 3.12 on a machine that PyTorch 2.13.0 has wheels for:
`make` runs it before creating the venv.

transformers (from 5.23) and AReaL 1.0.4 (`make lab`, `make test`, notebook 08) need 3.11 or newer, and AReaL takes
nothing newer than 3.12. torch 2.13.0 is on PyPI for Linux and, on macOS, for Apple Silicon from macOS 14: Intel Macs
have no torch after 2.2, and macOS 13 none after 2.11. On Windows the kit itself needs Linux (process groups, signals,
/dev/shm), which WSL 2 is. Checked first, so the learner reads what to do rather than a resolver conflict after the
venv and uv are installed. Written for any Python 3 (it runs under the interpreter it judges).

`--pick PY` prints the interpreter make creates .venv with: PY when it will do. When it will not and the learner did
not choose it (no `--given`: make's default python3), the first of python3.12, python3.11 on PATH, then one uv knows
(`uv python find`: what `uv python install 3.12` put outside PATH) that will: a new system's python3 is often 3.13 or
newer. A Python without its venv module (Debian and Ubuntu ship it apart) is refused here: `-m venv` would leave a
.venv without pip that the next make takes as made.
"""

import json
import os
import platform
import shutil
import subprocess
import sys

SUPPORTED = ((3, 11), (3, 12))


def problem(version, python="python3"):
    """Why `version` (a (major, minor) pair) will not do, or None."""
    if tuple(version[:2]) in SUPPORTED:
        return None
    return (
        "areal-lite needs Python 3.11 or 3.12{}, and {} is {}.{}. Install one beside it: `uv python install 3.12` "
        "(uv: https://docs.astral.sh/uv/), `brew install python@3.12` on macOS, or your system's python3.12 package "
        "(Ubuntu: the deadsnakes PPA). make then finds python3.12 on PATH or through uv; or name it: make demo "
        "PY=/path/to/python3.12.".format(
            " (AReaL 1.0.4 takes nothing newer)" if tuple(version[:2]) > (3, 12) else "", python, *version[:2]
        )
    )


def platform_problem(system, machine, mac_release=""):
    """Why torch 2.13.0 has no wheel for this OS and CPU (`platform.system()`, `.machine()`, `.mac_ver()[0]`); None
    where it has one."""
    if system == "Windows" or system.startswith(("CYGWIN", "MSYS", "MINGW")):
        return (
            "areal-lite runs on Linux or macOS, not on Windows itself (its servers use process groups, POSIX signals "
            "and /dev/shm). Use WSL 2, a Linux inside Windows: run `wsl --install` in PowerShell, open Ubuntu, and "
            "clone and run make there, in the Linux home folder (~), not under /mnt/c, which is much slower."
        )
    if system != "Darwin":
        return None
    elsewhere = "run areal-lite on Linux instead (a VM or a container, or Colab's CPU runtime: notebooks/README.md)"
    if machine != "arm64":
        intel = "areal-lite needs torch 2.13.0, and PyTorch publishes no wheels for Intel Macs after torch 2.2"
        rosetta = "If this Mac has Apple Silicon, this Python is an x86-64 one running under Rosetta: use an arm64 one."
        return "{}: {}. {}".format(intel, elsewhere, rosetta)
    try:
        major = int(mac_release.split(".")[0])
    except ValueError:
        return None  # an unknown release: let the installer decide
    if major < 14:
        return (
            "areal-lite needs torch 2.13.0, whose Apple Silicon wheels need macOS 14 or newer, and this Mac runs "
            "macOS {}: update macOS, or {}.".format(mac_release, elsewhere)
        )
    return None


CANDIDATES = ("python3.12", "python3.11")
UV_REQUEST = ">=3.11,<3.13"


def describe():
    """This interpreter as `unusable` reads it (JSON-ready: another interpreter prints it for `probe`)."""
    import importlib.util

    return {
        "executable": sys.executable,
        "version": list(sys.version_info[:3]),
        "system": platform.system(),
        "machine": platform.machine(),
        "mac": platform.mac_ver()[0],
        "venv": importlib.util.find_spec("ensurepip") is not None,
    }


def probe(python, env=None):
    """`describe()` as the interpreter `python` (a command or a path) runs it, or None where it does not run (a pyenv
    shim for a version not selected exits 127)."""
    code = "import json, sys; sys.path.insert(0, {!r}); import check_python as c; print(json.dumps(c.describe()))"
    try:
        run = subprocess.run(
            [python, "-c", code.format(os.path.dirname(os.path.abspath(__file__)))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            universal_newlines=True,
            timeout=30,
            env=env,
        )
        return json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def unusable(info, name):
    """Why the interpreter `info` (`describe()`'s fields) cannot make the kit's venv, or None."""
    why = problem(info["version"], name) or platform_problem(info["system"], info["machine"], info["mac"])
    if why or info["venv"]:
        return why
    return (
        "{} ({}) has no venv module, which Debian and Ubuntu package apart: install it (`sudo apt install "
        "python{}.{}-venv`) and run make again.".format(name, info["executable"], *info["version"][:2])
    )


def candidates(env=None):
    """Commands or paths of the Pythons make may take instead of python3: python3.12 and python3.11 on PATH, then
    the one `uv python find` names (uv-managed installs included; never a venv, never a download)."""
    path = (env or os.environ).get("PATH")
    found = [shutil.which(name, path=path) for name in CANDIDATES]
    uv = shutil.which("uv", path=path)
    if uv:
        cmd = [uv, "python", "find", "--system", "--no-project", "--no-python-downloads", UV_REQUEST]
        try:
            run = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True, timeout=60, env=env
            )
            found.append(run.stdout.strip() if run.returncode == 0 else None)
        except (OSError, subprocess.SubprocessError):
            pass
    return [f for f in found if f]


def pick(name, given, env=None, this=None):
    """(executable, note) of the interpreter to create .venv with, or (None, what to do). `name` is PY, `this` its
    `describe()` (by default the interpreter running this); `given`: the learner chose it, so nothing else is tried."""
    this = this or describe()
    why = unusable(this, name)
    if not why:
        return this["executable"], None
    if given or platform_problem(this["system"], this["machine"], this["mac"]):
        return None, why
    for candidate in candidates(env):
        info = probe(candidate, env)
        if info and not unusable(info, candidate):
            was = "{}.{}".format(*this["version"][:2])
            return info["executable"], "{} is {}: .venv is made with {} (Python {}.{}.{})".format(
                name, was, info["executable"], *info["version"]
            )
    if problem(this["version"], name):
        uv = " and asked uv" if shutil.which("uv", path=(env or os.environ).get("PATH")) else ""
        why += " (make looked for python3.12 and python3.11 on PATH{}: none will do.)".format(uv)
    return None, why


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("python", nargs="?", default=sys.executable, help="the name make knows this interpreter by (PY)")
    ap.add_argument("--pick", action="store_true", help="print the interpreter to make .venv with, or exit with why")
    ap.add_argument("--given", action="store_true", help="with --pick: the learner set PY, so try nothing else")
    args = ap.parse_args(argv)
    if not args.pick:
        return unusable(describe(), args.python)
    executable, note = pick(args.python, args.given)
    if executable is None:
        return note
    if note:
        print("check_python: " + note, file=sys.stderr)
    print(executable)
    return None


if __name__ == "__main__":
    sys.exit(main())
