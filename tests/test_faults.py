"""Fault tests without the shared reference run: damaged checkpoints, failed writes, another world size or global
batch, divergence, the resume guard, a killed launcher. Split from test_resume.py so the two halves run on both
pytest workers at once."""

import json
import os
import shutil
import signal

import psutil
import pytest
import torch
from conftest import ROOT, events, kill_tree, losses, preflight_errors, root_cause, run_script, torchrun, wait_for
from test_resume import args, start, train

pytestmark = pytest.mark.slow


def test_damaged_and_incomplete_checkpoints(train_env, tmp_path):
    run = tmp_path / "r"
    assert train(train_env, tmp_path, "--max-steps", 10).returncode == 0
    shard = run / "checkpoints" / "step-00000010" / "__1_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    junk = run / "checkpoints" / "step-00000007"
    junk.mkdir()
    (junk / "__0_0.distcp").write_bytes(b"partial")
    refused = train(train_env, tmp_path, "--max-steps", 15)
    assert refused.returncode != 0
    message = (f"error: checkpoint step-00000010 is damaged: {shard} is truncated ({size // 2} of {size} bytes); "
               "resume from the previous one with --resume-from step-00000005")
    # torchrun stops the other worker as soon as one fails, so it may not get to print its own copy
    assert refused.stderr.count(message + "\n") >= 1, refused.stderr[-2000:]
    resumed = train(train_env, tmp_path, "--max-steps", 15, "--resume-from", "step-00000005")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "ignoring incomplete checkpoint step-00000007" in (run / "train.log").read_text()
    assert not junk.exists(), "removed once a newer complete checkpoint exists"
    assert json.loads((run / "state.json").read_text())["checkpoints"] == ["step-00000010", "step-00000015"]


def test_a_lost_or_emptied_state_json_is_rebuilt_and_nothing_complete_is_thrown_away(train_env, tmp_path):
    """state.json is a pointer: gone, the resume guard still holds (the fingerprint comes from the newest checkpoint);
    emptied, the rerun resumes from the newest complete checkpoint instead of starting over on top of it."""
    run = tmp_path / "r"
    assert train(train_env, tmp_path, "--max-steps", 10).returncode == 0  # checkpoints at steps 5 and 10
    (run / "state.json").unlink()
    guarded = train(train_env, tmp_path, "--max-steps", 15, "--seed", "1")
    assert guarded.returncode != 0
    assert f"error: refusing to resume {run}: seed was 0 and is now 1;" in guarded.stderr, guarded.stderr[-2000:]
    (run / "state.json").write_text("")
    resumed = train(train_env, tmp_path, "--max-steps", 15)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{run / 'state.json'} is empty or unreadable: rebuilt from the checkpoints" in resumed.stdout
    assert "resumed from" in resumed.stdout and "at step 10" in resumed.stdout
    assert json.loads((run / "state.json").read_text())["checkpoints"] == ["step-00000010", "step-00000015"]


def test_write_failure_on_one_rank_keeps_the_previous_checkpoint(train_env, tmp_path):
    run = tmp_path / "r"
    assert train(train_env, tmp_path, "--max-steps", 5).returncode == 0
    blocker = run / "checkpoints" / "step-00000010" / "__1_0.distcp"
    blocker.mkdir(parents=True)  # rank 1 cannot create its shard file there
    failed = train(train_env, tmp_path, "--max-steps", 10)
    assert failed.returncode != 0
    line = root_cause(failed.stderr)
    assert line.startswith("error: checkpoint step-00000010"), line
    assert line.endswith("nothing was marked complete and the previous checkpoint step-00000005 is intact: "
                             "rerun the same command to resume from it")
    state = json.loads((run / "state.json").read_text())
    assert (state["step"], state["checkpoints"]) == (5, ["step-00000005"])
    blocker.rmdir()
    again = train(train_env, tmp_path, "--max-steps", 10)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and json.loads((run / "state.json").read_text())["step"] == 10


