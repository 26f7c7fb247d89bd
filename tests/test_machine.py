"""`utils.machine`: the CPU line every run prints (model, usable cores, vector ISA), on Linux, a Mac and in a
container with a CPU quota; the generation a VM's CPU numbers name; and the room a container's memory limit leaves."""

from __future__ import annotations

from areal_lite.utils.machine import cpu_generation, describe, describe_line


def test_the_machine_line_names_model_cores_and_isa():
    m = describe()
    assert m["cpu_model"] and m["cores"] >= 1 and m["vector_isa"]
    assert describe_line() == f"CPU: {m['cpu_model']}, {m['cores']} cores, {m['vector_isa']}"


def test_the_generation_is_read_off_the_cpus_numbers():
    """The CPUs the kit's records come from (VMs all named "AMD EPYC" or "Intel(R) Xeon(R) Processor") by their
    `cpu_id`, some at the edges of a generation's range of models; numbers outside the table name none."""
    cases = {
        "family 23 model 49 stepping 0, cache 512 KB": "Zen 2",
        "family 23 model 127 stepping 0": "Zen 2",
        "family 23 model 8 stepping 2": "",  # a Zen+: no record comes from one, so the table leaves it out
        "family 25 model 1 stepping 1, cache 512 KB": "Zen 3",
        "family 25 model 17 stepping 1, cache 1024 KB": "Zen 4",
        "family 25 model 33 stepping 0": "Zen 3",
        "family 25 model 97 stepping 2": "Zen 4",
        "family 26 model 2 stepping 0": "Zen 5",
        "family 6 model 207 stepping 2, cache 307200 KB": "Emerald Rapids",
        "family 6 model 143 stepping 8": "Sapphire Rapids",
        "family 6 model 208 stepping 0": "",
        "": "",
        "family 25": "",  # no model number
        "family x model 1": "",
    }
    assert {numbers: cpu_generation(numbers) for numbers in cases} == cases


def test_the_machine_line_on_apple_silicon(monkeypatch):
    """A Mac has no /proc/cpuinfo and torch calls its Arm kernels "DEFAULT": the line names the chip (sysctl) and
    NEON, not "arm, ... DEFAULT". Where sysctl fails, `platform` still names something."""
    import subprocess

    import torch

    from areal_lite.utils import device, machine

    monkeypatch.setattr(machine, "cpuinfo", lambda path="/proc/cpuinfo": {})
    monkeypatch.setattr(machine.sys, "platform", "darwin")
    monkeypatch.setattr(machine.platform, "machine", lambda: "arm64")
    monkeypatch.setattr(machine.platform, "processor", lambda: "arm")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(device, "cpu_native_bf16", lambda: "")
    calls = []

    def sysctl(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="Apple M2\n", stderr="")

    monkeypatch.setattr(machine.subprocess, "run", sysctl)
    assert describe_line().startswith("CPU: Apple M2, ") and describe_line().endswith(" cores, NEON")
    assert calls[0] == ["sysctl", "-n", "machdep.cpu.brand_string"]
    monkeypatch.setattr(machine.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no"))
    assert machine.cpu_model() == "arm"


def test_the_cpu_model_on_arm_linux(monkeypatch):
    """Arm Linux's /proc/cpuinfo names no model (part numbers only): `lscpu` does ("Cortex-A76", "Neoverse-N1")."""
    import subprocess

    from areal_lite.utils import machine

    monkeypatch.setattr(machine, "cpuinfo", lambda path="/proc/cpuinfo": {"CPU part": "0xd0b"})
    monkeypatch.setattr(machine.sys, "platform", "linux")
    lscpu = "Architecture:  aarch64\nVendor ID:     ARM\nModel name:    Cortex-A76\nThread(s) per core:  1\n"
    monkeypatch.setattr(machine.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, lscpu, ""))
    assert machine.cpu_model() == "Cortex-A76"
    monkeypatch.setattr(machine.subprocess, "run", lambda cmd, **kw: (_ for _ in ()).throw(FileNotFoundError(cmd[0])))
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    assert machine.cpu_model() == "aarch64"  # no lscpu: what platform knows


def cgroup_tree(tmp_path, proc: str, files: dict) -> tuple:
    """A fresh cgroup file tree under `tmp_path`: `files` ({path: text}) and /proc/self/cgroup's `proc`; returns the
    (proc_cgroup, root) paths the cgroup readers take."""
    root = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    (root / "self-cgroup").write_text(proc)
    return str(root / "self-cgroup"), str(root)


def test_a_cgroup_cpu_quota_caps_the_usable_cores(tmp_path, monkeypatch):
    """A container's `--cpus` or a Kubernetes CPU limit (a JupyterHub's pods) leaves every host core in the affinity:
    the usable cores are the quota's, rounded up, in cgroup v2 (the group or any group above it) and v1 alike."""
    from areal_lite.utils import machine

    def limit(proc: str, files: dict):
        return machine.cgroup_cpu_limit(*cgroup_tree(tmp_path, proc, files))

    assert limit("0::/\n", {"cpu.max": "200000 100000"}) == 2  # a container's own namespace
    assert limit("0::/\n", {"cpu.max": "max 100000"}) is None
    nested = {"kubepods/pod1/cpu.max": "150000 100000", "kubepods/pod1/c1/cpu.max": "max 100000"}
    assert limit("0::/kubepods/pod1/c1\n", nested) == 2  # the pod's 1.5 CPUs, rounded up
    v1 = {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"}
    assert limit("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n", v1) == 3
    unlimited = {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}  # this CI machine's kind
    assert limit("1:cpu:/\n", unlimited) is None
    assert machine.cgroup_cpu_limit(str(tmp_path / "absent"), str(tmp_path)) is None  # not Linux
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: 2)
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert machine.usable_cores() == 2
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: None)
    assert machine.usable_cores() == 64


def test_a_cgroup_memory_limit_is_the_room_left_under_it(tmp_path):
    """A container's `--memory` or a JupyterHub pod's limit, less what the group uses, in v2 (the tightest of the group
    and the groups above it) and v1; no limit ("max", v1's 2^63 rounded to a page) and no /proc: None."""
    from areal_lite.utils import machine

    def room(proc: str, files: dict):
        return machine.cgroup_memory_room(*cgroup_tree(tmp_path, proc, files))

    gib = 1 << 30
    assert room("0::/\n", {"memory.max": str(8 * gib), "memory.current": str(3 * gib)}) == 5 * gib
    assert room("0::/\n", {"memory.max": "max", "memory.current": str(gib)}) is None
    nested = {"hub/pod1/memory.max": str(4 * gib), "hub/pod1/memory.current": str(gib),
              "hub/pod1/c1/memory.max": "max", "hub/pod1/c1/memory.current": str(gib)}  # fmt: skip
    assert room("0::/hub/pod1/c1\n", nested) == 3 * gib
    v1 = {"memory/docker/abc/memory.limit_in_bytes": str(2 * gib), "memory/docker/abc/memory.usage_in_bytes": str(gib)}
    assert room("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n", v1) == gib
    unlimited = {"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "1"}
    assert room("3:memory:/\n", unlimited) is None
    full = {"memory.max": str(gib), "memory.current": str(2 * gib)}  # over its limit, reclaiming: no room
    assert room("0::/\n", full) == 0
    assert machine.cgroup_memory_room(str(tmp_path / "absent"), str(tmp_path)) is None
