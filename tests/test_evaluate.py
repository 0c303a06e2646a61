"""Evaluation: pipeline.evaluate's loss is transformers' own over the blocks training packs, a run validates its base
at step 0 and ends with the base -> final line, and pipeline.evaluate reproduces both ends of the run."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, events, run_evaluate, torchrun
from transformers import AutoModelForCausalLM

from pipeline.data.batches import make_batch
from pipeline.errors import UserError
from pipeline.eval.adapter_folder import read_adapter_folder
from pipeline.tools.evaluate import resolve

DEMO = ["--config", str(ROOT / "configs" / "demo.yaml"), "-b", "2"]


def evaluate(env: dict, *args: object) -> dict:
    """pipeline.evaluate in one plain process; its --out JSON."""
    out = Path(str(args[args.index("--save-dir") + 1])) / "eval.json"
    proc = run_evaluate(env, *args, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert f"loss     {report['loss']:.5f}" in proc.stdout
    out.unlink()
    return report


def transformers_loss(model_dir: Path, cache: Path, split: str) -> tuple[float, int]:
    """from_pretrained's own loss (fp32) over the cache's blocks, one block at a time: its mean over every target."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = ["val"] + (["train"] if split == "all" else [])
    total, tokens = 0.0, 0
    for name in names:
        blocks = np.load(cache / f"{name}.npy")
        flags = np.load(cache / f"{name}_flags.npy") if (cache / f"{name}_flags.npy").exists() else None
        for i in range(len(blocks)):
            batch = make_batch(blocks[i:i + 1], None if flags is None else flags[i:i + 1], torch.device("cpu"))
            n = int((batch.labels[:, 1:] != -100).sum())
            with torch.no_grad():
                out = model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids,
                            use_cache=False)
            total, tokens = total + out.loss.item() * n, tokens + n
    return total / tokens, tokens


@pytest.mark.parametrize("data, split", [("dataset", "val"), ("chats", "all")])
def test_the_loss_is_transformers_own_over_the_blocks_training_packs(train_env, tiny_models, tmp_path, data, split):
    report = evaluate(train_env["env"], "local/tiny", "-d", train_env[data], "--save-dir", tmp_path, *DEMO,
                      "--split", split)
    loss, tokens = transformers_loss(tiny_models["tied"], Path(report["token_cache"]), split)  # local/tiny
    assert report["tokens"] == tokens and report["split"] == split and report["seq_length"] == 128
    assert report["loss"] == pytest.approx(loss, abs=1e-5)
    assert report["ppl"] == pytest.approx(np.exp(report["loss"]), rel=1e-9)
    assert set(report["fingerprint"]) == {"dataset", "tokenizer", "model_config", "weights"}


