"""kvcore.pin_progress: a pool's pinned prefix, written by one process and read by another."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from kvcore.pin_progress import PinProgress, PinWatch, progress_path


def test_a_watch_sees_the_total_and_each_published_prefix(tmp_path: Path) -> None:
    assert PinWatch.open("engine-r0", tmp_path) is None  # nothing pinning yet
    progress = PinProgress("engine-r0", 1000, tmp_path)
    watch = PinWatch.open("engine-r0", tmp_path)
    assert watch is not None and (watch.total, watch.ready) == (1000, 0)
    progress.publish(64)
    assert watch.ready == 64
    progress.publish(32)  # never back
    assert watch.ready == 64
    progress.publish(1000)
    assert watch.ready == 1000
    with pytest.raises(ValueError, match="1001 pinned slots of 1000"):
        progress.publish(1001)
    progress.close()
    # The file goes; a watch that mapped it keeps the last count.
    assert not progress_path("engine-r0", tmp_path).exists()
    assert watch.ready == 1000
    watch.close()
    assert PinWatch.open("engine-r0", tmp_path) is None
    with pytest.raises(RuntimeError, match="closed"):
        progress.publish(1)


def test_a_new_progress_replaces_a_file_a_crashed_run_left(tmp_path: Path) -> None:
    old = PinProgress("e", 10, tmp_path)
    old.publish(10)
    fresh = PinProgress("e", 20, tmp_path)
    watch = PinWatch.open("e", tmp_path)
    assert watch is not None and (watch.total, watch.ready) == (20, 0)
    watch.close()
    fresh.close()


def test_keys_become_one_file_name_in_the_directory(tmp_path: Path) -> None:
    path = progress_path("a/b c:1-r0", tmp_path)
    assert path.parent == tmp_path and path.name == "kvcore-pinned-a_b_c_1-r0"
    with pytest.raises(ValueError):
        progress_path("", tmp_path)


def test_a_file_not_yet_sized_is_not_read(tmp_path: Path) -> None:
    progress_path("e", tmp_path).write_bytes(b"")
    assert PinWatch.open("e", tmp_path) is None


def _pin(directory: str, started, go) -> None:
    progress = PinProgress("worker-r0", 512, Path(directory))
    started.set()
    go.wait(10)
    progress.publish(256)
    progress.close()


def test_another_process_sees_the_prefix_its_writer_published(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    started, go = context.Event(), context.Event()
    writer = context.Process(target=_pin, args=(str(tmp_path), started, go))
    writer.start()
    try:
        assert started.wait(30)
        watch = PinWatch.open("worker-r0", tmp_path)
        assert watch is not None and (watch.total, watch.ready) == (512, 0)
        go.set()
        writer.join(30)
        assert writer.exitcode == 0 and watch.ready == 256
        watch.close()
    finally:
        if writer.is_alive():
            writer.kill()
