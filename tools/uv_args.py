"""Print the `uv pip install` flags that reproduce pip's own index settings on this machine.

`make` installs with uv (tens of seconds where pip took minutes), but uv reads neither pip.conf nor PIP_* variables.
A machine that points pip at a mirror, a wheel folder (`find-links`, e.g. for the CPU build of torch) or a
constraints file would silently lose them, so this reads `pip config list` and passes the same settings on.
`--index-strategy unsafe-best-match` is pip's rule: the best matching version from any index, not the first index's.
"""

from __future__ import annotations

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


def main() -> int:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""  # no pip or no config: uv's defaults (PyPI) apply
    print(shlex.join(uv_args(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
