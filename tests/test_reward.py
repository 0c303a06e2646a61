"""Reward models (--objective reward): the score head as a transform reads as each family's sequence-classification
class does, the Bradley-Terry loss over packed pairs is the loss of each pair alone, a run ranks held-out pairs, resumes
bitwise and exports a folder AutoModelForSequenceClassification loads (bench/reward_vs_trl.py compares whole runs with
TRL's RewardTrainer)."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import run_evaluate
from test_preferences import arithmetic_pairs

from pipeline.errors import UserError
from pipeline.prep.tiny import FAMILIES, family_config


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_s_reward_head_scores_as_its_sequence_classification_class_or_is_refused(family):
    """Each family the suite trains: the causal LM with the reward head transform gives, at a sequence's last token,
    the score its family's AutoModelForSequenceClassification gives with the same weights (the export's names),
    soft-capped and scaled families included (that class applies no term on the logits); a family without such a
    class is one line."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from pipeline.model.reward_head import RewardHead, reward_head_layout

    config = family_config(family, 1024, 1, 2)
    if config.model_type not in transformers.models.auto.modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        with pytest.raises(UserError) as refused:
            reward_head_layout(config)
        assert str(refused.value) == (
            f"--objective reward: transformers has no sequence-classification class for "
            f"{type(config).__name__.removesuffix('Config')} (model_type {config.model_type}), which would read the "
            "reward model")
        return
    layout = reward_head_layout(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    head = RewardHead(layout, pad_token_id=0)
    head.apply(model)
    model.get_output_embeddings().weight = torch.nn.Parameter(torch.randn(1, config.hidden_size))
    scorer = AutoModelForSequenceClassification.from_config(model.config).eval()
    missing = scorer.load_state_dict(head.export_state(model.state_dict()), strict=True)
    assert not missing.missing_keys and scorer.config.architectures == [type(scorer).__name__] == [layout[0]]
    ids = torch.randint(3, 1024, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits[0, -1], scorer(input_ids=ids).logits[0],
                                   rtol=1e-5, atol=1e-6)


def test_the_score_is_the_class_s_own_one_output_layer_and_trains_in_fp32_beside_adapters():
    """The score is found by its name in the sequence-classification class (Qwen2-MoE's one-output shared-expert
    gates are no score), and beside a frozen bf16 base it is a trainable fp32 parameter (AdamW on bf16 weights would
    lose updates below their precision)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from pipeline.config import ModelConfig
    from pipeline.model.adapters import adapter_transform
    from pipeline.model.reward_head import HEAD, RewardHead, reward_head_layout

    moe = Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, num_experts=2, num_experts_per_tok=1)
    assert reward_head_layout(moe) == ("Qwen2MoeForSequenceClassification", "score.weight")
    config = family_config("llama", 1024, 1, 2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    adapter_transform(ModelConfig(model_name="m", adapter="lora"), torch.bfloat16).apply(model)
    RewardHead(reward_head_layout(config), 0).apply(model)
    score = dict(model.named_parameters())[HEAD]
    assert (score.dtype, score.requires_grad) == (torch.float32, True)
    assert dict(model.named_parameters())["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_the_bradley_terry_loss_over_packed_pairs_is_each_pair_s_alone(tiny_models):
    """Over a packed block (several pairs, each answer its own sequence, a padding sequence after them) the objective
    reads each answer's reward at its last token that is not padding, and gives the loss, every parameter's gradient
    and TRL's metrics of the Bradley-Terry loss (with center_rewards_coefficient) written out pair by pair with the
    sequence-classification model on each answer alone."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from pipeline.data.batches import make_batch
    from pipeline.data.pair_tokens import pack_pairs, tokenize_pair
    from pipeline.model.head import Head
    from pipeline.model.reward_head import RewardHead, pad_id, reward_head_layout
    from pipeline.objectives.reward import RewardObjective

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["untied"])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["untied"], dtype=torch.float32)
    head = RewardHead(reward_head_layout(model.config), pad_id(tokenizer))
    head.apply(model)
    torch.manual_seed(0)
    model.get_output_embeddings().weight = torch.nn.Parameter(torch.randn(1, model.config.hidden_size) * 0.1)
    answer = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    pairs = [tokenize_pair(tokenizer, f"Sum {i} and {i}:", [], answer(f" {2 * i}"), answer(f" not {i}"), "", None)
             for i in range(4)]
    blocks, flags = pack_pairs(pairs, 96, tokenizer.eos_token_id)
    assert len(blocks) == 1 and ((flags & 2) > 0).sum() == 9  # 8 answers and a padding sequence after them
    objective = RewardObjective(Head(model, False, 1), head.pad_token_id, center_rewards_coefficient=0.01)
    loss = objective(make_batch(blocks, flags, torch.device("cpu")), 4)
    loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    scorer = AutoModelForSequenceClassification.from_config(model.config)
    scorer.load_state_dict(head.export_state(model.state_dict()))
    rewards = [[scorer(input_ids=torch.from_numpy(s.astype(np.int64))[None]).logits[0, 0] for s in (p.chosen,
                                                                                                      p.rejected)]
               for p in pairs]
    alone = sum(-torch.nn.functional.logsigmoid(c - r) + 0.01 * (c + r) ** 2 for c, r in rewards) / 4
    torch.testing.assert_close(loss, alone, rtol=0, atol=1e-6)
    # the same parameters in the scorer: its gradients are the causal LM's (the score's under the head's name)
    alone.backward()
    for name, param in scorer.named_parameters():
        ours = packed["lm_head.weight" if name == head.score_name else name]
        torch.testing.assert_close(ours, param.grad, rtol=1e-4, atol=1e-6, msg=name)
    flat = [r.item() for pair in rewards for r in pair]
    metrics = objective.read_metrics(reduce=False)
    assert metrics == pytest.approx({
        "accuracy": sum(c > r for c, r in rewards).item() / 4, "margin": sum(c - r for c, r in rewards).item() / 4,
        "mean_reward": sum(flat) / 8, "min_reward": min(flat), "max_reward": max(flat)}, rel=1e-5, abs=1e-6)


