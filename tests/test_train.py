import gzip
import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, preflight_errors, root_cause, run_script, torchrun

DEMO = ["--config", str(ROOT / "configs" / "demo.yaml"), "--max-steps", "40", "--ckpt-freq", "20", "--eval-freq", "20"]
TRAIN_KEYS = {"event", "step", "time", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "trained_tokens_per_s",
              "mfu", "time_ms", "mem_gb"}


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_run_trains_and_writes_its_run_directory(tmp_path, train_env):
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "demo", "-d", train_env["dataset"], "-m", "local/tiny",
                    "--save-dir", tmp_path, *DEMO, "--profile-from", 11, "--profile-steps", 2, env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "demo"
    evs = events(run)
    train = [e for e in evs if e["event"] == "train"]
    evals = [e for e in evs if e["event"] == "eval"]
    assert [e["step"] for e in train] == list(range(5, 41, 5))
    assert train[0]["loss"] - train[-1]["loss"] > 1.5, [e["loss"] for e in train]
    assert [e["step"] for e in evals] == [0, 20, 40] and evals[2]["loss"] < evals[1]["loss"] < evals[0]["loss"]
    for e in train:
        assert set(e) == TRAIN_KEYS
        assert set(e["time_ms"]) == {"data", "forward", "backward", "update", "comm", "total"}
        assert 0 < e["time_ms"]["comm"] < e["time_ms"]["forward"] + e["time_ms"]["backward"]  # fsdp2's, timed
        assert set(e["mem_gb"]) == {"alloc", "peak_alloc", "reserved", "peak_reserved", "peak_by_rank"}
        assert len(e["mem_gb"]["peak_by_rank"]) == 2 and all(p > 0 for p in e["mem_gb"]["peak_by_rank"])
        assert e["mfu"] is None and e["tokens_per_s"] > 0 and e["grad_norm"] > 0
        assert e["time_ms"]["total"] >= e["time_ms"]["forward"] + e["time_ms"]["backward"]
    assert all(set(e) == {"event", "step", "time", "loss", "ppl", "seconds"} and e["seconds"] > 0 for e in evals)
    ckpts = [e for e in evs if e["event"] == "checkpoint"]
    assert [e["step"] for e in ckpts] == [20, 40]
    assert all(set(e) == {"event", "step", "time", "path", "seconds", "stall_seconds", "bytes"} for e in ckpts)
    assert ckpts[-1]["path"] == str(run / "checkpoints" / "step-00000040")
    written = [f for f in (run / "checkpoints" / "step-00000040").iterdir() if f.name != "manifest.json"]
    assert ckpts[-1]["bytes"] == sum(f.stat().st_size for f in written)
    # the lr each step applied: the last step's is the cosine's (HF's schedule) one step before zero
    assert train[-1]["lr"] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 34 / 35)))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["lr"], saved["seq_length"], saved["max_steps"], saved["experiment_name"]) == (3e-3, 128, 40, "demo")
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = (run / "train.log").read_text()
    assert "[rank=0] INFO" in log and "[rank=1] INFO" in log
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert "[rank=0] {'global_step': 40," in proc.stdout
    # --profile-from 11 --profile-steps 2: rank 0's steps 11-12 under torch.profiler, summarised and traced
    [profiled] = [e for e in evs if e["event"] == "profile"]
    summary = json.loads((run / "profile" / "profile.json").read_text())
    assert profiled["step"] == 12 and (summary["steps"], summary["first_step"], summary["device"]) == (2, 11, "cpu")
    assert {"matmuls", "attention", "optimizer", "communication", "norms and elementwise"} <= set(summary["split"])
    assert profiled["split"] == {kind: part["share"] for kind, part in summary["split"].items()}
    # the shares are of the wall time: on the CPU they add up to the operators' self time over it
    assert sum(profiled["split"].values()) == pytest.approx(summary["kernel_ms_per_step"] / summary["step_ms"],
                                                            abs=0.01)
    assert len(summary["top"]) == 20 and summary["top"][0]["ms_per_step"] >= summary["top"][-1]["ms_per_step"] > 0
    parts = summary["memory"]["parts_gib"]
    assert parts["nf4_base"] == 0 and parts["trained_and_states"] > 0  # the weights and AdamW's two states
    with gzip.open(run / "profile" / "trace.json.gz") as f:
        traced = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= traced  # the profiled steps' operators, forward to update
    assert "profile of steps 11-12:" in log


