"""--sequence-parallel N (Ulysses): each sequence split by position over N ranks, attention over the whole sequence
for H/N heads each; every family the project builds computes the unsplit model's loss and gradients or is refused
in one line, real runs at N=2 take the one-process run's steps, and a checkpoint resumes at another degree."""

import json
import re
import shutil

import pytest
from conftest import ROOT, events, preflight_errors, run_evaluate, torchrun

REFUSED = {
    "llama4": "--sequence-parallel 2 cannot split Llama4ForCausalLM: its layers without rotary embedding scale "
              "queries by the position within the rank's slice; use --sequence-parallel 1",
    "qwen3_5": "--sequence-parallel 2 cannot split Qwen3_5ForCausalLM: its linear_attention layers run over the "
               "whole sequence on one rank (not split by heads); use --sequence-parallel 1",
    "qwen3_5_moe": "--sequence-parallel 2 cannot split Qwen3_5MoeForCausalLM: its linear_attention layers run over "
                   "the whole sequence on one rank (not split by heads); use --sequence-parallel 1",
}


def test_every_family_splits_to_the_unsplit_loss_and_gradients_or_is_refused(tmp_path):
    """Two real ranks; a packed row with a document boundary inside each slice and one at the seam, windows (8)
    shorter than the sequence: the batch would score otherwise if attention crossed a boundary (checked)."""
    from pipeline.prep.tiny import FAMILIES

    out = tmp_path / "families.json"
    proc = torchrun(2, ROOT / "tests" / "helpers" / "sequence_parallel_families.py", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {*FAMILIES, "llama-1kv", "llama-eager", "llama4-chunked"}
    for family, r in results.items():
        if family in REFUSED:
            assert r == {"refused": REFUSED[family]}, family
            continue
        assert r["grads"], family
        assert r["split"] == pytest.approx(r["loss"], rel=1e-6), family
        assert r["grad_rel"] < 1e-5, family
        # far beyond the tolerance above: attention across a boundary would fail it
        assert abs(r["crossing"] - r["loss"]) > 1e-4, f"{family}: the batch does not test the document boundaries"
    assert results["gemma2"]["kernel"] == results["llama-eager"]["kernel"] == "eager"


def train(tmp_path, env, name: str, nproc: int, *extra) -> dict[int, tuple[float, float]]:
    """The run's (loss, gradient norm) by step."""
    proc = torchrun(nproc, ROOT / "fsdp1.py", "-e", name, "-d", env["dataset"], "-m", "local/tiny",
                    "--save-dir", tmp_path, "--config", ROOT / "configs" / "demo.yaml", "--seq-length", 128,
                    "--document-mask", "true", "--batch-size", 2, "--log-freq", 1, "--eval-freq", 2, "--ckpt-freq", 2,
                    "--precision", "fp32", *map(str, extra), env=env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {e["step"]: (e["loss"], e["grad_norm"]) for e in events(tmp_path / name, "train")}


@pytest.mark.parametrize("strategy,extra", [("fsdp2", ()), ("ddp", ("--adapter", "lora")),
                                            ("fsdp2", ("--adapter", "dora", "--tiled-mlp", "on")),
                                            ("ddp", ("--adapter", "qlora"))])
def test_two_ranks_at_degree_2_take_the_one_process_steps_and_resume_at_degree_1(tmp_path, train_env, strategy,
                                                                                 extra):
    """Packed documents (--document-mask), fp32, 4 steps: two ranks sharing each sequence against one process on the
    same global batch (losses, gradient norms, validation, greedy samples), full fine-tuning and each adapter (DoRA
    with the tiled MLP); then the degree-2 run stopped at step 2 resumes on one process (degree 1) to the same
    losses."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The river"}\n')
    sampled = ("--sample-prompts", prompts, "--sample-max-tokens", 8)
    one = train(tmp_path, train_env, "one", 1, "--strategy", strategy, "--max-steps", 4, *sampled, *extra)
    split = train(tmp_path, train_env, "split", 2, "--strategy", strategy, "--sequence-parallel", 2, "--max-steps", 4,
                  "--activation-checkpointing", "true", "--offload-activations", "on", *sampled, *extra)
    assert sorted(split) == [1, 2, 3, 4]
    for step, figures in one.items():
        assert split[step] == pytest.approx(figures, rel=1e-5, abs=1e-6), step
    evals, want = ({e["step"]: e["loss"] for e in events(tmp_path / run, "eval")} for run in ("split", "one"))
    assert evals.keys() == want.keys() == {0, 2, 4}
    assert all(evals[s] == pytest.approx(want[s], rel=1e-5) for s in want)
    # greedy samples decode whole prompts on every rank, with the family's own attention
    completions = [[e["completion"] for e in events(tmp_path / run, "sample")] for run in ("one", "split")]
    assert len(completions[0]) == 3 and completions[0] == completions[1]
    log = (tmp_path / "split" / "train.log").read_text()
    assert "each sequence split over 2 ranks" in log
    assert "--offload-activations on: no effect on the CPU (the activations already are in host memory)" in log
    assert re.search(r"estimated peak memory per rank: .*; the longest sequence that fits it: [\d,]+ tokens at batch 2",
                     log)
    if strategy == "fsdp2" and not extra:  # the run's config scores its export on one process, whole sequences
        out = tmp_path / "eval.json"
        proc = run_evaluate(train_env["env"], tmp_path / "split" / "hf", "--config", tmp_path / "split" / "config.yaml",
                            "--out", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(out.read_text())["loss"] == pytest.approx(evals[4], rel=1e-5)
    if extra[1:2] in (("dora",), ("qlora",)):  # their checkpoints resume as LoRA's, whose case resumes below
        return
    train(tmp_path, train_env, "resumed", 2, "--strategy", strategy, "--sequence-parallel", 2, "--max-steps", 2,
          *extra)
    resumed = train(tmp_path, train_env, "resumed", 1, "--strategy", strategy, "--max-steps", 4, *extra)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(one[step], rel=1e-5, abs=1e-6), step


@pytest.mark.parametrize("objective,strategy,extra", [("dpo", "fsdp2", ()), ("dpo", "ddp", ("--adapter", "lora")),
                                                      ("kto", "ddp", ("--adapter", "lora")), ("reward", "fsdp2", ())])
def test_preference_objectives_at_degree_2_take_the_one_process_steps(tmp_path, train_env, objective, strategy, extra):
    """Packed pairs (KTO records) of 128 tokens split over two ranks: each rank scores its positions, the rows'
    log-probabilities are gathered whole for each answer's sum, and the pair losses, gradient norms and TRL's figures
    are the one process's at every step; full fine-tuning's reference pass (before training, whole sequences) and an
    adapter run's adapters-off reference both."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    source = {"dpo": "preferences", "kto": "kto", "reward": "preferences"}[objective]
    shutil.copytree(ROOT / "examples" / source, tmp_path / "data")
    build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "pairs", num_proc=1))
    runs = {}
    for name, nproc, split in (("one", 1, ()), ("split", 2, ("--sequence-parallel", 2))):
        proc = torchrun(nproc, ROOT / "fsdp1.py", "-e", name, "-d", tmp_path / "pairs", "-m", "local/tiny",
                        "--save-dir", tmp_path, "--config", ROOT / "configs" / "demo.yaml", "--seq-length", 128,
                        "--batch-size", 2, "--max-steps", 4, "--log-freq", 1, "--eval-freq", 4, "--lr", 3e-3,
                        "--objective", objective, "--precision", "fp32", "--strategy", strategy, *split, *extra,
                        env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = {e["step"]: e for e in events(tmp_path / name, "train")}
        runs[name]["eval"] = events(tmp_path / name, "eval")[-1]
    assert list(runs["split"]) == [1, 2, 3, 4, "eval"]
    for step, want in runs["one"].items():
        got = runs["split"][step]
        for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen", "kl", "accuracy", "margin"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6, nan_ok=True), (step, key)


def test_what_it_cannot_run_is_one_line_before_any_worker_starts(tmp_path, train_env, family_models):
    base = ["-d", train_env["dataset"], "-m", "local/tiny", "--save-dir", tmp_path, "--config",
            ROOT / "configs" / "demo.yaml", "--seq-length", 128]
    got = preflight_errors([
        ["-e", "a", *base, "--sequence-parallel", 2, "--strategy", "fsdp1"],
        ["-e", "b", *base, "--sequence-parallel", 2, "--objective", "grpo"],
        ["-e", "c", *base, "--sequence-parallel", 2],
        ["-e", "c3", *base, "--sequence-parallel", 8],
        ["-e", "d", *base[:-1], 130, "--sequence-parallel", 4],
        ["-e", "e", *base[:3], family_models["qwen3_5"], *base[4:], "--sequence-parallel", 2],
        ["-e", "f", *base, "--sequence-parallel", 0],
        ["-e", "g", *base, "--sequence-parallel", 2, "--compile", "true"],
        ["-e", "h", *base, "--sequence-parallel", 2, "--expert-parallel", 2],
    ], train_env["env"])
    assert got == [
        "--sequence-parallel 2 needs --strategy fsdp2 or ddp, got --strategy fsdp1",
        "--sequence-parallel 2 trains --objective sft, dpo, ipo, simpo, orpo, kto or reward, not grpo yet (its "
        "generation runs whole sequences); use --sequence-parallel 1",
        "--sequence-parallel 2 must divide the number of ranks (1): each group of 2 consecutive ranks shares one "
        "sequence",
        "--sequence-parallel 8 cannot split LlamaForCausalLM: its 4 attention heads do not divide into 8 groups; use "
        "--sequence-parallel 1",
        "--sequence-parallel 4 must divide --seq-length (130): each rank takes an equal slice of every sequence; try "
        "--seq-length 128",
        REFUSED["qwen3_5"],
        "--sequence-parallel must be a number of ranks from 1 (off), got 0",
        "--sequence-parallel 2 does not take --compile yet; use one of them",
        "--sequence-parallel 2 cannot be combined with --expert-parallel 2 yet; use one of them",
    ]


def test_a_bidirectional_config_is_refused_its_mask_would_be_causal():
    """Gemma 3's use_bidirectional_attention and Gemma 4's "all" attend both ways: the mask built is causal."""
    from pipeline.prep.tiny import family_config
    from pipeline.strategies.sequence_parallel import refusal

    for family, value in (("gemma3", True), ("gemma4", "all")):
        config = family_config(family, 512, 0, 1)
        assert refusal(config, 2, "sdpa") == ""
        config.use_bidirectional_attention = value
        assert refusal(config, 2, "sdpa") == "its config makes attention bidirectional", family
