"""Exit with a message unless this interpreter is Python 3.11 or 3.12: `make` runs it before creating the venv.

transformers (from 5.23) and AReaL 1.0.4 (`make lab`, `make test`, notebook 08) need 3.11 or newer, and AReaL takes
nothing newer than 3.12. Checked first, so the learner reads what to do rather than a resolver conflict after the
venv and uv are installed. Written for any Python 3 (it runs under the interpreter it judges).
"""

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


if __name__ == "__main__":
    why = problem(sys.version_info, sys.argv[1] if len(sys.argv) > 1 else sys.executable)
    if why:
        sys.exit(why)