def test_prepare_only_builds_the_cache_that_single_process_runs_then_reuse(tmp_path, train_env):
    args = ["-d", train_env["dataset"], "-m", "local/tiny-untied", "--save-dir", tmp_path, *DEMO, "--max-steps", "3",
            "--log-freq", "1"]
    prepared = run_script("fsdp1.py", "-e", "a", *args, "--prepare-only", env=train_env["env"])
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert "building token cache" in prepared.stdout and "token cache built: " in prepared.stdout
    assert ": 649 training and 34 validation blocks of 128 tokens; the same command without" in prepared.stdout
    assert not (tmp_path / "a").exists()  # no run started
    again = run_script("fsdp1.py", "-e", "a", *args, "--prepare-only", env=train_env["env"])
    assert "token cache hit: " in again.stdout and "building" not in again.stdout
    first = run_script("fsdp1.py", "-e", "a", *args, env=train_env["env"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "token cache hit" in first.stdout and "building token cache" not in first.stdout
    second = run_script("fsdp1.py", "-e", "b", *args, env=train_env["env"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "token cache hit" in second.stdout and "building token cache" not in second.stdout
    assert len([p for p in (tmp_path / "token_cache").iterdir() if p.is_dir()]) == 1
    train_losses = [[e["loss"] for e in events(tmp_path / run) if e["event"] == "train"] for run in ("a", "b")]
    assert train_losses[0] == train_losses[1] and len(train_losses[0]) == 3


PREFLIGHT_REFUSALS = [
    (["-d", "{t}/missing", "-m", "local/tiny"], "--dataset-name {t}/missing does not exist"),
    (["-d", "{data}", "-m", "local/absent"], "model local/absent is not in the offline cache at {hub} (HF_HOME or "
     "HF_HUB_CACHE choose it; set them as when the model was put there); on this machine run: python "
     "MODEL_DOWNLOAD.py --model-name local/absent (add --source DIR if offline)"),
    (["-d", "{data}", "-m", "local/tiny", "--seq-length", "4096"], "--seq-length 4096 is above the model's "
     "limit (max_position_embeddings 2048)"),
    (["-d", "{t}/empty", "-m", "local/tiny"], "--dataset-name {t}/empty is empty"),
    (["-d", "{data}", "-m", "local/tiny", "--profile", "tiny"], "unknown profile 'tiny'; known profiles: "
     "cpu_debug, large_scale, multi_node, single_node"),
]


def test_bad_arguments_are_one_line(tmp_path, train_env):
    """Every refusal before the process group, checked in one process (tests/helpers/preflight_errors.py runs
    fsdp1.py's checks); then one refusal after it (too little data for a global batch) as the user sees it."""
    import datasets

    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "empty"))
    fmt = {"t": tmp_path, "data": train_env["dataset"], "hub": train_env["root"] / "hf" / "hub"}
    argvs = [["-e", "bad", "--save-dir", str(tmp_path / "out"), *(a.format(**fmt) for a in args)]
             for args, _ in PREFLIGHT_REFUSALS]
    assert preflight_errors(argvs, train_env["env"]) == [message.format(**fmt) for _, message in PREFLIGHT_REFUSALS]
    proc = run_script("fsdp1.py", "-e", "bad", "--save-dir", tmp_path / "out", "-d", train_env["dataset"], "-m",
                      "local/tiny", "--seq-length", "2048", "-b", "64", env=train_env["env"])
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "error: the dataset gives 41 training blocks of 2048 tokens, fewer than one global batch (1 processes x "
        "batch 64 x grad accum 1 = 64); use more data or a smaller --seq-length, --batch-size or --grad-accum")
    assert "Traceback" not in proc.stderr


def test_bad_argument_under_torchrun_is_one_line(tmp_path, train_env):
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "bad", "-d", train_env["dataset"], "-m", "local/tiny",
                    "--seq-length", "4096", "--save-dir", tmp_path, env=train_env["env"])
    assert proc.returncode != 0
    line = "error: --seq-length 4096 is above the model's limit (max_position_embeddings 2048)"
    assert root_cause(proc.stderr) == line  # the last line of torchrun's report, what a user reads
    assert not [x for x in proc.stderr.splitlines() if x.startswith("error: ")]  # not once per rank above it
    assert 'File "' + str(ROOT / "pipeline") not in proc.stderr  # no worker traceback
    assert not (tmp_path / "bad").exists()


