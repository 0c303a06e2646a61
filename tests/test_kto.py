"""KTO: unpaired records (a completion labelled desirable or not) read by DATA-HF in TRL's forms, packed with their KL
sequences, trained with TRL's loss (bench/kto_vs_trl.py compares whole runs with TRL's KTOTrainer), resumed bitwise."""

import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
from conftest import run_evaluate
from test_corpus import stored
from test_preferences import alone_logp, chat, reference_of, write_jsonl

from pipeline.prep.corpus import CorpusConfig, build_dataset, format_summary


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def arithmetic_feedback(tmp_path: Path, n: int) -> Path:
    """A DATA-HF dataset of n x n standard KTO records, a right sum labelled desirable and a wrong product not, in
    turn, at tmp_path/feedback."""
    rows = [{"prompt": f"What is {a} plus {b}?", "completion": f" {a + b}." if (a + b) % 2 else f" {a * b + 7} maybe.",
             "label": bool((a + b) % 2)} for a in range(1, n + 1) for b in range(1, n + 1)]
    write_jsonl(tmp_path / "data" / "feedback.jsonl", rows)
    build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "feedback", num_proc=1))
    return tmp_path / "feedback"


def test_unpaired_records_in_both_forms_are_kept_with_their_label_and_bad_ones_skipped_by_reason(tmp_path):
    """TRL's standard and conversational unpaired forms become rows with their completion as the chosen answer
    (desirable) or the rejected one (not); a label that is no JSON boolean is never guessed, nor a pair missing an
    answer read as a KTO record; pairs in the same folder are kept beside them (KTO trains on both)."""
    rows = [
        {"prompt": "The sky is", "completion": " blue.", "label": True},
        {"prompt": chat("Hi?"), "completion": answer("Go away."), "label": False},
        {"prompt": "x", "completion": "y", "label": "false"},
        {"prompt": "x", "completion": "y", "label": 1},
        {"prompt": "x", "completion": "  ", "label": True},
        {"prompt": chat("Hi?"), "completion": chat("no"), "label": True},
        {"prompt": "x", "completion": answer("y"), "label": True},
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        {"prompt": chat("Hi?"), "chosen": [], "rejected": answer("no")},  # a pair missing an answer: no KTO record
        {"chosen": chat("a", "b"), "rejected": chat("a")},
    ]
    write_jsonl(tmp_path / "data" / "feedback.jsonl", rows)
    report = build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "out", num_proc=1))
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    assert [(r["text"], *(stored(r[k]) for k in ("messages", "chosen", "rejected"))) for r in ds] == [
        ("The sky is", [], stored(answer(" blue.")), []),
        ("", stored(chat("Hi?")), [], stored(answer("Go away."))),
        ("2+2?", [], stored(answer("4")), stored(answer("5"))),
    ]
    prefs = report["preferences"]
    assert (prefs["rows"], prefs["by_form"]) == (3, {"standard": 1, "unpaired": 2})
    assert {k: v["where"] for k, v in prefs["skipped"].items()} == {
        "bad_label": ["feedback.jsonl:line 3", "feedback.jsonl:line 4"],
        "empty_answer": ["feedback.jsonl:line 5", "feedback.jsonl:line 9", "feedback.jsonl:line 10"],
        "malformed_message": ["feedback.jsonl:line 7"], "not_alternating": ["feedback.jsonl:line 6"]}
    assert "  preference records: 3 (standard 1, unpaired 2)\n" in format_summary(report)


