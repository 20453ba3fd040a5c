"""scripts/vllm_live_setup.sh: the carry's packing, per-part staging, joining and install,
on two small wheels made here (no network, no GPU)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_live_setup.sh"
PART_BYTES = 4096

pytestmark = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("bash", "split", "sha256sum", "tar")),
    reason="needs bash and coreutils",
)


def make_wheel(directory: Path, name: str, payload: bytes) -> Path:
    """A minimal wheel whose module holds ``payload``'s hex (random, so it compresses badly)."""
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": f"PAYLOAD = {payload.hex()!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    wheel = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for path, text in {**files, f"{info}/RECORD": record}.items():
            archive.writestr(path, text)
    return wheel


def run(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PART_SIZE": str(PART_BYTES),
        "PARTS_ROOT": str(tmp_path / "repo"),
        "STAGE": str(tmp_path / "stage"),
        "VSITE": str(tmp_path / "vsite"),
        "KSITE": "",
        "PYTHON": sys.executable,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=check
    )


@pytest.fixture
def packed(tmp_path: Path) -> dict[str, bytes]:
    rng = random.Random(20)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (tmp_path / "repo").mkdir()
    payloads = {name: rng.randbytes(3000) for name in ("kvc_fake_one", "kvc_fake_two")}
    for name, payload in payloads.items():
        make_wheel(wheels, name, payload)
    run(tmp_path, "pack", str(wheels))
    return payloads


def parts(tmp_path: Path) -> list[Path]:
    folders = sorted((tmp_path / "repo").glob(".whl-vllm-part-*"), key=lambda p: int(p.name[15:]))
    return [next(folder.glob("vllm-live.tar.part-*")) for folder in folders]


def test_pack_cuts_the_tar_into_numbered_folders_whose_parts_rejoin_to_it(tmp_path, packed):
    pieces = parts(tmp_path)
    assert len(pieces) > 2
    assert all(p.stat().st_size == PART_BYTES for p in pieces[:-1])
    assert 0 < pieces[-1].stat().st_size <= PART_BYTES
    sums = (pieces[0].parent / "SHA256SUMS").read_text().split("\n")
    whole = hashlib.sha256(b"".join(p.read_bytes() for p in pieces)).hexdigest()
    assert f"{whole}  vllm-live.tar" in sums
    for piece in pieces:
        assert f"{hashlib.sha256(piece.read_bytes()).hexdigest()}  {piece.name}" in sums
        assert (piece.parent / "SHA256SUMS").read_text() == "\n".join(sums)


def test_device_installs_once_every_part_is_staged_in_any_order(tmp_path, packed):
    pieces = parts(tmp_path)
    order = list(range(1, len(pieces) + 1))
    order.insert(0, order.pop())  # the last part first: staging is not installing
    for n in order[:-1]:
        out = run(tmp_path, "device", str(n)).stdout
        assert "staged" in out and "installed" not in out
        assert not (tmp_path / "vsite").exists()
    assert "installed into" in run(tmp_path, "device", str(order[-1])).stdout
    for name, payload in packed.items():
        module = (tmp_path / "vsite" / f"{name}.py").read_text()
        assert module == f"PAYLOAD = {payload.hex()!r}\n"


def test_device_refuses_a_corrupted_part_and_installs_nothing(tmp_path, packed):
    pieces = parts(tmp_path)
    data = bytearray(pieces[1].read_bytes())
    data[100] ^= 0x01
    pieces[1].write_bytes(bytes(data))
    for n in range(1, len(pieces) + 1):
        result = run(tmp_path, "device", str(n), check=False)
        assert (result.returncode != 0) == (n == 2)
    assert not (tmp_path / "vsite").exists()


def test_device_refuses_a_part_that_is_not_there(tmp_path, packed):
    result = run(tmp_path, "device", "99", check=False)
    assert result.returncode != 0 and "no part 99" in result.stderr
    assert run(tmp_path, "device", "x", check=False).returncode == 2


def test_llama_config_has_the_8b_shape_and_its_kv_size(tmp_path):
    module = load_script("llama_config")
    path = module.main([str(tmp_path / "model")])
    config = json.loads(path.read_text())
    assert config["num_hidden_layers"] == 32 and config["hidden_size"] == 4096
    assert config["num_attention_heads"] == 32 and config["num_key_value_heads"] == 8
    assert config["architectures"] == ["LlamaForCausalLM"]
    # 4096 tokens of it are the 537 MB a CPU-tier hit moves (REFERENCE.md §6).
    assert module.kv_bytes_per_token(config) * 4096 == 536_870_912
    small = module.llama_config(layers=16, hidden=2048)
    assert small["num_attention_heads"] == 16 and module.kv_bytes_per_token(small) == 65536


@pytest.mark.parametrize(("hidden", "kv_heads"), [(4000, 8), (4096, 5), (4096, 0)])
def test_llama_config_refuses_shapes_llama_cannot_have(hidden, kv_heads):
    with pytest.raises(ValueError):
        load_script("llama_config").llama_config(hidden=hidden, kv_heads=kv_heads)
