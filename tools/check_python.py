"""Exit with a message unless this interpreter is Python 3.11 or 3.12 on a machine that PyTorch 2.13.0 has wheels for:
`make` runs it before creating the venv.

transformers (from 5.23) and AReaL 1.0.4 (`make lab`, `make test`, notebook 08) need 3.11 or newer, and AReaL takes
nothing newer than 3.12. torch 2.13.0 is on PyPI for Linux and, on macOS, for Apple Silicon from macOS 14: Intel Macs
have no torch after 2.2, and macOS 13 none after 2.11. On Windows the kit itself needs Linux (process groups, signals,
/dev/shm), which WSL 2 is. Checked first, so the learner reads what to do rather than a resolver conflict after the
venv and uv are installed. Written for any Python 3 (it runs under the interpreter it judges).
"""

import platform
import sys

SUPPORTED = ((3, 11), (3, 12))


def problem(version, python="python3"):
    """Why `version` (a (major, minor) pair) will not do, or None."""
    if tuple(version[:2]) in SUPPORTED:
        return None
    return (
        "areal-lite needs Python 3.11 or 3.12, and {} is {}.{}. Install one (for example `uv python install 3.12`, "
        "or python3.12 from your system's packages) and run make again with PY=python3.12.".format(python, *version[:2])
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


if __name__ == "__main__":
    why = problem(sys.version_info, sys.argv[1] if len(sys.argv) > 1 else sys.executable) or platform_problem(
        platform.system(), platform.machine(), platform.mac_ver()[0]
    )
    if why:
        sys.exit(why)
