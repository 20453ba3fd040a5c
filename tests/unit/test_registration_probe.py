"""scripts/registration_probe.py: its chunked registrations cover the buffer exactly and are
all undone; without a GPU it refuses with a reason, and bad arguments are one line."""

from __future__ import annotations

import pytest
import torch

from tests.support.scripts import load_script

probe = load_script("registration_probe")


class RecordingRegistrar:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple[int, int]] = []

    def register(self, ptr: int, nbytes: int) -> None:
        assert not any(
            start < ptr + nbytes and ptr < start + size for start, size in self.live.items()
        ), "overlapping registrations"
        self.live[ptr] = nbytes
        self.calls.append((ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]


def test_each_chunk_size_registers_the_whole_buffer_once_and_undoes_it():
    registrar = RecordingRegistrar()
    nbytes = 128 << 20
    rows = probe.chunks(registrar, nbytes)
    assert [row["chunk_bytes"] for row in rows] == [nbytes, 64 << 20, 4 << 20]
    assert [row["calls"] for row in rows] == [1, 2, 32]
    assert registrar.live == {}
    base = registrar.calls[0][0]
    offset = 0
    for row in rows:
        calls = registrar.calls[offset : offset + row["calls"]]
        offset += row["calls"]
        assert [ptr - base for ptr, _ in calls] == list(range(0, nbytes, row["chunk_bytes"]))
        assert {size for _, size in calls} == {row["chunk_bytes"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_with_a_reason(capsys):
    assert probe.main(["--gib", "0.01"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--gib", "0"], "error: --gib must be positive, got 0.0"),
        (["--json", "/no/such/folder/x.json"], "error: --json: no folder /no/such/folder"),
    ],
)
def test_bad_arguments_are_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as exited:
        probe.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].endswith(said) and "Traceback" not in err