def test_a_checkpoint_that_fills_the_disk_says_so_and_the_rerun_resumes_once_there_is_room(train_env, tmp_path,
                                                                                           small_disk):
    small_disk.resize(3 * 2**20)  # step 5's checkpoint (about 2 MB) fits, step 10's does not
    run = small_disk.path / "r"
    full = train(train_env, small_disk.path, "--max-steps", 10, "--cache-dir", tmp_path / "cache")
    assert full.returncode != 0
    line = root_cause(full.stderr)
    assert line.startswith(f"error: checkpoint step-00000010 could not be written: no space left on device in "
                           f"{run / 'checkpoints'} (0.0 MB free, and the previous checkpoint took "), line
    assert line.endswith("the previous checkpoint step-00000005 is intact: rerun the same command to resume "
                             "from it")
    assert "/pipeline/" not in full.stderr  # no traceback through our code on any rank (torchrun prints its own)
    small_disk.resize(64 * 2**20)
    again = train(train_env, small_disk.path, "--max-steps", 10, "--cache-dir", tmp_path / "cache")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and json.loads((run / "state.json").read_text())["step"] == 10


def test_resume_with_another_world_size(train_env, tmp_path):
    # 2 ranks -> 1, the same global batch of 4 blocks; the other way (whole tensors into shards) is
    # test_strategies' ddp -> fsdp2 chain
    one = train(train_env, tmp_path / "a", "--max-steps", 10, "-b", 2)
    assert one.returncode == 0, one.stderr[-3000:]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    same = train(train_env, tmp_path / "a", "-b", 2)
    other = train(train_env, tmp_path / "b", "-b", 4, nproc=1)
    for proc in (same, other):
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resumed from" in proc.stdout
    expected, got = losses(tmp_path / "a" / "r"), losses(tmp_path / "b" / "r")
    assert sorted(got) == sorted(expected) == list(range(1, 21))
    for step in range(1, 21):  # resharded model and optimizer: equal up to the reduction order, not bitwise
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step


def test_another_global_batch_and_lr_continue_from_the_next_unseen_block(train_env, tmp_path):
    assert train(train_env, tmp_path, "--max-steps", 5).returncode == 0
    more = train(train_env, tmp_path, "--max-steps", 8, "-b", 1, "--lr", "1e-3")
    assert more.returncode == 0, more.stderr[-3000:]
    assert ("global batch changed from 4 to 2 blocks: continuing from the next unseen block (20 consumed in "
            "epoch 0)") in more.stdout
    state = json.loads((tmp_path / "r" / "state.json").read_text())
    assert state["samples_seen"] == 5 * 4 + 3 * 2
    # demo.yaml: peak 3e-3, 5 warm-up steps, cosine to step 8; the new peak takes over from step 5 (the lr logged
    # is the one each step applied: step 5 the last of the warm-up's, 4/5 of the old peak)
    assert "--lr changed from 0.003 to 0.001: the schedule continues at step 5 with the new peak" in more.stdout
    lrs = {e["step"]: e["lr"] for e in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())
           if e["event"] == "train"}
    assert lrs[5] == pytest.approx(3e-3 * 4 / 5) and lrs[6] == pytest.approx(1e-3) and lrs[7] == pytest.approx(
        1e-3 * 0.75) and lrs[8] == pytest.approx(1e-3 * 0.25)


