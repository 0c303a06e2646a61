"""`make gpu-check DRY=1`: the GPU window's one command rehearsed on the CPU, so that it cannot rot between lent GPUs:
every part passes, each result is in the results file, the killed runs resume to the uninterrupted runs' losses and
the GPU tables are written (to the work folder: BENCHMARKS.md is left alone)."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_the_dry_run_passes_every_part_and_writes_its_tables(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_text()
    proc = subprocess.run(["make", "-s", "gpu-check", "DRY=1", f"GPU_CHECK_ARGS=--workdir {tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("gpu-check: 7 of 7 parts passed")
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    summary = {r["item"]: r["status"] for r in results if r["part"] == "summary"}
    assert summary == dict.fromkeys(["setup", "correctness", "full_speed", "adapters", "grpo", "long_context", "moe"],
                                    "passed")
    items = {(r["part"], r["item"]): r for r in results if r["part"] != "summary"}
    assert not items[("setup", "imports")]["missing"]
    for case in ("resume fsdp2", "resume qlora"):
        resumed = items[("correctness", case)]
        assert resumed["killed_after_checkpoint"] and resumed["largest_relative_loss_difference"] == 0.0, resumed
    for part, variant in (("full_speed", "ours-default"), ("full_speed", "hf"), ("adapters", "ours-qlora"),
                          ("adapters", "hf-peft-lora")):
        assert min(items[(part, variant)]["tokens_per_s"]) > 0
    fp16 = items[("correctness", "fp16")]
    assert fp16["loss_scale"] == [65536.0] * 8 and fp16["losses"][-1] < fp16["losses"][0]
    assert " 3 skipped in " in items[("correctness", "CUDA tests: tests/test_gpu.py")]["summary"]
    # the compared pair's profiles (the CPU's operators in a rehearsal) and the tables side by side
    for variant in ("ours-default", "hf"):
        profile = items[("full_speed", variant)]["profile"]
        assert profile["steps"] == 3 and {"matmuls", "attention", "optimizer"} <= set(profile["split"])
        assert (tmp_path / "profiles" / f"{variant}.trace.json.gz").stat().st_size > 0
    assert items[("adapters", "ours-qlora")]["profile"]["memory"]["parts_gib"]["nf4_base"] > 0
    profiles = (tmp_path / "gpu_profile.md").read_text()
    assert "| kind of work | ours: ms per step (share) | HF Trainer: ms per step (share) | ours - HF, ms |" in profiles
    assert "| whole step (wall) |" in profiles and "Where ours spends time the Trainer does not:" in profiles
    speed = (tmp_path / "train_speed_gpu.md").read_text()
    assert "| fsdp1.py, its defaults | 2 |" in speed and "| HF Trainer (FSDP2, bf16, fused AdamW) | 2 |" in speed
    adapters = (tmp_path / "adapters_gpu.md").read_text()
    assert "| fsdp1.py, QLoRA r16 (NF4 base), activation checkpointing | 2 |" in adapters
    rollouts = items[("grpo", "ours-grpo-lora")]
    assert rollouts["generated_tokens_per_s"] > 0 and 0 < rollouts["generate_s"] < rollouts["step_s"]
    assert 0 < rollouts["mean_completion_tokens"] <= 16
    assert "| fsdp1.py --objective grpo --adapter lora |" in (tmp_path / "grpo_gpu.md").read_text()
    long = items[("long_context", "ours-long-context-lora")]
    assert long["seq"] == 512 and min(long["tokens_per_s"]) > 0 and "--offload-activations" in long["flags"]
    assert "| 512 |" in (tmp_path / "long_context_gpu.md").read_text()
    # expert parallelism off and on over 2 ranks: the same losses, both rows in the table
    off, on = items[("moe", "ours-moe")], items[("moe", "ours-moe-ep")]
    assert off["ranks"] == on["ranks"] == 2 and min(on["tokens_per_s"]) > 0
    assert dict(off["losses"])[4] == dict(on["losses"])[4]
    moe = (tmp_path / "moe_gpu.md").read_text()
    assert "| ours-moe | 2 |" in moe and "| ours-moe-ep | 2 |" in moe
    assert (ROOT / "BENCHMARKS.md").read_text() == before


def test_tables_from_a_file_of_several_calls_and_a_bad_budget_is_one_line(tmp_path):
    """The committed H200 results (three calls) make the tables again, each variant's latest result a row."""
    script = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry", "--workdir", str(tmp_path)]
    proc = subprocess.run([*script, "--tables-only", "--results", str(ROOT / "bench/data/gpu_h200_2026-11-26.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    speed = (tmp_path / "train_speed_gpu.md").read_text()
    assert "| fsdp1.py, its defaults, compile per layer | 8 | 56,990 (56,508-57,235) |" in speed
    assert "(2 invocations)" in speed and "NVIDIA H200" in speed
    adapters = (tmp_path / "adapters_gpu.md").read_text()
    assert "| HF Trainer + peft LoRA r16 on every linear layer, gradient checkpointing | 2 | 6,650" in adapters
    assert "no MFU: adapters" in adapters
    bad = subprocess.run([*script, "--budget", "adapter=60"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].endswith(
        "argument --budget: adapter=60: want PART=SECONDS with PART one of setup, correctness, full_speed, adapters, "
        "grpo, long_context, moe")
    both = subprocess.run([*script, "--half", "1", "--parts", "setup"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert (both.returncode, both.stderr.strip()) == (1, "--half and --parts choose the parts both: give one")
    # a half whose time is spent starts no part, and says so in its results
    spent = subprocess.run([*script, "--half", "2", "--half-s", "3"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
    assert spent.returncode == 1 and spent.stdout.strip().endswith(
        "0 of 4 parts passed; not: setup (not run), correctness (not run), full_speed (not run), grpo (not run)")
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["item"], r["status"], r["last_line"]) for r in rows] == [
        ("setup", "not run", "no time left in this half"), ("correctness", "not run", "setup did not pass"),
        ("full_speed", "not run", "setup did not pass"), ("grpo", "not run", "setup did not pass")]


PART = """import subprocess, sys
run = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], start_new_session=True)
print(run.pid, flush=True)
sys.stdin.read()
"""


def test_a_part_killed_at_its_budget_takes_the_runs_it_started_in_sessions_of_their_own_with_it():
    """A part's runs have sessions of their own (each killed as a group), so killing the part's group alone left one
    training on the GPU beside the next half; kill_tree ends the part and everything below it."""
    import os

    import psutil

    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import kill_tree

    part = subprocess.Popen([sys.executable, "-c", PART], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    run = psutil.Process(int(part.stdout.readline()))
    assert os.getsid(run.pid) == run.pid != os.getsid(part.pid)  # out of reach of the part's group
    kill_tree(part.pid)
    assert part.wait(timeout=30) == -9
    gone, alive = psutil.wait_procs([run], timeout=30)
    assert alive == [] or alive[0].status() == psutil.STATUS_ZOMBIE