def test_reward_runs_are_refused_in_one_line_where_they_cannot_train(tmp_path, train_env, tiny_models):
    """Sampling and the hand-written strategy are refused for a reward model, and its coefficient for other
    objectives; a tokenizer that pads with a token beyond the embedding (the export could not be built: "Padding_idx
    must be within num_embeddings", after the whole run); each before any weight is read. The plain run and the
    adapter run pass."""
    import shutil

    from conftest import ROOT, preflight_errors
    from transformers import AutoTokenizer

    padded = shutil.copytree(tiny_models["tied"], tmp_path / "padded")
    tokenizer = AutoTokenizer.from_pretrained(padded)
    tokenizer.add_special_tokens({"pad_token": "<pad-beyond>"})
    tokenizer.save_pretrained(padded)

    arithmetic_pairs(tmp_path, 2)
    common = ["-e", "r", "-m", "local/tiny", "--save-dir", tmp_path / "runs", "--config",
              ROOT / "configs" / "demo.yaml", "-d", tmp_path / "pairs"]
    reward = [*common, "--objective", "reward"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n')
    refusals = preflight_errors([reward, [*reward, "--adapter", "qlora"], [*reward, "--sample-prompts", prompts],
                                 [*reward, "--strategy", "manual"],
                                 [*common, "--objective", "dpo", "--center-rewards-coefficient", 0.1],
                                 [*reward, "--center-rewards-coefficient", -1],
                                 [*reward, "-m", padded]], train_env["env"])
    assert refusals == [
        "ok", "ok",
        "--sample-prompts: a reward model scores text and does not generate; drop it (its validation gives the "
        "held-out accuracy)",
        "--objective reward trains under --strategy ddp, fsdp2 or fsdp1 (auto picks among them), not manual",
        "--center-rewards-coefficient is for --objective reward, not dpo",
        "--center-rewards-coefficient must be in [0, 1000], got -1",
        f"--objective reward: the tokenizer of {padded} pads with token id {len(tokenizer) - 1}, beyond the model's "
        "embedding of 1,024 rows, so the exported reward model could not be loaded; set its pad_token "
        "(tokenizer_config.json) to a token the model has, e.g. its end-of-sequence token"]
    assert not (tmp_path / "runs").exists()


def test_a_reward_model_ranks_held_out_pairs_resumes_bitwise_and_exports_a_sequence_classifier(tmp_path, train_env,
                                                                                              tiny_models):
    """Trained on pairs of a right sum against a wrong product (fsdp2), it ranks the held-out pairs (validation
    accuracy above 0.9); the export loads with AutoModelForSequenceClassification and scores a chosen answer above
    its rejected one; pipeline.evaluate of it gives the run's final validation. With LoRA (ddp) the score trains
    beside the adapters: the adapter folder (peft's SEQ_CLS, the score as modules_to_save) on the base loaded as a
    sequence classifier scores as the merged export does, and a rerun from a checkpoint (the adapters and the score)
    repeats the steps after it bit for bit. MODEL_DOWNLOAD imports the export into the cache as the sequence
    classifier it is; from there it trains further as a reward model only. pipeline.chat refuses either folder in one
    line (a reward model does not generate)."""
    import re

    from conftest import ROOT, events, hub_env, preflight_errors, run_module, run_script, torchrun
    from transformers import AutoModelForSequenceClassification

    arithmetic_pairs(tmp_path, 10)

    def run(name: str, *extra: object) -> str:
        proc = torchrun(2, ROOT / "fsdp1.py", "-e", name, "-d", tmp_path / "pairs", "-m", "local/tiny", "--save-dir",
                        tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--seq-length", 128,
                        "--max-steps", 8, "--log-freq", 1, "--ckpt-freq", 4, "--lr", 3e-3, "--objective", "reward",
                        "--precision", "fp32", *extra, env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    said = run("rm", "--strategy", "fsdp2")
    rm = tmp_path / "runs" / "rm"
    train, evals = events(rm, "train"), events(rm, "eval")
    assert "vocabulary-parallel head off for RewardLlamaForCausalLM: its output layer is a reward model's score" in said
    assert evals[-1]["accuracy"] > 0.9 and evals[-1]["loss"] < evals[0]["loss"] < 0.8
    assert set(train[-1]) >= {"accuracy", "margin", "mean_reward", "min_reward", "max_reward"}
    assert train[-1]["min_reward"] <= train[-1]["mean_reward"] <= train[-1]["max_reward"]
    final = evals[-1]
    assert re.search(rf"validation accuracy {evals[0]['accuracy']:.3f} -> {final['accuracy']:.3f} over \d+ pairs; "
                     rf"reward loss {evals[0]['loss']:.4f} -> {final['loss']:.4f}", said), said[-2000:]
    scorer, info = AutoModelForSequenceClassification.from_pretrained(rm / "hf", output_loading_info=True)
    assert not any(info.values()) and scorer.config.num_labels == 1
    proc = run_evaluate(train_env["env"], rm / "hf", "--config", rm / "config.yaml", "--out", tmp_path / "e.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "e.json").read_text())
    assert (report["objective"], report["reference"]) == ("reward", None)
    assert report["loss"] == pytest.approx(final["loss"], abs=1e-5) and report["accuracy"] == final["accuracy"]
    # MODEL_DOWNLOAD imports it (checked as the sequence classifier it is): it trains further as a reward model, and
    # anything else is refused, since it has no language-model head
    imported = run_script("MODEL_DOWNLOAD.py", "--model-name", "local/rm", "--source", rm / "hf",
                          env=hub_env(tmp_path / "hf"))
    assert imported.returncode == 0 and "model:       LlamaForSequenceClassification at " in imported.stdout
    base = ["-e", "next", "-m", "local/rm", "--save-dir", tmp_path / "next", "--config",
            ROOT / "configs" / "demo.yaml", "-d", tmp_path / "pairs"]
    policy = ["-e", "dpo", "-m", "local/tiny", "--save-dir", tmp_path / "next", "--config",
              ROOT / "configs" / "demo.yaml", "-d", tmp_path / "pairs", "--objective", "dpo"]
    assert preflight_errors([[*base, "--objective", "reward"], [*base, "--objective", "dpo"]],
                            hub_env(tmp_path / "hf")) == [
        "ok", "--model-name local/rm is a reward model (LlamaForSequenceClassification): it trains further with "
        "--objective reward only (it has no language-model head)"]
    assert preflight_errors([[*policy, "--reference-model", rm / "hf"]], train_env["env"]) == [
        f"--reference-model {rm / 'hf'} is a reward model (LlamaForSequenceClassification): a reference gives "
        "log-probabilities, which a reward model has no head for"]
    # nor does pipeline.evaluate score a model without a trained score as a reward model
    proc = run_evaluate(train_env["env"], "local/tiny", "--config", rm / "config.yaml")
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (2, (
        "error: local/tiny is not a reward model (a run of --objective reward exports one to RUN/hf): its rewards "
        "would come from a score drawn at random"))
    # the export scores a held-out answer as the run did: its chosen answers above its rejected ones
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rm / "hf")
    row = load_from_disk(str(tmp_path / "pairs"))[0]
    scores = [scorer(input_ids=tokenizer(row["text"] + row[k][0]["content"] + tokenizer.eos_token,
                                         return_tensors="pt").input_ids).logits.item() for k in ("chosen", "rejected")]
    assert scores[0] > scores[1]
    run("lora", "--strategy", "ddp", "--adapter", "lora", "--lr", 1e-2)
    lora = tmp_path / "runs" / "lora"
    config = json.loads((lora / "adapter" / "adapter_config.json").read_text())
    assert (config["task_type"], config["modules_to_save"]) == ("SEQ_CLS", ["score"])
    from peft import PeftModel

    base = AutoModelForSequenceClassification.from_pretrained(tiny_models["tied"], num_labels=1,
                                                              pad_token_id=scorer.config.pad_token_id)
    merged = AutoModelForSequenceClassification.from_pretrained(lora / "hf").eval()
    adapted = PeftModel.from_pretrained(base, lora / "adapter").eval()
    ids = tokenizer(row["text"] + row["chosen"][0]["content"], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    train = events(lora, "train")
    shutil.copytree(lora, tmp_path / "runs" / "again", ignore=shutil.ignore_patterns("hf", "adapter"))
    run("again", "--strategy", "ddp", "--adapter", "lora", "--lr", 1e-2, "--resume-from", "step-00000004")
    again = events(tmp_path / "runs" / "again", "train")
    assert [e["step"] for e in again] == [*range(1, 9), 5, 6, 7, 8]
    keys = ("loss", "grad_norm", "accuracy", "margin", "mean_reward", "min_reward", "max_reward")
    assert [[e[k] for k in keys] for e in again[8:]] == [[e[k] for k in keys] for e in train[4:]]
    # loaded as a causal LM, a reward model's missing head would be random: pipeline.chat refuses it in one line
    for folder, why in ((rm / "hf", f"{rm / 'hf'} is a reward model (LlamaForSequenceClassification): it scores text "
                         f"and does not generate; score pairs with python -m pipeline.evaluate {rm / 'hf'} -d PAIRS"),
                        (lora / "adapter", f"{lora / 'adapter'} is a reward model's adapter: it scores text and does "
                         "not generate")):
        proc = run_module("pipeline.chat", folder, "--prompt", "Hi", env=train_env["env"])
        assert (proc.returncode, proc.stderr.strip()) == (2, f"error: {why}")
