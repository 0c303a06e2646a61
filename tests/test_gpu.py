"""GPU paths, run only where CUDA is (a lent GPU machine; CI has none): one process on the GPU with NCCL, bf16 by
default, asynchronous checkpoints (the GPU default), MFU and CUDA memory in the metrics, export; exact resume after
SIGKILL; the chunked fused loss against the model's own loss on the GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, events, kill_tree, losses, run_script, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def args(env: dict, root: Path, *extra: object) -> list[str]:
    return ["-e", "r", "-d", str(env["dataset"]), "-m", "local/tiny", "--save-dir", str(root), "--config",
            str(ROOT / "configs" / "demo.yaml"), "--log-freq", "1", "--ckpt-freq", "5", "--eval-freq", "0",
            "--max-steps", "20", *map(str, extra)]


def test_gpu_run_uses_bf16_async_checkpoints_and_exports(train_env, tmp_path):
    proc = run_script("fsdp1.py", *args(train_env, tmp_path, "--precision", "auto"), env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "r"
    assert "torch.bfloat16 compute" in (run / "train.log").read_text()
    train = events(run, "train")
    assert [e["step"] for e in train] == list(range(1, 21))
    assert train[0]["loss"] - train[-1]["loss"] > 1.0, [e["loss"] for e in train]
    assert all(e["mfu"] is not None and 0 <= e["mfu"] < 1 and e["mem_gb"]["peak_alloc"] > 0 for e in train)
    ckpts = events(run, "checkpoint")
    assert [c["step"] for c in ckpts] == [5, 10, 15, 20]
    assert all(c["stall_seconds"] < c["seconds"] for c in ckpts[:-1])  # async: the loop waited less than the save
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_gpu_resume_after_sigkill_matches_an_uninterrupted_run(train_env, tmp_path):
    fp32 = ("--precision", "fp32")
    ref = run_script("fsdp1.py", *args(train_env, tmp_path / "ref", *fp32), env=train_env["env"])
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = losses(tmp_path / "ref" / "r")
    run = tmp_path / "cut" / "r"
    proc = subprocess.Popen([sys.executable, str(ROOT / "fsdp1.py"), *args(train_env, tmp_path / "cut", *fp32)],
                            cwd=ROOT, env=train_env["env"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for(lambda: max(losses(run), default=0) >= 12, proc, timeout=300)
    kill_tree(proc)
    done = run_script("fsdp1.py", *args(train_env, tmp_path / "cut", *fp32), env=train_env["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = losses(run)
    assert sorted(resumed) == sorted(reference)
    assert all(abs(resumed[s] - reference[s]) <= 1e-5 * abs(reference[s]) for s in reference), (resumed, reference)


def test_chunked_loss_matches_the_model_loss_on_gpu(train_env, tmp_path):
    runs = {}
    for mode in ("on", "off"):
        proc = run_script("fsdp1.py", *args(train_env, tmp_path / mode, "--precision", "fp32", "--max-steps", "5",
                                            "--ckpt-freq", "0", "--vocab-parallel", mode), env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = events(tmp_path / mode / "r", "train")
    for on, off in zip(runs["on"], runs["off"], strict=True):
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5)
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-4)