def test_a_diverging_run_skips_bad_steps_stops_in_one_line_and_keeps_only_finite_checkpoints(train_env, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = tmp_path / "r"
    proc = train(train_env, tmp_path, "--lr", "1e30", "--warmup-steps", "0", "--ckpt-freq", "1")
    assert proc.returncode != 0
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = [e["step"] for e in events if e["event"] == "skipped"]
    first = skipped[0]
    assert skipped == [first, first + 1, first + 2], skipped  # --max-bad-steps 3 by default
    assert [e["in_a_row"] for e in events if e["event"] == "skipped"] == [1, 2, 3]
    assert not [e for e in events if e["event"] == "checkpoint" and e["step"] >= first]
    state = json.loads((run / "state.json").read_text())
    assert state["step"] == first - 1
    line = root_cause(proc.stderr)
    assert line.startswith(f"error: training diverged: steps {first}-{first + 2} had a non-finite loss or gradient "
                           "norm (last: loss ")
    assert line.endswith(f"and were skipped; the last good checkpoint is {run / state['path']}; try a lower --lr "
                         "(now 1e+30), --precision fp32 or a smaller --max-grad-norm (now 1), then rerun to resume "
                         "from it")
    assert 'File "' + str(ROOT / "pipeline") not in proc.stderr  # no worker traceback
    for name in state["checkpoints"]:
        dcp_to_torch_save(run / "checkpoints" / name, tmp_path / f"{name}.pt")
        model = torch.load(tmp_path / f"{name}.pt", weights_only=False)["model"]
        assert model and all(torch.isfinite(t).all() for t in model.values()), name


def test_resume_guard_names_the_changed_field(train_env, tmp_path, tiny_models):
    assert train(train_env, tmp_path, "--max-steps", 2).returncode == 0
    run = tmp_path / "r"
    fp = json.loads((run / "state.json").read_text())["fingerprint"]
    data2 = tmp_path / "data2"
    import datasets

    datasets.Dataset.from_dict({"text": ["other text " * 200] * 50}).save_to_disk(str(data2))
    changes = {
        "seq_length was 128 and is now 64": args(train_env, tmp_path, "--seq-length", "64"),
        "val_fraction was 0.05 and is now 0.1": args(train_env, tmp_path, "--val-fraction", "0.1"),
        "seed was 0 and is now 1": args(train_env, tmp_path, "--seed", "1"),
        "model_name was 'local/tiny' and is now 'local/tiny-untied'":
            [a if a != "local/tiny" else "local/tiny-untied" for a in args(train_env, tmp_path)],
        f"dataset was '{fp['dataset']}' and is now '{{}}'":
            [str(data2) if a == str(train_env["dataset"]) else a for a in args(train_env, tmp_path)],
    }
    # all five checked in one process: preflight refuses before any process group exists
    errors = preflight_errors(list(changes.values()), train_env["env"])
    assert len(errors) == len(changes)
    for change, error in zip(changes, errors, strict=True):
        head = change.split("{}")[0]
        assert error.startswith(f"refusing to resume {run}: {head}"), error
        assert error.endswith("; rerun with the original value, or pass --no-resume to start a new run beside it")
    assert errors[0] == (f"refusing to resume {run}: seq_length was 128 and is now 64; rerun with the original "
                         "value, or pass --no-resume to start a new run beside it")
    refused = run_script("fsdp1.py", *changes["seed was 0 and is now 1"], env=train_env["env"])
    assert refused.returncode == 2 and refused.stderr.splitlines()[-1] == (
        f"error: refusing to resume {run}: seed was 0 and is now 1; rerun with the original value, or pass "
        "--no-resume to start a new run beside it")  # as the user sees it
    fresh = run_script("fsdp1.py", *args(train_env, tmp_path, "--seq-length", "64", "--no-resume", "--max-steps", 2),
                       env=train_env["env"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert (tmp_path / "r-2" / "hf" / "config.json").exists() and (run / "state.json").exists()


def test_no_worker_outlives_a_killed_launcher(train_env, tmp_path):
    proc = start(train_env, tmp_path, "--max-steps", 100000, "--ckpt-freq", 0)
    wait_for(lambda: max(losses(tmp_path / "r"), default=0) >= 1, proc)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers) >= 2
    os.kill(proc.pid, signal.SIGKILL)  # the agent only: nothing forwards a signal to the workers
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=20)
    for p in alive:
        p.kill()
    assert not alive, f"workers still running 20 s after the launcher died: {[p.pid for p in alive]}"


def fake_checkpoint(run, step: int, *, manifest: bool = True, metadata: bool = True) -> None:
    """A checkpoint folder as Checkpointer.choose and verify see one, and state.json naming it (no model inside)."""
    from pipeline.train.checkpoint import MANIFEST, STATE, file_digest, step_name, write_json_atomic

    ckpt = run / "checkpoints" / step_name(step)
    ckpt.mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(256)) * step)
    if metadata:
        (ckpt / ".metadata").write_bytes(b"metadata")
    files = {p.name: {"bytes": p.stat().st_size, "xxh3": file_digest(p)} for p in ckpt.iterdir()}
    if manifest:
        write_json_atomic(ckpt / MANIFEST, {"step": step, "files": files})
    done = sorted(p.name for p in (run / "checkpoints").iterdir())
    write_json_atomic(run / STATE, {"step": step, "path": f"checkpoints/{step_name(step)}", "checkpoints": done,
                                    "fingerprint": {}})


