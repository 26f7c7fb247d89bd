"""tools/gpu_check.py without a GPU: the requirements it reads from a wheel, and the parts a payload travels in
(split here, received one call at a time there, joined and checked)."""

from __future__ import annotations

import importlib.util
import os
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tools", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_requirements_are_those_of_python_312_on_linux_without_extras(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    metadata = "\n".join([
        "Metadata-Version: 2.1", "Name: demo", "Version: 1.0",
        "Requires-Dist: plain>=1",
        'Requires-Dist: old-only; python_version < "3.12"',
        'Requires-Dist: new-only; python_version >= "3.12"',
        'Requires-Dist: windows-only; sys_platform == "win32"',
        'Requires-Dist: linux-only; sys_platform == "linux" and platform_machine == "x86_64"',
        'Requires-Dist: dev-tool; extra == "dev"',
    ])  # fmt: skip
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", metadata)
    assert gpu_check.wheel_requirements(str(wheel)) == ["plain", "new-only", "linux-only"]


def test_every_kit_dependency_is_staged_or_in_the_image():
    staged = {gpu_check.norm(n) for n in gpu_check.kit_requirements()}
    assert {"nbval", "ipykernel", "reasoning-gym", "gguf"} <= staged  # the runner and what the image lacks
    assert not staged & gpu_check.IMAGE_PACKAGES


def test_a_payload_travels_in_parts_and_is_checked_when_joined(tmp_path):
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "model.gguf").write_bytes(os.urandom(2_500_000))  # over two 1 MiB parts
    tar_path = tmp_path / "payload.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(payload, arcname="payload")
    stage, work = tmp_path / "stage", tmp_path / "work"
    manifest = gpu_check.split(str(tar_path), str(stage), 1, {"gguf": "model.gguf"})
    assert manifest["parts"] == 3 and sorted(os.listdir(stage)) == ["part-00", "part-01", "part-02"]
    assert all(os.path.getsize(stage / p / "chunk") <= 2**20 for p in os.listdir(stage))

    (work / "stale").mkdir(parents=True)  # left by an earlier transfer: part-00 starts afresh
    gpu_check.receive(str(stage / "part-00"), str(work))
    assert not (work / "stale").exists()
    gpu_check.receive(str(stage / "part-01"), str(work))
    with pytest.raises(SystemExit, match="part-02 never arrived"):
        gpu_check.unpack(manifest, str(work))
    gpu_check.receive(str(stage / "part-02"), str(work))
    out = gpu_check.unpack(manifest, str(work))
    assert (payload / "model.gguf").read_bytes() == open(os.path.join(out, "model.gguf"), "rb").read()

    chunk = work / "part-01"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 1  # one bit flipped on the way
    chunk.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256"):
        gpu_check.unpack(manifest, str(work))