def test_kto_examples_pack_each_completion_with_the_record_befores_as_its_kl_sequence(tiny_models):
    """An unpaired row is one example and a pair two (chosen desirable, rejected not); each example's KL sequence is
    its prompt with the completion of the record before it (a pair's answer of the same label; the first record takes
    the last's), whichever map batch the record falls in, cut from its end where it would not fit (a long neighbour
    drops no example); the flags mark the undesirable completions alone."""
    from transformers import AutoTokenizer

    from pipeline.data import chat_tokens, packing
    from pipeline.data.pair_tokens import CHOSEN, REJECTED, UNDESIRABLE, pack_pairs, tokenize_kto_batch, tokenize_pair

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    keep = chat_tokens.special_texts(tokenizer)
    ds = datasets.Dataset.from_list([
        {"text": "p0", "messages": [], "chosen": answer(" A"), "rejected": []},
        {"text": "p1", "messages": [], "chosen": [], "rejected": answer(" B")},
        {"text": "p2", "messages": [], "chosen": answer(" C"), "rejected": answer(" D")},
    ])
    expected = [(tokenize_pair(tokenizer, prompt, [], answer(mine), answer(kl), "", keep), desirable)
                for prompt, mine, kl, desirable in (("p0", " A", " C", True), ("p1", " B", " A", False),
                                                    ("p2", " C", " B", True), ("p2", " D", " B", False))]

    def examples(batches: list[list[int]]) -> list[tuple]:
        out = []
        for rows in batches:
            got = tokenize_kto_batch(ds[rows[0]:rows[-1] + 1], rows, ds, tokenizer, "", 64, keep)
            out += [(c.tolist(), ct.tolist(), r.tolist(), rt.tolist(), d) for c, ct, r, rt, d in zip(
                got["chosen"], got["chosen_trained"], got["rejected"], got["rejected_trained"], got["desirable"],
                strict=True)]
        return out

    want = [(p.chosen.tolist(), p.chosen_trained.astype(np.uint8).tolist(), p.rejected.tolist(),
             p.rejected_trained.astype(np.uint8).tolist(), int(d)) for p, d in expected]
    assert examples([[0, 1, 2]]) == want
    assert examples([[0], [1, 2]]) == examples([[0, 1], [2]]) == want
    # a long record last: p0's KL sequence takes its completion, cut from the end to fit (p0 itself kept whole);
    # its own example, too long for a block, is dropped
    long = ds.add_item({"text": "p3", "messages": [], "chosen": answer(" word" * 80), "rejected": []})
    got = tokenize_kto_batch(long[0:1], [0], long, tokenizer, "", 64, keep)
    whole = tokenize_pair(tokenizer, "p0", [], answer(" A"), answer(" word" * 80), "", keep)
    assert got["status"] == [0] and len(whole) > 64 and got["chosen"][0].tolist() == whole.chosen.tolist()
    assert got["rejected"][0].tolist() == whole.rejected.tolist()[:64 - len(whole.chosen)]
    assert tokenize_kto_batch(long[3:4], [3], long, tokenizer, "", 64, keep)["status"] == [2]  # dropped_too_long
    blocks, flags = pack_pairs([p for p, _ in expected], 64, tokenizer.eos_token_id,
                               np.array([not d for _, d in expected]))
    starts = (flags & packing.START) > 0
    completions = starts & ((flags & CHOSEN) > 0)
    assert completions.sum() == 4 and (starts & ((flags & REJECTED) > 0)).sum() == 4
    labelled = {tuple(blocks[b, i:i + 4].tolist()): bool(flags[b, i] & UNDESIRABLE)
                for b, i in zip(*completions.nonzero(), strict=True)}
    assert labelled == {tuple(p.chosen[:4].tolist()): not d for p, d in expected}
    assert not (flags[(flags & REJECTED) > 0] & UNDESIRABLE).any()


