"""File helpers and checkpoint pruning: what is on disk after each operation."""

import os

import pytest

from pipeline import fsutil
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


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_swaps_in_the_new_folder_and_removes_the_old(tmp_path, monkeypatch, exchange):
    """Both ways: one exchanging rename, and (a file system without RENAME_EXCHANGE) two renames."""
    if not exchange:
        monkeypatch.setattr(fsutil, "_exchange", lambda a, b: False)
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


def test_a_folder_hidden_by_a_replace_killed_between_its_renames_is_restored(tmp_path):
    import subprocess
    import sys

    from conftest import run_script

    from pipeline.ownership import mark

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("new text\n")
    old = tmp_path / f".out.replaced-{gone.stdout.strip()}"  # what the kill left: no out/, the old dataset hidden
    mark(old, "dataset", "DATA-HF.py")
    (old / "state.json").write_text("{}")
    again = run_script("DATA-HF.py", "--data_folder", tmp_path / "data", "--save_dir", tmp_path / "out")
    assert (tmp_path / "out" / "state.json").read_text() == "{}" and not old.exists()  # restored, then refused:
    assert again.returncode == 2 and "already exists" in again.stderr  # it is a dataset, kept without --overwrite


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


def test_a_hash_stamp_vouches_only_for_a_file_already_old_when_it_was_read(tmp_path):
    import hashlib
    import time

    from pipeline.content_hash import HashRecord

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"a" * 100)
    record = HashRecord(tmp_path / "record.json")
    assert record.digest("m", f) == hashlib.sha256(b"a" * 100).hexdigest()
    assert record.trusted("m", f) is None  # written in the tick it was read in: a change now could keep its time
    os.utime(f, ns=(time.time_ns(), time.time_ns() - 10**10))
    record.digest("m", f)  # its time changed: read again, and now old enough
    assert record.trusted("m", f) is not None
    assert record.save()
    assert HashRecord(tmp_path / "record.json").stamps == record.stamps
    f.write_bytes(b"b" * 100)  # same size, new time
    assert record.trusted("m", f) is None
    assert record.digest("m", f) == hashlib.sha256(b"b" * 100).hexdigest()
    (tmp_path / "record.json").write_text('{"m": [1, 2]}')  # damaged: an empty record, never an error
    assert HashRecord(tmp_path / "record.json").stamps == {}
