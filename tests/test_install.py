"""The install: a Python that make accepts, and the CPU build of torch (no nvidia-* wheels)."""

import importlib.metadata
import importlib.util
import json
import os
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")


def _tool(name: str):
    """A script of tools/ (not a package module), loaded by path."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


uv_args = _tool("uv_args")


def test_no_cuda_wheels_in_cpu_install():
    if os.environ.get("AREAL_LITE_GPU_INSTALL") == "1":
        pytest.skip("GPU install: CUDA wheels are expected (set by tools/test_gpu.sh)")
    cuda = sorted(
        d.metadata["Name"]
        for d in importlib.metadata.distributions()
        if uv_args.is_cuda_package(d.metadata["Name"] or "")
    )
    assert cuda == [], f"CUDA packages in a CPU install: {cuda}"


def test_torch_is_the_pinned_cpu_build():
    if os.environ.get("AREAL_LITE_GPU_INSTALL") == "1":
        pytest.skip("GPU install")
    import torch

    assert torch.__version__.startswith("2.13.0"), torch.__version__
    assert torch.version.cuda is None


def test_uv_gets_pips_index_settings():
    """`make` installs with uv, which reads no pip configuration: tools/uv_args.py passes pip's settings on."""
    pip_config = "\n".join(
        [
            ":env:.find-links='/opt/wheels'",
            "global.cert='/etc/ssl/certs/ca-certificates.crt'",
            "global.constraint='/etc/pip/constraints.txt'",
            "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
            "global.find-links='/opt/wheels'",  # the same folder again, from the file: passed once
            "install.index-url='https://mirror.example/simple'",
        ]
    )
    assert uv_args.uv_args(pip_config) == [
        "--index-strategy", "unsafe-best-match",  # pip's rule: the best version from any index
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/pip/constraints.txt",
        "--extra-index-url", "file:///opt/a/simple",
        "--extra-index-url", "file:///opt/b/simple",
        "--index-url", "https://mirror.example/simple",
    ]  # fmt: skip
    assert uv_args.uv_args("") == ["--index-strategy", "unsafe-best-match"]  # no pip config: uv's defaults


# What `uv pip install --dry-run torch==2.13.0` prints for a fresh venv (trimmed): PyPI's Linux wheel, with its CUDA
# stack; the CPU build from a wheel folder (or PyTorch's CPU index); macOS's PyPI wheel, the CPU build under a plain
# version. uv prints its progress on stderr and the plan on stdout.
DRY_RUN_PYPI_LINUX = """Resolved 29 packages in 1.2s
Would download 24 packages
Would install 29 packages
 + cuda-bindings==13.5.0
 + filelock==4.3.1
 + nvidia-cublas==13.1.1.3
 + nvidia-cudnn-cu13==9.20.0.48
 + sympy==1.14.0
 + torch==2.13.0
 + triton==3.7.1
"""
DRY_RUN_CPU_WHEEL = """Would install 11 packages
 + filelock==4.3.1
 - setuptools==65.5.0
 + setuptools==84.2.1
 + torch==2.13.0+cpu
"""
DRY_RUN_MACOS = """Would install 10 packages
 + networkx==3.7
 + torch==2.13.0
"""


def test_torch_comes_from_pytorchs_cpu_index_only_where_it_would_bring_cuda():
    plan = uv_args.would_install
    assert plan(DRY_RUN_CPU_WHEEL) == ["filelock", "setuptools", "torch"]
    assert uv_args.cpu_torch_args(plan(DRY_RUN_PYPI_LINUX)) == [
        "--extra-index-url",
        "https://download.pytorch.org/whl/cpu",
    ]
    assert uv_args.cpu_torch_args(plan(DRY_RUN_CPU_WHEEL)) == []  # a wheel folder already gives the CPU build
    assert uv_args.cpu_torch_args(plan(DRY_RUN_MACOS)) == []  # macOS's torch from PyPI is the CPU build
    assert uv_args.cpu_torch_args(plan("")) == []  # a venv that has torch already: nothing to install
    # pip's JSON report (the TRL and vLLM venvs), trimmed to what is read
    report = {"install": [{"metadata": {"name": n, "version": "1"}} for n in ("torch", "nvidia-cudnn-cu13", "sympy")]}
    assert uv_args.pip_would_install(json.dumps(report)) == ["torch", "nvidia-cudnn-cu13", "sympy"]
    assert uv_args.cpu_torch_args(["torch", "nvidia-cudnn-cu13"]) == ["--extra-index-url", uv_args.CPU_INDEX]
    assert uv_args.is_cuda_package("nvidia_nccl_cu13") and uv_args.is_cuda_package("Triton")
    assert not uv_args.is_cuda_package("nvidia-ml-py")  # NVML's Python binding, no CUDA: AReaL imports it


