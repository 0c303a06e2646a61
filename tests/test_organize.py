import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT, hold_lock, kill_tree, run_script, tree_digest, wait_for

from pipeline.errors import UserError
from pipeline.fsutil import sha256_file
from pipeline.ownership import OWNER_FILE
from pipeline.prep.organize import JOURNAL, MANIFEST, OrganizeConfig, organize


def make_source(root: Path, n: int = 40, seed: int = 1) -> dict[str, int]:
    rng = random.Random(seed)
    sizes = {}
    for i in range(n):
        rel = f"d{i % 5}/sub{i % 3}/file_{i}.txt"
        size = rng.randint(10, 20_000)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rng.randbytes(size))
        sizes[rel] = size
    return sizes


def read_manifest(dst: Path) -> list[dict]:
    return [json.loads(line) for line in (dst / MANIFEST).read_text().splitlines()]


def test_balanced_by_bytes_and_manifest_matches_disk(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    sizes = make_source(src)
    res = organize(OrganizeConfig(src, dst, num_dirs=4))
    # largest-first greedy: the spread between splits is at most the largest file
    assert max(res.split_bytes) - min(res.split_bytes) <= max(sizes.values())
    rows = read_manifest(dst)
    assert sorted(r["source"] for r in rows) == sorted(sizes)
    for r in rows:
        placed = dst / r["destination"]
        assert r["destination"] == f"split_{r['split']:02d}/{r['source']}"
        assert placed.stat().st_size == r["bytes"] == sizes[r["source"]]
        assert sha256_file(placed) == r["sha256"] == sha256_file(src / r["source"])
    assert sorted(p.name for p in dst.iterdir()) == [OWNER_FILE, MANIFEST, "split_00", "split_01", "split_02",
                                                     "split_03"]


def test_rerun_is_a_noop_and_deterministic(tmp_path):
    src = tmp_path / "src"
    make_source(src)
    first = organize(OrganizeConfig(src, tmp_path / "a", num_dirs=3, seed=5))
    manifest = (tmp_path / "a" / MANIFEST).read_bytes()
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")}
    again = organize(OrganizeConfig(src, tmp_path / "a", num_dirs=3, seed=5))
    assert (again.written, again.unchanged, again.removed) == (0, len(first.rows), 0)
    assert (tmp_path / "a" / MANIFEST).read_bytes() == manifest
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")} == before
    organize(OrganizeConfig(src, tmp_path / "b", num_dirs=3, seed=5))
    assert (tmp_path / "b" / MANIFEST).read_bytes() == manifest


def test_changed_source_leaves_no_duplicates(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_source(src, n=12)
    organize(OrganizeConfig(src, dst, num_dirs=3))
    (src / "d0/sub0/file_0.txt").write_bytes(b"x" * 500_000)  # large now: the plan moves files around
    organize(OrganizeConfig(src, dst, num_dirs=3))
    placed = sorted(p.relative_to(dst).as_posix().split("/", 1)[1] for p in dst.rglob("*.txt"))
    assert placed == sorted(r["source"] for r in read_manifest(dst))
    assert len(placed) == len(set(placed)) == 12


def test_same_named_files_keep_their_paths(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    for folder in ("a", "b", "c"):
        (src / folder).mkdir(parents=True)
        (src / folder / "notes.txt").write_text(f"notes of {folder}\n")
    organize(OrganizeConfig(src, dst, num_dirs=2))
    texts = sorted(p.read_text() for p in dst.rglob("notes.txt"))
    assert texts == ["notes of a\n", "notes of b\n", "notes of c\n"]


def test_links_loops_and_special_files_are_skipped_and_source_untouched(tmp_path):
    src, dst, outside = tmp_path / "src", tmp_path / "dst", tmp_path / "outside.txt"
    (src / "inner").mkdir(parents=True)
    (src / "inner" / "good.txt").write_text("good\n")
    outside.write_text("secret\n")
    (src / "leak.txt").symlink_to(outside)
    (src / "inner" / "loop").symlink_to(src)
    (src / "x").symlink_to(src / "y")
    (src / "y").symlink_to(src / "x")
    (src / "dangling").symlink_to(src / "missing")
    (src / "alias.txt").symlink_to(src / "inner" / "good.txt")
    os.mkfifo(src / "pipe")
    before = tree_digest(src)
    res = organize(OrganizeConfig(src, dst, num_dirs=2))
    assert [r["source"] for r in res.rows] == ["inner/good.txt"]
    assert res.skipped == {
        "link_outside_source": ["leak.txt"],
        "link_loop": ["inner/loop", "x", "y"],
        "broken_link": ["dangling"],
        "link_inside_source": ["alias.txt"],
        "not_a_regular_file": ["pipe"],
    }
    assert tree_digest(src) == before
    assert not any("secret" in p.read_text() for p in dst.rglob("*.txt"))


def test_a_name_that_is_not_utf8_is_organized_and_printed_escaped(tmp_path):
    src = tmp_path / "src"
    make_source(src, n=3)
    (src / os.fsdecode(b"caf\xe9.txt")).write_bytes(b"latin-1 name\n")
    (src / "loop").symlink_to(src / "loop")
    proc = run_script("ORGANIZE_DATA.py", "--src_dir", src, "--dst_root", tmp_path / "dst", "--num_dirs", 2)
    assert proc.returncode == 0, proc.stderr
    assert "organized 4 files" in proc.stdout and "skipped 1 (link_loop): loop" in proc.stdout
    row = next(r for r in read_manifest(tmp_path / "dst") if r["source"].startswith("caf"))
    assert (tmp_path / "dst" / row["destination"]).read_bytes() == b"latin-1 name\n"


@contextlib.contextmanager
def unprivileged():
    """As root, run the block as user 65534 (root reads every file whatever its mode); otherwise as is."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_unreadable_file_is_skipped():
    work = Path(tempfile.mkdtemp(prefix="organize-unreadable-"))  # pytest's tmp root is private to its owner
    try:
        work.chmod(0o777)
        src = work / "src"
        src.mkdir()
        (src / "ok.txt").write_text("ok")
        (src / "locked.txt").write_text("locked")
        (src / "locked.txt").chmod(0)
        with unprivileged():
            res = organize(OrganizeConfig(src, work / "dst", num_dirs=1))
        assert res.skipped == {"unreadable": ["locked.txt"]}
        assert [r["source"] for r in res.rows] == ["ok.txt"]
    finally:
        shutil.rmtree(work)


def test_hardlink_mode_links_and_falls_back_to_copy_across_filesystems(tmp_path):
    src = tmp_path / "src"
    make_source(src, n=6)
    organize(OrganizeConfig(src, tmp_path / "dst", num_dirs=2, mode="hardlink"))
    row = read_manifest(tmp_path / "dst")[0]
    assert os.path.samefile(src / row["source"], tmp_path / "dst" / row["destination"])
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem to cross")
    other = shm / f"organize-test-{os.getpid()}"
    try:
        res = organize(OrganizeConfig(src, other, num_dirs=2, mode="hardlink"))
        assert res.copied_instead_of_linked == 6
        assert sha256_file(other / row["destination"]) == row["sha256"]
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_symlink_mode_points_at_source(tmp_path):
    src = tmp_path / "src"
    make_source(src, n=4)
    organize(OrganizeConfig(src, tmp_path / "dst", num_dirs=2, mode="symlink"))
    for r in read_manifest(tmp_path / "dst"):
        assert (tmp_path / "dst" / r["destination"]).resolve() == (src / r["source"]).resolve()


def test_refuses_a_foreign_nonempty_destination(tmp_path):
    src = tmp_path / "src"
    make_source(src, n=2)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.txt").write_text("do not lose")
    with pytest.raises(UserError, match=r"mine holds files ORGANIZE_DATA.py did not write \(thesis.txt\); refusing "
                                        "to write into it: choose an empty or new folder"):
        organize(OrganizeConfig(src, tmp_path / "mine"))
    assert (tmp_path / "mine" / "thesis.txt").read_text() == "do not lose"


def assert_manifest_is_the_disk(dst: Path) -> None:
    """Every file under dst is a manifest row with its bytes, and nothing else is there (no temporary, no journal,
    no file of an earlier plan)."""
    rows = read_manifest(dst)
    placed = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file())
    assert placed == sorted([MANIFEST, OWNER_FILE, *(r["destination"] for r in rows)])
    assert all(sha256_file(dst / r["destination"]) == r["sha256"] for r in rows)


def test_a_run_that_filled_the_disk_says_so_in_one_line_and_its_rerun_finishes(tmp_path, small_disk):
    src, dst = tmp_path / "src", small_disk.path / "splits"
    for i in range(20):
        (src / f"f{i:02d}.txt").parent.mkdir(exist_ok=True)
        (src / f"f{i:02d}.txt").write_bytes(random.Random(i).randbytes(100_000))
    full = run_script("ORGANIZE_DATA.py", "--src_dir", src, "--dst_root", dst, "--num_dirs", 3)
    assert full.returncode == 2
    assert full.stderr.startswith(f"error: cannot write {dst}/split_0") and full.stderr.count("\n") == 1
    assert "no space left on device (its file system has 0.0 MB of 1.0 MB free now)" in full.stderr
    assert (dst / JOURNAL).exists() and not (dst / MANIFEST).exists()

    small_disk.resize(8 * 2**20)
    again = run_script("ORGANIZE_DATA.py", "--src_dir", src, "--dst_root", dst, "--num_dirs", 4)  # a new plan too
    assert again.returncode == 0, again.stderr
    assert_manifest_is_the_disk(dst)
    assert len(read_manifest(dst)) == 20


def test_a_killed_run_is_finished_by_its_rerun(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "splits"
    make_source(src, n=1500)
    cmd = [sys.executable, str(ROOT / "ORGANIZE_DATA.py"), "--src_dir", str(src), "--dst_root", str(dst)]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: (dst / JOURNAL).exists() and (dst / JOURNAL).read_text().count("\n") >= 50, proc)
    kill_tree(proc)
    assert not (dst / MANIFEST).exists()

    again = run_script(*cmd[1:])
    assert again.returncode == 0, again.stderr
    assert ", unchanged 0," not in again.stdout  # the killed run's files were kept, not written again
    assert_manifest_is_the_disk(dst)
    assert len(read_manifest(dst)) == 1500


def test_a_second_run_on_the_same_destination_is_refused(tmp_path):
    make_source(tmp_path / "src", n=3)
    first = hold_lock(tmp_path / "splits", "ORGANIZE_DATA.py")
    refused = run_script("ORGANIZE_DATA.py", "--src_dir", tmp_path / "src", "--dst_root", tmp_path / "splits")
    first.kill()
    first.wait()
    assert refused.returncode == 2
    assert refused.stderr.startswith(f"error: --dst_root {tmp_path / 'splits'} is being written by ORGANIZE_DATA.py "
                                     f"(pid {first.pid} on ") and refused.stderr.count("\n") == 1
    assert not (tmp_path / "splits").exists()


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("none", ["--src_dir", "{t}/nope"], "error: --src_dir {t}/nope does not exist or is not a directory\n"),
        ("empty", ["--src_dir", "{t}/src", "--dst_root", "{t}/dst"], "error: --src_dir {t}/src holds no readable "
         "regular files\n"),
        ("file", ["--src_dir", "{t}/src", "--dst_root", "{t}/src/splits"], "error: --dst_root {t}/src/splits is "
         "inside --src_dir {t}/src; choose a folder outside it\n"),
        ("file", ["--src_dir", "{t}/src", "--num_dirs", "0"], "error: --num_dirs must be at least 1, got 0\n"),
        ("file", ["--src_dir", "{t}/src", "--dst_root", "{t}"], "error: --src_dir {t}/src is inside --dst_root {t}; "
         "writing the output would overwrite it: move it out first\n"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, setup, args, message):
    if setup != "none":
        (tmp_path / "src").mkdir()
    if setup == "file":
        (tmp_path / "src" / "a.txt").write_text("a")
    proc = run_script("ORGANIZE_DATA.py", *(a.format(t=tmp_path) for a in args))
    assert proc.returncode == 2
    assert proc.stderr == message.format(t=tmp_path)
    assert not (tmp_path / "src" / "splits").exists()


def test_cli_summary(tmp_path):
    src = tmp_path / "src"
    make_source(src, n=5)
    proc = run_script("ORGANIZE_DATA.py", "--src_dir", src, "--dst_root", tmp_path / "dst", "--num_dirs", 2)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("organized 5 files (")
    assert "written 5, unchanged 0, stale removed 0" in proc.stdout


def test_more_folders_than_files_is_one_folder_per_file(tmp_path):
    make_source(tmp_path / "src", n=2)
    res = organize(cfg := OrganizeConfig(tmp_path / "src", tmp_path / "dst", num_dirs=200_000))
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == [OWNER_FILE, MANIFEST, "split_00", "split_01"]
    assert sorted(len(list((tmp_path / "dst" / s).rglob("*.txt"))) for s in ("split_00", "split_01")) == [1, 1]
    assert len(res.rows) == 2 and (cfg.num_dirs, cfg.asked_dirs) == (2, 200_000)