def test_the_compiled_chunk_math_gives_the_eager_loss_and_gradients(monkeypatch):
    """--compile on runs the chunked loss's per-chunk softmax math through torch.compile (the GPU profile's largest
    gap to the compiled Trainer): the same loss, cross-entropy's own, and gradients within a bf16 rounding, over three
    chunks (the last shorter) and a second step's target count (a tensor: no recompilation per step)."""
    import torch

    from pipeline.model import vocab_parallel as vp

    torch.manual_seed(0)
    rows, vocab = 300, 5000
    h, w = torch.randn(rows, 64).to(torch.bfloat16), torch.randn(vocab, 64) * 0.2
    labels = torch.randint(0, vocab, (rows,))
    labels[::7] = vp.IGNORE
    monkeypatch.setitem(vp.CHUNK_ELEMENTS, "cpu", 128 * vocab)
    for count in (250.0, 260.0):
        eager = vp.head_pass(h, w, labels, 0, None, True, count)
        fused = vp.head_pass(h, w, labels, 0, None, True, count, compiled=True)
        reference = torch.nn.functional.cross_entropy(h.float() @ w.bfloat16().float().t(), labels,
                                                      ignore_index=vp.IGNORE, reduction="sum") / count
        assert fused[0].item() == pytest.approx(eager[0].item(), abs=1e-6)
        assert fused[0].item() == pytest.approx(reference.item(), rel=1e-4)
        torch.testing.assert_close(fused[1].float(), eager[1].float(), rtol=0, atol=2**-8 * eager[1].abs().max())
        # the weight gradient sums each row's bf16-rounded logit gradient times h: the two paths' softmax math may
        # round a row's gradient to the neighbouring bf16 value (a step of at most 2^-7 of it), so an element may differ
        # by one such step of every row's term, plus fp32 sums in another order: a bound per element, which a fraction
        # of the largest element is not (an AVX2 machine's compiled sums missed 1e-4 of the largest by 14%)
        z = h.float() @ w.bfloat16().float().t()
        g = (z.softmax(-1) - torch.nn.functional.one_hot(labels.clamp(min=0), vocab)) * (labels != vp.IGNORE)[:, None]
        bound = (2**-7 + rows * 2**-24) * ((g / count).abs().t() @ h.float().abs())
        assert ((fused[2] - eager[2]).abs() <= bound).all()
        assert eager[1].abs().max() > 0 and eager[2].abs().max() > 0