def test_the_cpu_torch_probe_asks_uv_about_this_interpreter():
    """The probe end to end: uv accepts the dry run it builds (this machine's index flags included), and in a venv
    that already has the pinned CPU torch it adds nothing."""
    import subprocess
    import sys

    uv = os.path.join(os.path.dirname(sys.executable), "uv")
    script = os.path.join(TOOLS, "uv_args.py")
    for tool in (uv, "pip"):
        out = subprocess.run(
            [sys.executable, script, "--cpu-torch", tool, "torch==2.13.0"], capture_output=True, text=True
        )
        assert (out.returncode, out.stdout.strip()) == (0, ""), (tool, out.stderr)


def test_make_refuses_a_python_it_cannot_install_on_and_says_what_to_do():
    """transformers from 5.23 and AReaL 1.0.4 need 3.11 or newer; AReaL takes nothing newer than 3.12."""
    import subprocess
    import sys

    check = _tool("check_python")
    assert check.problem((3, 11)) is None and check.problem((3, 12, 1)) is None
    for version in [(3, 10), (3, 13), (3, 9)]:
        why = check.problem(version, "python3")
        assert "3.11 or 3.12" in why and f"python3 is {version[0]}.{version[1]}" in why
        assert "uv python install 3.12" in why and "PY=/path/to/python3.12" in why
    run = subprocess.run([sys.executable, os.path.join(TOOLS, "check_python.py")], capture_output=True, text=True)
    assert (run.returncode, run.stderr) == (0, "")  # this suite's own interpreter is one make accepts


def _too_new(check):
    """The suite's interpreter described as a Python 3.13 (the default python3 of newer systems)."""
    return dict(check.describe(), version=[3, 13, 0], executable="/usr/bin/python3.13")


def _folder_of(tmp_path, name, links):
    """A PATH folder holding `links` (name -> target: a symlink, or None for a pyenv-like shim that exits 127)."""
    folder = tmp_path / name
    folder.mkdir()
    for link, target in links.items():
        if target:
            os.symlink(target, folder / link)
        else:
            (folder / link).write_text("#!/bin/sh\necho 'pyenv: command not found' >&2\nexit 127\n")
            (folder / link).chmod(0o755)
    return str(folder)


def test_make_takes_python3_12_or_3_11_from_path_when_python3_is_too_new(tmp_path):
    """make's default python3 being 3.13: the first of python3.12, python3.11 on PATH that runs (a pyenv shim for a
    version not selected exits 127 and is passed over) makes .venv; a PY the learner set is refused as before, and
    with nothing on PATH the message says where make looked."""
    import sys

    check = _tool("check_python")
    real = os.path.realpath(sys.executable)
    path = _folder_of(tmp_path, "bin", {"python3.12": None, "python3.11": real})
    executable, note = check.pick("python3", given=False, env={"PATH": path}, this=_too_new(check))
    assert executable == os.path.join(path, "python3.11"), note
    assert note.startswith(f"python3 is 3.13: .venv is made with {executable} (Python 3.")
    executable, why = check.pick("python3", given=True, env={"PATH": path}, this=_too_new(check))
    assert executable is None and "python3 is 3.13" in why and "looked" not in why
    empty = _folder_of(tmp_path, "empty", {})
    executable, why = check.pick("python3", given=False, env={"PATH": empty}, this=_too_new(check))
    assert executable is None and why.endswith("(make looked for python3.12 and python3.11 on PATH: none will do.)")
    assert check.pick("python3", given=True, env={"PATH": empty})[0] == check.describe()["executable"]  # it will do


def test_make_takes_a_python_uv_knows(tmp_path):
    """A Python that `uv python install 3.12` put outside PATH: `uv python find` names it (here one on PATH under
    another name, which uv searches and make's own look does not), never a venv and never a download."""
    import sys

    check = _tool("check_python")
    uv = os.path.join(os.path.dirname(sys.executable), "uv")  # make installs uv into .venv
    assert os.path.exists(uv), "make install puts uv in the venv"
    path = _folder_of(tmp_path, "bin", {"python": os.path.realpath(sys.executable), "uv": uv})
    env = {"PATH": path, "HOME": str(tmp_path), "UV_PYTHON_INSTALL_DIR": str(tmp_path / "managed")}
    executable, note = check.pick("python3", given=False, env=env, this=_too_new(check))
    assert executable == os.path.join(path, "python") and ".venv is made with" in note


