"""Crashes and re-runs of `python -m areal_lite.kit.trainer.train`, with real processes: no orphans when the trainer is
SIGKILLed, no weight versions left in /dev/shm once a later run ends, and a run folder never silently reused.

One real training run on the tiny model is started and SIGKILLed (as the OOM killer would) once its reward pool,
a checkpoint and a weight version exist; the tests then look at what it left and run the same command again. The
remaining tests drive the run folder and weight folder rules directly (`kit.trainer.rundir`, `utils.weight_dirs`), with
small helper processes where a live or dead owner matters.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import List

import psutil
import pytest
import torch
from test_procs import wait_until  # one copy of the polling helper

from areal_lite.api.cli_args import GRPOConfig, RecoverConfig
from areal_lite.kit.trainer.rundir import RunDirError, open_run_dir
from areal_lite.kit.trainer.train import main
from areal_lite.utils import weight_dirs
from areal_lite.utils.model_store import build_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
SHM_ROOT = os.path.join("/dev/shm", f"areal-lite-{os.environ.get('USER') or os.getuid()}")


def train_args(model: str, fileroot, experiment: str, steps: int) -> List[str]:
    """The demo config shrunk to the tiny model: 2 prompts x 2 samples x 4 tokens a step, a checkpoint each step."""
    return [
        "--config",
        os.path.join(ROOT, "configs", "arith_grpo_demo.yaml"),
        f"actor.path={model}",
        f"tokenizer_path={model}",
        f"fileroot={fileroot}",
        f"experiment_name={experiment}",
        f"total_train_steps={steps}",
        "valid_dataset=null",
        "gconfig.max_new_tokens=4",
        "gconfig.n_samples=2",
        "train_dataset.batch_size=2",
        "saver.freq_steps=1",
        "actor.threads=1",
        "embedded.threads=1",
    ]


def run_cli(args: List[str], timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "areal_lite.kit.trainer.train", *args]
    return subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE  # is_running also checks the start time
    except psutil.NoSuchProcess:
        return True


def files_under(path: str) -> List[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]


@dataclass
class KilledRun:
    model: str
    fileroot: str
    experiment: str
    run_dir: str
    shm_dir: str  # /dev/shm/areal-lite-<user>/<experiment>
    descendants: List[psutil.Process]  # every process below the trainer when it was killed
    cmdlines: List[str]  # theirs, read before the kill
    shm_files: List[str]  # the weight files in /dev/shm when it was killed


def _ready(proc: subprocess.Popen, run_dir: str, shm_dir: str, log: str) -> bool:
    """The trainer has a reward pool (a forkserver with workers), a checkpoint and a weight version in /dev/shm."""
    if proc.poll() is not None:
        raise AssertionError(f"the training run exited with {proc.returncode}:\n{open(log).read()[-3000:]}")
    if not os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000001", "trainer_state.pt")):
        return False
    if not glob.glob(os.path.join(shm_dir, "*", "weights*", "weight_update_v*")):
        return False
    kids = psutil.Process(proc.pid).children(recursive=True)
    return any("forkserver" in " ".join(k.cmdline()) and k.children() for k in kids)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, tiny_model_path):
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("needs a writable /dev/shm (where weight versions go by default)")
    fileroot = str(tmp_path_factory.mktemp("faults"))
    experiment = f"faults-{uuid.uuid4().hex[:8]}"  # its own /dev/shm folder: other runs on this machine are not ours
    run_dir = os.path.join(fileroot, experiment, "run0")  # the demo config's trial name
    shm_dir = os.path.join(SHM_ROOT, experiment)
    log = os.path.join(fileroot, "killed.log")
    cmd = [PY, "-m", "areal_lite.kit.trainer.train", *train_args(tiny_model_path, fileroot, experiment, 500)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    descendants: List[psutil.Process] = []
    try:
        assert wait_until(lambda: _ready(proc, run_dir, shm_dir, log), timeout=300), open(log).read()[-3000:]
        descendants = psutil.Process(proc.pid).children(recursive=True)
        cmdlines = [" ".join(p.cmdline()) for p in descendants]
        proc.send_signal(signal.SIGKILL)  # no atexit, no finally, no finalizer runs in the trainer
        proc.wait(timeout=30)
        shm_files = files_under(shm_dir)  # a later start removes them: any run sweeps dead runs' folders
        yield KilledRun(tiny_model_path, fileroot, experiment, run_dir, shm_dir, descendants, cmdlines, shm_files)
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in descendants:  # whatever a failing test left behind
            if not gone(p):
                p.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_sigkilled_trainer_leaves_no_process(killed_run):
    """Failure 6: the reward pool's workers, its forkserver and resource tracker, and the server go with it."""
    names = killed_run.cmdlines
    assert sum("multiprocessing.forkserver" in c for c in names) >= 2, names  # the forkserver and its workers
    assert any("resource_tracker" in c for c in names) and any("areal_lite.kit.server" in c for c in names), names
    wait_until(lambda: all(gone(p) for p in killed_run.descendants), timeout=30)
    left = [c for p, c in zip(killed_run.descendants, names) if not gone(p)]
    assert not left, f"{len(left)} processes outlived the SIGKILLed trainer by 30 s: {left}"