def test_kto_on_packed_examples_has_the_loss_and_gradient_of_kto_on_each_example_alone(tiny_models):
    """The objective over a packed block gives the loss, every parameter's gradient and the metrics of TRL's KTO
    written out over each example's sequences alone (the KL term the mean of the KL sequences' log-ratios, without
    gradient, at least 0; the desirable and undesirable weights applied); at a reference equal to the policy each
    example's loss is its weight over 2."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data.batches import make_batch
    from pipeline.data.pair_tokens import pack_pairs, tokenize_pair
    from pipeline.model.head import Head
    from pipeline.objectives.kto import KTOObjective, KTOSettings

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    policy = AutoModelForCausalLM.from_pretrained(tiny_models["tied"], dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_models["untied"], dtype=torch.float32).eval()
    labels = [True, False, True, False]
    examples = [tokenize_pair(tokenizer, f"Sum {i} and {i}:", [], answer(f" {2 * i}" if good else f" not {i}"),
                              answer(f" {i + 5}"), "", None) for i, good in enumerate(labels)]
    blocks, flags = pack_pairs(examples, 64, tokenizer.eos_token_id, np.array([not g for g in labels]))
    batch = make_batch(blocks, flags, torch.device("cpu"))
    settings = KTOSettings(beta=0.1, desirable_weight=1.5, undesirable_weight=0.5)

    with torch.no_grad():
        same = KTOObjective(Head(policy, False, 1), settings, reference_of(policy, flags))
        torch.testing.assert_close(same(batch, 4), torch.tensor((1.5 + 0.5) / 4, dtype=torch.float32))
    objective = KTOObjective(Head(policy, False, 1), settings, reference_of(ref_model, flags))
    loss = objective(batch, 4)
    loss.backward()
    packed = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()

    with torch.no_grad():
        ratios = [alone_logp(policy, e.rejected, e.rejected_trained)
                  - alone_logp(ref_model, e.rejected, e.rejected_trained) for e in examples]
        kl = torch.stack(ratios).mean().clamp(min=0)
        refs = [alone_logp(ref_model, e.chosen, e.chosen_trained) for e in examples]
    mine = [alone_logp(policy, e.chosen, e.chosen_trained) for e in examples]
    terms = [1.5 * (1 - torch.sigmoid(0.1 * (m - r - kl))) if good else 0.5 * (1 - torch.sigmoid(0.1 * (kl - m + r)))
             for m, r, good in zip(mine, refs, labels, strict=True)]
    alone = torch.stack(terms).sum() / 4
    alone.backward()
    torch.testing.assert_close(loss, alone, rtol=0, atol=1e-6)
    for name, param in policy.named_parameters():
        torch.testing.assert_close(packed[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)
    metrics = objective.read_metrics(reduce=False)
    rewards = [0.1 * (m - r).item() for m, r in zip(mine, refs, strict=True)]
    assert metrics == pytest.approx({
        "kl": kl.item(), "rewards/chosen": (rewards[0] + rewards[2]) / 2,
        "rewards/rejected": (rewards[1] + rewards[3]) / 2,
        "rewards/margins": (rewards[0] + rewards[2] - rewards[1] - rewards[3]) / 2,
        "logps/chosen": (mine[0] + mine[2]).item() / 2, "logps/rejected": (mine[1] + mine[3]).item() / 2}, rel=1e-5)


def test_the_objective_and_the_data_must_agree_in_one_line(tmp_path, train_env):
    """Unpaired records train with kto alone (a labelled completion read as a pair, or as an answer to imitate, would
    train the bad ones); kto needs labelled completions or pairs; KTO's weights are checked and belong to kto. Each
    refused before any weight is read; kto on unpaired records and on pairs passes."""
    from conftest import ROOT, preflight_errors

    feedback = arithmetic_feedback(tmp_path, 2)
    write_jsonl(tmp_path / "pair-data" / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3)
    build_dataset(CorpusConfig(tmp_path / "pair-data", tmp_path / "pairs", num_proc=1))
    common = ["-e", "r", "-m", "local/tiny", "--save-dir", tmp_path / "runs", "--config",
              ROOT / "configs" / "demo.yaml"]
    kto = [*common, "--objective", "kto"]
    refusals = preflight_errors([[*common, "-d", feedback], [*common, "-d", feedback, "--objective", "dpo"],
                                 [*kto, "-d", train_env["dataset"]],
                                 [*common, "-d", tmp_path / "pairs", "--objective", "dpo",
                                  "--kto-desirable-weight", 2],
                                 [*kto, "-d", feedback, "--kto-undesirable-weight", "inf"],
                                 [*kto, "-d", feedback, "--kto-desirable-weight", 0, "--kto-undesirable-weight", 0],
                                 [*kto, "-d", feedback, "--kto-desirable-weight", 1.33],
                                 [*kto, "-d", tmp_path / "pairs"]], train_env["env"])
    unpaired = (f"{feedback} holds 4 unpaired preference records (a prompt, one completion and its label): train "
                "them with --objective kto")
    assert refusals == [
        unpaired, unpaired,
        f"--objective kto trains on labelled completions and {train_env['dataset']} holds none (DATA-HF reads records "
        "with a prompt, a completion and a true/false label, and pairs, as KTO's records)",
        "--kto-desirable-weight is for --objective kto, not dpo",
        "--kto-undesirable-weight must be a finite number, got inf",
        "--kto-desirable-weight and --kto-undesirable-weight are both 0: nothing would be trained",
        "ok", "ok"]
    assert not (tmp_path / "runs").exists()


def test_kto_with_lora_trains_on_two_ranks_resumes_bitwise_and_full_fine_tuning_computes_its_reference(tmp_path,
                                                                                                      train_env):
    """KTO with LoRA starts at 0.5 with a KL term of 0 (the adapters are zero, so the policy is its reference), moves
    the desirable completions' rewards above the undesirable ones' as it trains, ends with its validation line, and
    a rerun from a checkpoint repeats the steps after it bit for bit; pipeline.evaluate of the adapter gives the
    final validation. Full fine-tuning computes the base's log-probabilities once before the first step, so it too
    starts at 0.5."""
    import shutil

    from conftest import ROOT, events, torchrun

    feedback = arithmetic_feedback(tmp_path, 8)

    def run(name: str, *extra: object) -> str:
        proc = torchrun(2, ROOT / "fsdp1.py", "-e", name, "-d", feedback, "-m", "local/tiny", "--save-dir",
                        tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--seq-length", 128,
                        "--max-steps", 6, "--log-freq", 1, "--ckpt-freq", 3, "--lr", 1e-2, "--objective", "kto",
                        *extra, env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    said = run("lora", "--adapter", "lora", "--strategy", "fsdp2")
    lora = tmp_path / "runs" / "lora"
    train, evals = events(lora, "train"), events(lora, "eval")
    assert "KTO examples (each its completion and its KL sequence): kept 64; " in said
    assert "; of those kept, 32 desirable and 32 undesirable" in said
    assert (train[0]["loss"], train[0]["kl"], evals[0]["loss"]) == pytest.approx((0.5, 0, 0.5), abs=1e-6)
    assert train[-1]["loss"] < 0.5 and evals[-1]["loss"] < 0.5 and evals[-1]["rewards/margins"] > 0
    assert train[-1]["rewards/margins"] == pytest.approx(train[-1]["rewards/chosen"] - train[-1]["rewards/rejected"])
    final = evals[-1]
    assert re.search(rf"validation kto loss 0\.5000 -> {final['loss']:.4f} over \d+ examples; reward margin "
                     rf"\(desirable - undesirable\) 0\.0000 -> {final['rewards/margins']:.4f}, kl 0\.0000 -> "
                     rf"{final['kl']:.4f}, base -> step 6", said), said[-2000:]
    proc = run_evaluate(train_env["env"], lora / "adapter", "--config", lora / "config.yaml", "--out",
                        tmp_path / "e.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "e.json").read_text())
    assert (report["objective"], report["reference"]) == ("kto", "the base, adapter off") and report["examples"] > 0
    assert report["loss"] == pytest.approx(final["loss"], abs=1e-5) and "preference_accuracy" not in report
    assert report["kl"] == pytest.approx(final["kl"], abs=1e-4)
    assert f"kto loss   {report['loss']:.5f}\nmargin     {report['mean_margin']:.4f}\n" in proc.stdout
    shutil.copytree(lora, tmp_path / "runs" / "again")
    run("again", "--adapter", "lora", "--strategy", "fsdp2", "--resume-from", "step-00000003")
    again = events(tmp_path / "runs" / "again", "train")
    assert [e["step"] for e in again] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    keys = ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
    assert [[e[k] for k in keys] for e in again[6:]] == [[e[k] for k in keys] for e in train[3:]]
    said = run("full", "--strategy", "ddp", "--lr", 3e-3, "--precision", "fp32")
    full = events(tmp_path / "runs" / "full", "train")
    assert "reference log-probabilities of 64 pairs under local/tiny: computed in " in said
    assert (full[0]["loss"], full[0]["kl"]) == pytest.approx((0.5, 0), abs=1e-6) and full[-1]["loss"] < 0.5


def test_unbalanced_labels_get_the_weights_the_kto_paper_recommends():
    """TRL's check of the KTO paper's eq. 8 (w_d * n_d / (w_u * n_u) in [1, 4/3]), with its rounding: balanced labels
    or a weight in its range say nothing; otherwise both ranges, either to be used."""
    from pipeline.objectives.kto import KTOSettings, balance_advice

    assert balance_advice(60, 60, KTOSettings()) == ""
    assert balance_advice(30, 90, KTOSettings(desirable_weight=3.5)) == ""
    assert balance_advice(30, 90, KTOSettings(undesirable_weight=0.3)) == ""
    assert balance_advice(30, 90, KTOSettings()) == (
        "30 desirable and 90 undesirable examples at --kto-desirable-weight 1 and --kto-undesirable-weight 1: the KTO "
        "paper's balance (eq. 8) wants --kto-desirable-weight in [3, 3.99] or --kto-undesirable-weight in [0.25, 0.33] "
        "(one of them, not both)")


def test_labels_all_on_one_side_say_that_the_other_side_is_missing():
    """No weight balances one side against none (TRL's check, counting the missing side as 1, advised a range like
    [0.02, 0.02]): the advice says which side is missing, whatever the weights."""
    from pipeline.objectives.kto import KTOSettings, balance_advice

    for settings in (KTOSettings(), KTOSettings(desirable_weight=0.02), KTOSettings(undesirable_weight=64)):
        assert balance_advice(64, 0, settings) == (
            "all 64 examples are desirable, none undesirable: one side of KTO is missing, so no weight balances the "
            "two and the reward margin (desirable - undesirable) is undefined; the run trains the desirable "
            "completions against the KL term alone (to train both sides, add undesirable records, label false, or "
            "pairs)")
        assert balance_advice(0, 7, settings) == (
            "all 7 examples are undesirable, none desirable: one side of KTO is missing, so no weight balances the "
            "two and the reward margin (desirable - undesirable) is undefined; the run trains the undesirable "
            "completions against the KL term alone (to train both sides, add desirable records, label true, or "
            "pairs)")


def test_a_kto_run_on_labels_all_on_one_side_warns_once_and_validates_without_a_nan_margin(tmp_path, train_env):
    """Only undesirable completions: one warning line that the desirable side is missing (not a weight range), and
    the validation's closing line says the margin is undefined for want of desirable examples instead of nan."""
    from conftest import ROOT, torchrun

    rows = [{"prompt": f"What is {a} plus {b}?", "completion": f" {a * b + 7} maybe.", "label": False}
            for a in range(1, 7) for b in range(1, 7)]
    write_jsonl(tmp_path / "data" / "feedback.jsonl", rows)
    build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "feedback", num_proc=1))
    proc = torchrun(1, ROOT / "fsdp1.py", "-e", "r", "-d", tmp_path / "feedback", "-m", "local/tiny", "--save-dir",
                    tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--seq-length", 128, "--max-steps",
                    2, "--objective", "kto", "--adapter", "lora", env=train_env["env"])
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    (warning,) = [line for line in said.splitlines() if "KTO: " in line]
    assert warning.endswith(
        "KTO: all 36 examples are undesirable, none desirable: one side of KTO is missing, so no weight balances the "
        "two and the reward margin (desirable - undesirable) is undefined; the run trains the undesirable completions "
        "against the KL term alone (to train both sides, add desirable records, label true, or pairs)")
    (closing,) = [line for line in said.splitlines() if "validation kto loss" in line]
    assert re.search(r"validation kto loss 0\.5000 -> \d\.\d{4} over \d+ examples; reward margin \(desirable - "
                     r"undesirable\) undefined \(the validation examples hold no desirable completion\), kl 0\.0000 "
                     r"-> \d\.\d{4}, base -> step 2$", closing), closing
    assert "nan" not in warning + closing
    # pipeline.evaluate of its adapter on the run's config: the margin said undefined too, not "nan"
    from conftest import run_evaluate

    scored = run_evaluate(train_env["env"], tmp_path / "runs" / "r" / "adapter", "--config",
                          tmp_path / "runs" / "r" / "config.yaml")
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert "margin     undefined (the examples hold desirable or undesirable completions only)\n" in scored.stdout, \
        scored.stdout