def test_make_refuses_a_python_without_its_venv_module():
    """Debian and Ubuntu ship `venv` apart (python3.12-venv): `-m venv` would leave a .venv without pip that the next
    make takes as made, so such a Python is refused first, with the package to install."""
    check = _tool("check_python")
    info = dict(check.describe(), version=[3, 12, 3], executable="/usr/bin/python3.12", venv=False)
    why = check.unusable(info, "python3")
    assert "no venv module" in why and "sudo apt install python3.12-venv" in why
    assert check.unusable(dict(info, venv=True), "python3") is None


def test_make_passes_check_python_whether_the_learner_set_py():
    """`--given` (try nothing else) only where PY came from the command line or the environment."""
    import subprocess

    root = os.path.join(os.path.dirname(__file__), "..")
    cmd = ["make", "-n", "-C", root, "/nonexistent/venv/bin/python", "VENV=/nonexistent/venv"]
    default = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "check_python.py --pick  python3)" in default
    given = subprocess.run(cmd + ["PY=python3.12"], capture_output=True, text=True, check=True).stdout
    assert "check_python.py --pick --given python3.12)" in given


def test_make_refuses_a_mac_that_torch_has_no_wheel_for():
    """torch 2.13.0's macOS wheels are for Apple Silicon on macOS 14 or newer (PyPI's files): an Intel Mac (or an
    x86-64 Python under Rosetta) and macOS 13 get a message instead of a resolver conflict; Linux is never refused."""
    check = _tool("check_python")
    intel = check.platform_problem("Darwin", "x86_64", "14.5")
    assert "no wheels for Intel Macs after torch 2.2" in intel and "Rosetta" in intel and "Linux" in intel
    old = check.platform_problem("Darwin", "arm64", "13.6.1")
    assert "macOS 14 or newer" in old and "runs macOS 13.6.1" in old
    for ok in [("Darwin", "arm64", "14.0"), ("Darwin", "arm64", "26.1"), ("Darwin", "arm64", ""), ("Linux", "x86_64")]:
        assert check.platform_problem(*ok) is None, ok
    assert check.platform_problem("Linux", "aarch64") is None


def test_make_on_windows_points_to_wsl():
    """Native Windows (a Python from python.org, or Git Bash's and MSYS2's) is refused with the way that works, WSL 2:
    the servers need POSIX process groups and signals. WSL 2 reports Linux and passes."""
    check = _tool("check_python")
    for system in ["Windows", "MSYS_NT-10.0-22631", "MINGW64_NT-10.0-22631", "CYGWIN_NT-10.0-22631"]:
        why = check.platform_problem(system, "AMD64")
        assert "WSL 2" in why and "wsl --install" in why and "/mnt/c" in why, system
    assert check.platform_problem("Linux", "x86_64") is None  # what WSL 2's Python reports


def test_a_wheelhouse_lists_the_venvs_pins_and_the_build_backend():
    """`make wheelhouse` fetches what .venv holds, pinned, without the kit itself (editable) or a local path, and adds
    the build backend the editable install needs where the venv lacks it."""
    wheelhouse = _tool("wheelhouse")
    freeze = "\n".join(
        [
            "areal==1.0.4",
            "-e file:///work/areal-lite",
            "mylib @ file:///tmp/mylib",
            "torch==2.13.0+cpu",
            "setuptools==84.2.1",
            "",
        ]
    )
    assert wheelhouse.requirements(freeze, ["setuptools>=77", "wheel"]) == [
        "areal==1.0.4",
        "torch==2.13.0+cpu",
        "setuptools==84.2.1",
        "wheel",
    ]
    assert "Python 3." in wheelhouse.platform_line()


def test_make_with_a_wheelhouse_installs_from_it_alone():
    """`make install WHEELHOUSE=DIR` passes every install (pip's bootstrap of uv, each uv call) the folder and no
    index, and asks no index where torch's CPU build is; without it, pip's own settings apply as before."""
    import subprocess

    root = os.path.join(os.path.dirname(__file__), "..")
    cmd = ["make", "-n", "-C", root, "install", "VENV=/nonexistent/venv"]
    offline = subprocess.run(cmd + ["WHEELHOUSE=/srv/wheels"], capture_output=True, text=True, check=True).stdout
    installs = [line for line in offline.splitlines() if " install " in line]
    assert len(installs) == 3 and all("--no-index --find-links /srv/wheels" in line for line in installs), installs
    assert "download.pytorch.org" not in offline and "uv_args.py" not in offline
    online = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "--no-index" not in online