def test_rerun_without_resume_refuses_and_keeps_the_run(killed_run):
    """Failure 8: the same command again, without --resume, refuses in one line and changes nothing."""
    stats = os.path.join(killed_run.run_dir, "stats.jsonl")
    before = (open(stats).read(), sorted(os.listdir(os.path.join(killed_run.run_dir, "checkpoints"))))
    args = train_args(killed_run.model, killed_run.fileroot, killed_run.experiment, 500)
    out = run_cli(args, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    message = out.stderr.strip().splitlines()[-1]
    assert "already holds a run" in message and "--resume" in message and "trial_name=" in message, message
    assert (open(stats).read(), sorted(os.listdir(os.path.join(killed_run.run_dir, "checkpoints")))) == before


def test_restart_resumes_and_removes_what_the_killed_run_left(killed_run):
    """Failure 7 (and AReaL's recover.mode=auto): the killed run left weight versions in /dev/shm; the restarted
    run continues from the last checkpoint, and once it ends nothing of either run is left there."""
    assert any("weight_update_v" in f for f in killed_run.shm_files), killed_run.shm_files
    ckpts = sorted(os.listdir(os.path.join(killed_run.run_dir, "checkpoints")))
    last = max(int(d[5:]) for d in ckpts if d.startswith("step_") and d[5:].isdigit())
    args = train_args(killed_run.model, killed_run.fileroot, killed_run.experiment, last + 2)
    out = run_cli([*args, "recover.mode=auto"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"at step {last}" in out.stdout
    with open(os.path.join(killed_run.run_dir, "stats.jsonl")) as fh:
        assert [json.loads(line)["step"] for line in fh] == list(range(last + 2))
    assert not os.path.exists(killed_run.shm_dir), files_under(killed_run.shm_dir)


# ------------------------------------------------------------------------------------------------ run folders


def config(tmp_path, mode: str = "disabled", trial: str = "t") -> GRPOConfig:
    return GRPOConfig(
        experiment_name="e", trial_name=trial, fileroot=str(tmp_path), recover=RecoverConfig(mode=mode),
        weight_update_dir=str(tmp_path / "w"),
    )  # fmt: skip


def fake_run(tmp_path, run_id: str, ckpt_run_id: str = None) -> str:
    """A run folder as a run leaves it: run.json, one stats line and a checkpoint of `ckpt_run_id`."""
    run = config(tmp_path)
    opened = open_run_dir(run)
    opened.close()
    info = os.path.join(opened.path, "run.json")
    with open(info) as fh:
        data = json.load(fh)
    data["run_id"] = run_id
    with open(info, "w") as fh:
        json.dump(data, fh)
    with open(os.path.join(opened.path, "stats.jsonl"), "w") as fh:
        fh.write('{"step": 0}\n')
    ckpt = os.path.join(opened.path, "checkpoints", "step_000001")
    os.makedirs(ckpt)
    torch.save({"step": 1, "run_id": ckpt_run_id or run_id}, os.path.join(ckpt, "trainer_state.pt"))
    return opened.path


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_recover_mode_on_continues_this_run_or_starts_fresh(tmp_path, mode):
    fresh = open_run_dir(config(tmp_path, mode))
    fresh.close()
    assert not fresh.resume and os.path.isfile(os.path.join(fresh.path, "run.json"))
    path = fake_run(tmp_path / "used", "a" * 32)
    run = open_run_dir(config(tmp_path / "used", mode))
    assert run.resume and run.run_id == "a" * 32 and run.checkpoint == os.path.join(path, "checkpoints", "step_000001")
    run.close()


def test_recover_refuses_another_runs_checkpoint(tmp_path, capsys, tiny_model_path):
    """`--resume` on a folder whose checkpoint another run wrote: one line, before anything starts."""
    path = fake_run(tmp_path, "a" * 32, ckpt_run_id="b" * 32)
    with pytest.raises(RunDirError, match="not written by the run recorded in"):
        open_run_dir(config(tmp_path, "auto"))
    args = train_args(tiny_model_path, tmp_path, "e", 3)
    assert main([*args, "trial_name=t", f"weight_update_dir={tmp_path / 'w'}", "--resume"]) == 2
    assert "refusing to continue another run's checkpoint" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(path, "logs")), "no server may start"


def test_fresh_start_on_a_used_folder_refuses_or_moves_on(tmp_path, capsys):
    path = fake_run(tmp_path, "a" * 32)
    for mode in ("disabled", "off"):
        with pytest.raises(RunDirError, match=r"already holds a run .*--resume.*trial_name=t-2"):
            open_run_dir(config(tmp_path, mode))
    cfg = config(tmp_path)
    run = open_run_dir(cfg, existing="new_trial")  # train() from a notebook: running a cell again runs it again
    run.close()
    assert cfg.trial_name == "t-2" and run.path == os.path.join(str(tmp_path), "e", "t-2") and not run.resume
    assert open(os.path.join(path, "stats.jsonl")).read() == '{"step": 0}\n'  # the old run is untouched
    assert "holds an earlier run" in capsys.readouterr().out


def test_folder_in_use_by_a_live_run_is_refused(tmp_path):
    first = open_run_dir(config(tmp_path))
    try:
        with pytest.raises(RunDirError, match="in use by a live run"):
            open_run_dir(config(tmp_path, "on"))
    finally:
        first.close()
    open_run_dir(config(tmp_path, "on")).close()  # free again once the first run ended


# ------------------------------------------------------------------------------------------------ weight folders

CLAIM = (
    "import os, sys\n"
    "from areal_lite.utils.weight_dirs import claim_weight_dir\n"
    "path = claim_weight_dir(os.path.join(sys.argv[1], 'e', 't', 'weights'), sweep_root=sys.argv[1])\n"
    "open(os.path.join(path, 'blob'), 'w').write('x')\n"
    "print(path, flush=True)\n"
    "sys.stdin.read()\n"  # a holder lives until killed; the others get an empty stdin and end at once
)


def claim(root, hold: bool = False):
    """A process that claims a weight folder under `root`: (process, path). With `hold` it stays alive (until
    killed); without, it has ended when this returns."""
    stdin = subprocess.PIPE if hold else subprocess.DEVNULL
    proc = subprocess.Popen([PY, "-c", CLAIM, str(root)], env=ENV, stdin=stdin, stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    if not hold:
        proc.wait(timeout=60)
    return proc, path


def test_weight_folders_belong_to_live_runs_only(tmp_path):
    """A live run's folder is never touched; a second live run gets the next slot; a killed run's folder, and a
    folder of the former per-pid scheme whose process is gone, are removed by the next run, which leaves nothing."""
    legacy_dead = tmp_path / "old" / "t" / "weights-999999999"  # above any pid_max: no such process
    legacy_live = tmp_path / "old" / "t" / f"weights-{os.getpid()}"
    for d in (legacy_dead, legacy_live):
        d.mkdir(parents=True)
    owner, first = claim(tmp_path, hold=True)
    try:
        _, second = claim(tmp_path)
        assert first.endswith("/e/t/weights") and second.endswith("/e/t/weights.1")
        assert os.path.exists(os.path.join(first, "blob")) and not os.path.exists(second)
        assert not legacy_dead.exists() and legacy_live.exists()
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        assert os.path.exists(os.path.join(first, "blob"))  # a killed run cannot clean up ...
        _, third = claim(tmp_path)  # ... the next run does, and removes its own folder at exit
        assert third == first and not os.path.exists(tmp_path / "e")
    finally:
        if owner.poll() is None:
            owner.kill()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: float32 master weights, written as float32
def test_a_run_refuses_to_start_without_room_for_its_weight_versions(
    tmp_path, capsys, monkeypatch, tiny_model_path, dtype
):
    per_version = weight_dirs.version_bytes(tiny_model_path, "float32")
    assert per_version > 0
    usage = shutil.disk_usage(str(tmp_path))
    # The file system holding the weight folder reports room for most of a version, where a run needs one (each
    # overwrites the one it replaces); any other folder (the model's, outside tmp_path) has room: the check must ask
    # about the weight folder.
    assert not os.path.abspath(tiny_model_path).startswith(str(tmp_path))
    short = usage._replace(free=per_version * 9 // 10)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: short if str(path).startswith(str(tmp_path)) else usage)
    args = train_args(tiny_model_path, tmp_path, "e", 3)
    assert main([*args, f"weight_update_dir={tmp_path / 'w'}", f"actor.dtype={dtype}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 weight version of" in err[0] and "weight_update_dir=" in err[0], err
    assert not os.path.exists(tmp_path / "e" / "run0" / "logs"), "no server may start"


def test_unusable_folders_and_a_damaged_checkpoint_are_one_line_errors(tmp_path, capsys, tiny_model_path):
    """A fileroot or weight_update_dir that cannot be written is refused before a server starts; a checkpoint with a
    damaged file names the folder to remove (torch's own message named neither), and nothing is deleted."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for key, args in [
        ("fileroot", train_args(tiny_model_path, blocker, "e", 1)),
        ("weight_update_dir", [*train_args(tiny_model_path, tmp_path, "e", 1), f"weight_update_dir={blocker}/w"]),
    ]:
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"set {key}= to a folder you can write" in err[0], err
    assert not glob.glob(str(tmp_path / "e" / "*" / "logs" / "*")), "no server may start"

    args = train_args(tiny_model_path, tmp_path, "d", 2)
    assert main(args) == 0
    newest = tmp_path / "d" / "run0" / "checkpoints" / "step_000002"
    state = newest / "actor" / "actor_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # cut short, as a full disk leaves it
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint {newest} cannot be read" in err[0] and "remove that folder" in err[0], err
    assert state.exists()
    shutil.rmtree(newest)  # what the message says to do: the checkpoint before it is used
    other = str(tmp_path / "narrow")
    build_tiny_model(other, hidden_size=32)
    capsys.readouterr()
    assert main([*args, f"actor.path={other}", "--resume"]) == 2  # another model than the run's: not "damaged"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds another model's weights than actor.path=" in err[0], err
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0  # the run's own settings: nothing to report
    assert "differ from the checkpoint's run" not in capsys.readouterr().out
    assert main([*args, "actor.optimizer.lr=0.001", "seed=7", "--resume"]) == 0  # new settings are not silent
    out = capsys.readouterr().out
    assert "actor.optimizer.lr=0.001 is not applied: the checkpoint's schedule keeps lr=1e-05" in out, out
    changed = [line for line in out.splitlines() if "differ from the checkpoint's run" in line]
    assert len(changed) == 1 and "actor.optimizer.lr: 1e-05 -> 0.001" in changed[0], out
    assert "; seed: 1 -> 7" in changed[0], out