def test_vocab_parallel_head_trains_like_the_hf_head(tmp_path, train_env):
    # two micro-steps per step (gradients scaled and accumulated) and evaluation with the last batch padded
    runs = {}
    for mode in ("on", "off"):
        proc = torchrun(2, ROOT / "fsdp1.py", "-e", mode, "-d", train_env["dataset"], "-m", "local/tiny",
                        "--save-dir", tmp_path, *DEMO, "--max-steps", "6", "--log-freq", "1", "--eval-freq", "3",
                        "--grad-accum", "2", "--batch-size", "3", "--vocab-parallel", mode, env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = [(e["event"], e["step"], e["loss"], e.get("grad_norm", 0.0)) for e in events(tmp_path / mode)
                      if e["event"] in ("train", "eval")]
    assert [r[:2] for r in runs["on"]] == [r[:2] for r in runs["off"]]
    assert [r[:2] for r in runs["on"] if r[0] == "eval"] == [("eval", 0), ("eval", 3), ("eval", 6)]
    for on, off in zip(runs["on"], runs["off"], strict=True):
        assert on[2] == pytest.approx(off[2], abs=1e-4) and on[3] == pytest.approx(off[3], abs=1e-4), (on, off)
    train = [r[2] for r in runs["on"] if r[0] == "train"]
    assert train[0] - train[-1] > 0.1  # it learns: the last train loss is below the first
    val_blocks = json.loads(next((tmp_path / "token_cache").glob("*/meta.json")).read_text())["val_blocks"]
    assert val_blocks % (2 * 3) != 0  # so some rank's last evaluation batch is padded


def test_out_of_memory_hints_name_only_what_applies():
    import torch

    from pipeline.config_merge import from_flat
    from pipeline.distributed.runtime import Dist
    from pipeline.strategies.registry import settle
    from pipeline.train.cli import out_of_memory_message

    d = Dist(rank=1, world_size=2, local_rank=1, local_world_size=2, device=torch.device("cuda", 1))
    base = {"experiment_name": "x", "dataset_name": "d", "model_name": "m", "batch_size": 8, "seq_length": 2048,
            "strategy": "fsdp2", "vocab_parallel": "off"}
    assert out_of_memory_message(settle(from_flat(base)), d) == (
        "rank 1 ran out of CUDA memory at batch 8 x seq 2048; try a smaller --batch-size (with --grad-accum to keep "
        "the global batch), --activation-checkpointing on, --vocab-parallel auto (no full-width logits); the last "
        "complete checkpoint (if any) resumes with the same command")
    hybrid = out_of_memory_message(settle(from_flat({**base, "sharding": "HYBRID_SHARD",
                                                     "activation_checkpointing": True})), d)
    assert "try a smaller --batch-size (with --grad-accum to keep the global batch); the last" in hybrid


def test_checkpoints_follow_wall_time_on_every_rank_at_the_same_step(tmp_path, train_env):
    """--ckpt-minutes: a save is due once that much time passed since the last; every rank must save at the same step
    (each save is collective), though each rank's clock says a different time. 1e-6 minutes is due after every step."""
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "t", "-d", train_env["dataset"], "-m", "local/tiny", "--save-dir",
                    tmp_path, "--config", ROOT / "configs" / "demo.yaml", "--max-steps", "3", "--ckpt-freq", "0",
                    "--eval-freq", "0", "--ckpt-minutes", "1e-6", env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["step"] for e in events(tmp_path / "t") if e["event"] == "checkpoint"] == [1, 2, 3]


def test_a_run_folder_too_long_for_the_files_under_it_is_refused_before_training(tmp_path):
    """Training and checkpoints would pass and the export fail with ENAMETOOLONG hours later: the run folder's path
    leaves room for every file a run writes, or it is one line at the start."""
    import os

    from pipeline.errors import UserError
    from pipeline.train.preflight import RUN_FILE_BYTES, check_path_room

    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    fits = tmp_path / ("d" * 100) / "run"
    check_path_room(fits)
    # just under the limit (the files under it would pass it), and past it (stat itself fails: ENAMETOOLONG)
    for deep in (Path(tmp_path, *["d" * 200] * ((limit - len(str(tmp_path))) // 201), "run"),
                 Path(tmp_path, *["d" * 200] * (limit // 200 + 1), "run")):
        size = len(os.fsencode(deep))
        assert size + RUN_FILE_BYTES >= limit
        with pytest.raises(UserError) as err:
            check_path_room(deep)
        assert str(err.value) == (f"the run folder's path is {size} bytes long ({str(deep)[:60]}...): the files a "
                                  f"run writes under it would pass this system's limit of {limit} bytes a path; use "
                                  "a shorter --save-dir")
    assert not (tmp_path / ("d" * 200)).exists()  # nothing written