def test_check_machine_says_what_a_machine_falls_short_of():
    """`make check-machine`'s lines against the recorded peaks: enough memory, too little for some runs (named, with
    what to do), one core, a small disk and a container's small /dev/shm."""
    check = _tool("check_machine")
    gib = 1 << 30
    peaks = {"demo": 5.59, "01_setup": 2.16, "11_environment": 6.97, "12_judge": 6.47}
    assert (
        check.memory_line(16 * gib, peaks) == "memory: 16.0 GiB free: ok (the largest peak, 11_environment, is 7.0 GiB)"
    )
    short = check.memory_line(6 * gib, peaks)
    assert short.startswith("memory: 6.0 GiB free: too little for 11, 12 (up to 7.0 GiB); close other programs")
    assert "make demo" in check.memory_line(5 * gib, peaks) and "Colab" in short
    assert "cannot tell" in check.memory_line(None, peaks)
    assert check.cores_line(2).endswith("ok") and "slower" in check.cores_line(1)
    assert "first time figure" in check.cpu_line("AMD EPYC", "fpu avx2 avx512f avx512bw", "x86_64")
    assert "second (slower)" in check.cpu_line("AMD EPYC 7B13", "fpu sse4_2 avx2 fma", "x86_64")
    assert "bench/notebook_times.py 04 --json runs/" in check.cpu_line("Apple M2", "", "arm64")
    assert check.disk_line(int(50e9)).endswith(
        f"(about {check.DISK_GB} GB needed)"
    ) and "too little" in check.disk_line(int(1e9))
    assert "written to disk" in check.shm_line(64 << 20) and check.shm_line(8 * gib).endswith("ok")
    assert f"about {check.DISK_GB} GB in all" in " ".join(open(os.path.join(TOOLS, "..", "README.md")).read().split())
    assert set(check.recorded_peaks()) >= {"demo", "01_setup"}  # the committed record
    ps = "\n".join(["  1  9040 /sbin/init", "4242 1048576 /venv/bin/python -m ipykernel_launcher -f k.json",
                    "4243 1572864 /venv/bin/python -m areal_lite.kit.server --model-path m --port 1"])  # fmt: skip
    found = check.kit_processes(ps)
    assert [(role, pid) for role, pid, _ in found] == [("notebook kernel", 4242), ("inference server", 4243)]
    assert "2.5 GiB" in check.running_line(found) and "Shut Down Kernel" in check.running_line(found)
    assert check.running_line([]).endswith("ok")


def test_check_machine_runs_without_the_venv():
    """It runs on the interpreter `make` starts from (standard library only) and, on a machine the kit supports,
    exits 0 with one line per check."""
    import shutil
    import subprocess

    python = shutil.which("python3")
    run = subprocess.run([python, os.path.join(TOOLS, "check_machine.py")], capture_output=True, text=True)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    labels = [line.split(":")[0] for line in lines]
    assert labels[:7] == ["python", "system", "cpu", "cores", "running", "memory", "disk"]


def test_check_machine_into_a_reader_that_left_ends_quietly():
    """`make check-machine | head -1`: its lines meet a pipe nobody reads (closed before it starts, so every write
    fails), and it ends with status 0 and nothing on stderr, not a BrokenPipeError traceback."""
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        run = subprocess.run([sys.executable, os.path.join(TOOLS, "check_machine.py")], stdout=write_end,
                             stderr=subprocess.PIPE, timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert (run.returncode, run.stderr) == (0, b"")


def test_make_demo_and_lab_hear_from_check_machine_only_when_something_is_short(monkeypatch, capsys):
    """`--before-run` (what `make demo` and `make lab` run first) prints nothing when memory, cores and the running kit
    are fine, and one prefixed line for what is short, for the runs asked about (`--runs demo`)."""
    monkeypatch.syspath_prepend(TOOLS)  # as when it runs as a script
    check = _tool("check_machine")
    # this machine as a learner's: nothing of the kit running (the suite's own servers are), two cores
    monkeypatch.setattr(check, "kit_processes", lambda ps: [])
    monkeypatch.setattr(check.machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(check, "free_memory", lambda: 64 << 30)
    assert check.main(["--before-run"]) == 0 and capsys.readouterr().out == ""
    monkeypatch.setattr(check, "free_memory", lambda: 3 << 30)
    check.main(["--before-run", "--runs", "demo"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("check-machine: memory: 3.0 GiB free: too little for make demo (up to")
    assert "04" not in out[0]  # only the demo was asked about
    check.main(["--before-run"])
    every = capsys.readouterr().out
    assert "too little for 04, " in every and "01" not in every  # notebook 01 peaks under 3 GiB
    monkeypatch.setattr(check, "free_memory", lambda: 64 << 30)
    monkeypatch.setattr(check, "kit_processes", lambda ps: [("notebook kernel", 4242, 1 << 30)])
    check.main(["--before-run"])
    assert capsys.readouterr().out.startswith("check-machine: running: notebook kernel 4242 (1.0 GiB)")
