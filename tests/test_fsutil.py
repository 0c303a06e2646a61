"""File helpers and checkpoint pruning: what is on disk after each operation."""

import os

import pytest

from pipeline.fsutil import replace_dir, sha256_file, write_atomic, write_text_atomic
from pipeline.train.checkpoint import to_prune


def test_write_text_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    write_text_atomic(target, "new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_atomic_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")

    def write_half_then_fail(fh):
        fh.write(b"ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, write_half_then_fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_replace_dir_swaps_in_the_new_folder_and_removes_the_old(tmp_path):
    target, new = tmp_path / "hf", tmp_path / ".hf.partial"
    target.mkdir()
    (target / "model.safetensors").write_text("old weights")
    new.mkdir()
    (new / "model.safetensors").write_text("new weights")
    replace_dir(new, target)
    assert (target / "model.safetensors").read_text() == "new weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    fresh = tmp_path / ".best.partial"
    fresh.mkdir()
    replace_dir(fresh, tmp_path / "best")  # no previous folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "hf"]


def test_sha256_file_reads_in_blocks(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(1000) * 20_000)  # 20 MB: several 8 MB blocks
    import hashlib

    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def names(*steps: int) -> list[str]:
    return [f"step-{s:08d}" for s in steps]


def test_prune_keeps_the_newest_k():
    assert to_prune(names(5, 10, 15, 20), 2, {}) == names(5, 10)
    assert to_prune(names(5, 10), 2, {}) == []
    assert to_prune(names(5, 10, 15), 3, {}) == []


def test_prune_keeps_the_checkpoint_before_skipped_steps_while_one_after_them_is_kept():
    skipped = {"step-00000015": 2}  # steps between 10 and 15 were skipped (non-finite)
    assert to_prune(names(5, 10, 15, 20), 2, skipped) == names(5)  # 10 survives: the last one before the skips
    assert to_prune(names(5, 10, 15, 20, 25), 2, skipped) == names(5, 10, 15)  # no kept one follows skips
    assert to_prune(names(10, 15, 20, 25), 3, skipped) == []