def test_a_run_validates_its_base_at_step_0_and_evaluate_reproduces_both_ends(train_env, tmp_path):
    run = tmp_path / "r"
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "r", "-d", train_env["dataset"], "-m", "local/tiny", "--save-dir",
                    tmp_path, *DEMO, "--max-steps", "8", "--strategy", "fsdp2", env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = events(run, "eval")
    assert [e["step"] for e in evals] == [0, 8] and evals[1]["loss"] < evals[0]["loss"]
    base, final = evals[0], evals[1]
    assert (f"validation loss {base['loss']:.4f} -> {final['loss']:.4f} (ppl {base['ppl']:.2f} -> "
            f"{final['ppl']:.2f})") in (run / "train.log").read_text()
    # one process against the run's two ranks: the same blocks (the run's token cache) and the same sums
    before = evaluate(train_env["env"], "local/tiny", "--config", run / "config.yaml", "--save-dir", tmp_path)
    after = evaluate(train_env["env"], run / "hf", "--config", run / "config.yaml", "--save-dir", tmp_path)
    assert before["loss"] == pytest.approx(base["loss"], abs=1e-5)
    assert after["loss"] == pytest.approx(final["loss"], abs=1e-5)
    assert before["token_cache"] == after["token_cache"] and before["fingerprint"]["dataset"] == \
        after["fingerprint"]["dataset"] and before["fingerprint"]["weights"] != after["fingerprint"]["weights"]
    # the step-0 figures survive a resume (kept in the checkpoint): the rerun to step 12 ends with the same base
    again = torchrun(2, ROOT / "fsdp1.py", "-e", "r", "-d", train_env["dataset"], "-m", "local/tiny", "--save-dir",
                     tmp_path, *DEMO, "--max-steps", "12", "--strategy", "fsdp2", env=train_env["env"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert [e["step"] for e in events(run, "eval")] == [0, 8, 12]
    assert f"validation loss {base['loss']:.4f} -> " in (run / "train.log").read_text().split("resumed from")[-1]


def test_an_adapter_folder_it_cannot_build_or_an_empty_split_is_one_line(train_env, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                           "target_modules": ["q_proj"], "use_rslora": True}))
    with pytest.raises(UserError, match=r"adapter_config.json sets use_rslora, which this pipeline does not build"):
        read_adapter_folder(folder)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(UserError, match=r"holds a IA3 adapter; only LoRA and DoRA adapters are supported"):
        read_adapter_folder(folder)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 8}))
    with pytest.raises(UserError, match=r"adapter_config.json is not a PEFT adapter config \(KeyError: 'r'\)$"):
        read_adapter_folder(folder)
    # MODEL anywhere among the run's flags (every one is known); --out refused before any work
    cfg, adapter, args = resolve(["-d", train_env["dataset"], "local/tiny", "--seq-length", "64", "--split", "all"])
    assert (cfg.model.model_name, cfg.data.dataset_name, cfg.data.seq_length, args.split, adapter) == \
        ("local/tiny", str(train_env["dataset"]), 64, "all", None)
    with pytest.raises(UserError, match=r"^--out .* is a folder; give a file name such as .*eval.json$"):
        resolve(["local/tiny", "-d", train_env["dataset"], "--out", tmp_path])
    proc = run_evaluate(train_env["env"], "local/tiny", "-d", train_env["dataset"], "--save-dir", tmp_path, *DEMO,
                        "--val-fraction", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {train_env['dataset']} has no validation blocks at --val-fraction 0 and --seq-length 128; pass "
        "--split all, or the run's --val-fraction")


def reference_completion(model_dir: Path, prompt_ids: list[int], max_new: int, stops: set[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=sorted(stops), pad_token_id=sorted(stops)[0])[0, len(prompt_ids):].tolist()
    return [t for t in out if t not in stops]


@pytest.mark.parametrize("strategy", [["fsdp2", "--vocab-parallel", "on"], ["ddp"],
                                      ["fsdp2", "--vocab-parallel", "on", "--precision", "bf16"]],
                         ids=["fsdp2", "ddp", "fsdp2-bf16"])
def test_samples_at_every_evaluation_are_generate_s_greedy_completions(train_env, tiny_models, tmp_path, strategy):
    from transformers import AutoTokenizer

    from pipeline.eval.samples import read_prompts, stop_ids

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The river"}\n\n{"messages": [{"role": "user", "content": "Name a colour."}]}\n')
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "r", "-d", train_env["dataset"], "-m", "local/tiny", "--save-dir",
                    tmp_path, *DEMO, "--max-steps", "4", "--eval-freq", "2", "--strategy", *strategy,
                    "--sample-prompts", prompts, "--sample-max-tokens", "12", env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = events(tmp_path / "r", "sample")
    assert [(e["step"], e["index"]) for e in samples] == [(s, i) for s in (0, 2, 4) for i in (0, 1)]
    assert [e["prompt"] for e in samples[:2]] == ["The river", "Name a colour."]
    assert all(e["sample_seconds"] > 0 and e["seconds"] > 0 for e in events(tmp_path / "r", "eval"))
    log = (tmp_path / "r" / "train.log").read_text()
    assert f"sample 1 at step 4: 'Name a colour.' -> {samples[-1]['completion']!r}" in log
    if "bf16" in strategy:  # the fp32 head under a bf16 forward decodes (the reference below is fp32)
        return
    # step 0 is the base model: every rank decoded together (the vocabulary-parallel head under fsdp2 holds half
    # the logits on each rank), and the result is transformers' own greedy generate
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    stops = stop_ids(tokenizer, tiny_models["tied"])
    for event, prompt in zip(samples[:2], read_prompts(prompts, tokenizer, "26 Jul 2024", 128, 12), strict=True):
        expected = reference_completion(tiny_models["tied"], prompt.ids, 12, stops)
        assert event["completion"] == tokenizer.decode(expected, skip_special_tokens=True)