def test_ranks_that_see_different_things_refuse_alike_instead_of_one_waiting_on_the_other(tmp_path):
    """Which checkpoint to resume from, its check, and what --strategy auto chose are agreed: rank 1 alone seeing a
    damaged or another newest checkpoint (its own copy of --save-dir) used to refuse alone while rank 0 waited in the
    next collective until the timeout; ranks that chose different strategies would build mismatched wrappers."""
    for rank in (0, 1):
        for case in ("agreed", "newest", "manifest", "unreadable", "resume_from"):
            run = tmp_path / case / f"rank-{rank}"
            fake_checkpoint(run, 5)
            odd = rank == 1 and case != "agreed"
            if not (odd and case == "newest"):
                fake_checkpoint(run, 10, manifest=not (odd and case == "manifest"),
                                metadata=not (odd and case == "resume_from"))
            if odd and case == "unreadable":
                (run / "checkpoints" / "step-00000010" / "manifest.json").write_text("{not json")
    cases = {"agreed": "", "newest": "", "manifest": "", "unreadable": "", "resume_from": "step-00000010"}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = torchrun(2, ROOT / "tests" / "helpers" / "rank_views.py", tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "outcomes.json").read_text())
    seen = tmp_path / "resume_from" / "rank-1" / "checkpoints" / "step-00000010"
    assert got["agreed"] == ["ok", "ok"]
    assert got["resume_from"] == [f"--resume-from step-00000010: {seen} is not a complete checkpoint"] * 2
    damaged = tmp_path / "manifest" / "rank-1" / "checkpoints" / "step-00000010" / "manifest.json"
    assert got["manifest"] == [f"checkpoint step-00000010 is damaged: {damaged} is missing: it was not completed; "
                               "resume from the previous one with --resume-from step-00000005"] * 2
    unreadable = tmp_path / "unreadable" / "rank-1" / "checkpoints" / "step-00000010" / "manifest.json"
    assert got["unreadable"][0] == got["unreadable"][1]
    assert got["unreadable"][0].startswith(f"checkpoint step-00000010 is damaged: {unreadable} or a file it names "
                                           "cannot be read (JSONDecodeError: ")
    assert got["strategy"] == ["--strategy auto chose differently on different ranks (rank(s) 0: ddp NO_SHARD; "
                               "rank(s) 1: fsdp2 FULL_SHARD), whose memory differs; pass --strategy, or --memory-gb "
                               "with the smallest rank's memory"] * 2
    for rank, text in enumerate(got["newest"]):
        assert text == (f"the ranks do not see the same newest checkpoint in "
                        f"{tmp_path / 'newest' / f'rank-{rank}' / 'checkpoints'} (rank 0: step-00000010, rank 1: "
                        "step-00000005); every rank must see the same --save-dir (a file system shared by every "
                        "node, not a copy)")


def test_a_second_job_on_a_run_folder_in_use_is_refused_before_writing_and_a_killed_jobs_lock_is_taken(
        train_env, tmp_path):
    import re
    import socket

    run = tmp_path / "r"
    first = start(train_env, tmp_path, "--max-steps", 1000)
    wait_for(lambda: (run / "state.json").exists(), first)  # a checkpoint to resume from once it is killed
    log_before = (run / "train.log").read_text()
    second = train(train_env, tmp_path, "--max-steps", 1000)
    assert second.returncode != 0
    pattern = (rf"error: {re.escape(str(run))} is in use by fsdp1\.py \(pid \d+ on {re.escape(socket.gethostname())}, "
               r"since [0-9-]+ [0-9:]+\); wait for it to end \(rerunning the same command then resumes\), or give "
               r"this run another --experiment-name\n")
    assert re.search(pattern, second.stderr), second.stderr[-3000:]
    assert (run / "train.log").read_text().startswith(log_before)  # the second job wrote nothing there
    assert (run / "train.log").read_text().count("run directory") == 1
    kill_tree(first)  # the kernel drops a killed job's lock: the rerun takes it
    last = json.loads((run / "state.json").read_text())["step"]
    again = train(train_env, tmp_path, "--max-steps", last + 1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert events(run, "resume")[-1]["from_step"] == last, again.stdout[-3000:]
    assert json.loads((run / "state.json").read_text())["step"] == last + 1


def test_token_ids_beyond_the_vocabulary_are_refused_on_every_rank_before_training(train_env, tmp_path):
    """A damaged token cache (or one from a tokenizer with more tokens than the model has rows) used to train at
    ln(vocab) with a zero gradient and exit 0: the vocabulary-parallel head embeds an unknown id as zeros."""
    import numpy as np

    assert train(train_env, tmp_path, "--max-steps", 1).returncode == 0
    vocab = json.loads((tmp_path / "r" / "hf" / "config.json").read_text())["vocab_size"]
    cache = next((tmp_path / "token_cache").glob("*/train.npy"))
    ids = np.load(cache, mmap_mode="r+")
    ids[3, 7] = vocab + 5
    ids.flush()
    del ids
    refused = train(train_env, tmp_path, "--max-steps", 2)
    assert refused.returncode != 0
    message = (f"error: the token cache {cache.parent} holds token id {vocab + 5} (in train block 3) but the model has "
               f"{vocab} embedding rows: the cache is damaged or was built with another tokenizer; delete "
               f"{cache.parent} to rebuild it\n")
    assert message in refused.stderr, refused.stderr[-3000:]
    assert json.loads((tmp_path / "r" / "state.json").read_text())["step"] == 1  # nothing trained on it


def test_every_stage_on_a_read_only_disk_is_one_line(train_env, tiny_models, tmp_path, small_disk):
    """Each stage's output (and the token cache) on a read-only mount: one line naming where, exit 2, no traceback."""
    small_disk.read_only()
    ro = small_disk.path
    how = "read-only file system; fix it or choose another output folder, then rerun the same command (what is " \
          "finished is kept)"
    raw = ROOT / "examples" / "raw"
    model = ["-d", train_env["dataset"], "-m", "local/tiny", "--max-steps", 1]
    stages = {
        ("ORGANIZE_DATA.py", "--src_dir", raw, "--dst_root", ro / "splits", "--num_dirs", 2): ro / ".splits.lock",
        ("DATA-HF.py", "--data_folder", raw, "--save_dir", ro / "ds"): ro / ".ds.lock",
        ("MODEL_DOWNLOAD.py", "--model-name", "local/x", "--source", tiny_models["tied"], "--cache-dir", ro / "hub"):
            ro / "hub",
        ("fsdp1.py", "-e", "r", "--save-dir", ro / "runs", *model): ro / "runs",
        ("fsdp1.py", "-e", "r", "--save-dir", tmp_path / "runs", "--cache-dir", ro / "cache", *model): ro / "cache",
    }
    for (script, *argv), where in stages.items():
        proc = run_script(script, *argv, env=train_env["env"])
        assert (proc.returncode, proc.stderr.splitlines()[-1]) == (2, f"error: cannot write {where}: {how}"), script
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
