"""Preference pairs: read by DATA-HF in TRL's forms (never as text), bad ones skipped by reason, and never trained
as text or conversations."""

import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
from conftest import run_evaluate
from test_corpus import stored

from pipeline.errors import UserError
from pipeline.prep.corpus import CorpusConfig, build_dataset


def chat(*turns: str) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def write_jsonl(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def arithmetic_pairs(tmp_path: Path, n: int) -> None:
    """A DATA-HF dataset of n x n standard pairs (a sum against a wrong product) at tmp_path/pairs."""
    rows = [{"prompt": f"What is {a} plus {b}?", "chosen": f" {a + b}.", "rejected": f" {a * b + 7} maybe."}
            for a in range(1, n + 1) for b in range(1, n + 1)]
    write_jsonl(tmp_path / "data" / "pairs.jsonl", rows)
    build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "pairs", num_proc=1))


def test_pairs_in_every_form_are_kept_as_pairs_and_bad_ones_skipped_by_reason(tmp_path):
    rows = [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": chat("Hi?"), "chosen": [chat("", "Hello!")[1]], "rejected": [chat("", "Go away.")[1]]},
        {"chosen": chat("2+2?", "4"), "rejected": chat("2+2?", "5")},
        {"prompt": "x", "chosen": "same", "rejected": "same"},
        {"prompt": "x", "chosen": "", "rejected": "y"},
        {"chosen": "a chosen answer without a rejected one"},
        {"prompt": "q", "completion": "an answer labelled bad", "label": False},
        {"chosen": chat("a", "b"), "rejected": chat("c", "d")},
        {"prompt": chat("Hi?"), "chosen": chat("Hi?", "x"), "rejected": [chat("", "y")[1]]},
    ]
    write_jsonl(tmp_path / "data" / "pairs.jsonl", rows)
    report = build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "out", num_proc=1))
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    got = [(r["text"], *(stored(r[k]) for k in ("messages", "chosen", "rejected"))) for r in ds]
    assert got == [
        ("The sky is", [], chat("", " blue.")[1:], chat("", " green.")[1:]),
        ("", chat("Hi?"), chat("", "Hello!")[1:], chat("", "Go away.")[1:]),
        ("", chat("2+2?"), chat("", "4")[1:], chat("", "5")[1:]),
        ("q", [], [], chat("", "an answer labelled bad")[1:]),  # KTO's record: its completion never a chosen answer
    ]
    prefs = report["preferences"]
    assert (prefs["rows"], prefs["by_form"]) == (4, {"conversational": 1, "implicit": 1, "standard": 1,
                                                     "unpaired": 1})
    assert {k: v["where"] for k, v in prefs["skipped"].items()} == {
        "empty_answer": ["pairs.jsonl:line 5"], "missing_field": ["pairs.jsonl:line 6"],
        "not_alternating": ["pairs.jsonl:line 9"], "prompt_not_shared": ["pairs.jsonl:line 8"],
        "same_answers": ["pairs.jsonl:line 4"]}
    # our own to_json reads back to the same pairs
    ds.to_json(str(tmp_path / "again" / "rows.jsonl"))
    build_dataset(CorpusConfig(tmp_path / "again", tmp_path / "out2", num_proc=1))
    again = datasets.load_from_disk(str(tmp_path / "out2"))
    assert [(r["text"], *(stored(r[k]) for k in ("messages", "chosen", "rejected"))) for r in again] == got


def test_a_folder_mixing_pairs_with_text_is_one_line(tmp_path):
    write_jsonl(tmp_path / "data" / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    (tmp_path / "data" / "notes.txt").write_text("a document\n")
    write_jsonl(tmp_path / "data" / "more.jsonl", [{"prompt": "q", "chosen": "c", "rejected": "d"}] * 2)
    with pytest.raises(UserError) as caught:
        build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "out", num_proc=1))
    assert str(caught.value) == (
        f"{tmp_path / 'data'} mixes 3 preference pairs with 1 text or conversation rows (the others are in notes.txt "
        "(1 row)): a run trains on one kind (SFT or a preference objective); convert them from separate folders into "
        "separate datasets")
    assert not (tmp_path / "out").exists()


def test_a_folder_of_only_bad_preference_records_names_their_own_reasons_in_one_line(tmp_path):
    """KTO labels written as strings ("true", "false", 1) and pairs whose answers are equal (standard and
    conversational): DATA-HF's one line names the records' own reasons (bad_label, same_answers) and where each was
    first, not only the files' no_valid_pair; nothing is written."""
    from conftest import run_script

    labels = [{"prompt": "2+2?", "completion": " 4", "label": "true"},
              {"prompt": chat("2+3?"), "completion": [chat("", "5")[1]], "label": "false"},
              {"prompt": "2+4?", "completion": " 6", "label": 1}]
    same = [{"prompt": "x", "chosen": " y", "rejected": " y"},
            {"prompt": chat("Hi?"), "chosen": [chat("", "Hello")[1]], "rejected": [chat("", "Hello")[1]]}]
    write_jsonl(tmp_path / "labels" / "feedback.jsonl", labels)
    write_jsonl(tmp_path / "same" / "pairs.jsonl", same)
    write_jsonl(tmp_path / "both" / "feedback.jsonl", labels)
    write_jsonl(tmp_path / "both" / "pairs.jsonl", same)
    for folder, why in (
            ("labels", "no_valid_pair: 1; preference records skipped: bad_label 3, first at feedback.jsonl:line 1"),
            ("same", "no_valid_pair: 1; preference records skipped: same_answers 2, first at pairs.jsonl:line 1"),
            ("both", "no_valid_pair: 2; preference records skipped: bad_label 3, first at feedback.jsonl:line 1; "
                     "same_answers 2, first at pairs.jsonl:line 1")):
        proc = run_script("DATA-HF.py", "--data_folder", tmp_path / folder, "--save_dir", tmp_path / f"{folder}-out",
                          "--num_proc", 1)
        assert (proc.returncode, proc.stderr) == (2, f"error: no text extracted from {tmp_path / folder} ({why})\n")
        assert not (tmp_path / f"{folder}-out").exists()


def test_the_objective_the_data_and_the_reference_must_agree_in_one_line(tmp_path, train_env):
    """SFT on pairs would train the prompts alone; a preference objective on text has nothing to compare; a
    --reference-model must score the policy's tokens in the policy's architecture. Each refused before any weight is
    read; DPO under full fine-tuning (the base as reference) and with another reference of the same shape pass."""
    from conftest import ROOT, preflight_errors

    from pipeline.prep.tiny import build_tiny

    write_jsonl(tmp_path / "data" / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3)
    build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "pairs", num_proc=1))
    other_vocab = build_tiny(tmp_path / "other-vocab", vocab_size=512)
    common = ["-e", "r", "-m", "local/tiny", "--save-dir", tmp_path / "runs", "--config",
              ROOT / "configs" / "demo.yaml"]
    pairs = [*common, "-d", tmp_path / "pairs"]
    untied = ["-m", "local/tiny-untied", "--objective", "dpo"]
    refusals = preflight_errors([pairs,
                                 [*common, "-d", train_env["dataset"], "--objective", "simpo"],
                                 [*pairs, "--objective", "dpo"],
                                 [*pairs, "--objective", "orpo", "--reference-model", "local/tiny"],
                                 [*pairs, "--objective", "dpo", "--reference-model", other_vocab],
                                 [*pairs, *untied, "--reference-model", "local/tiny"],
                                 [*pairs, *untied, "--reference-model", "local/tiny-untied", "--adapter", "lora"],
                                 [*pairs, "--objective", "dpo", "--reference-model", tmp_path / "pairs"],
                                 [*pairs, "--objective", "dpo", "--reference-model", tmp_path / "data"]],
                                train_env["env"])
    assert refusals == [
        f"{tmp_path / 'pairs'} holds 3 preference pairs (chosen and rejected answers): train them with --objective "
        "dpo, ipo, simpo, orpo or kto",
        f"--objective simpo trains on preference pairs and {train_env['dataset']} holds none (DATA-HF reads records "
        "with chosen and rejected answers as pairs)",
        "ok",
        "--reference-model is for --objective dpo, ipo or kto, not orpo",
        f"--reference-model {other_vocab} has another vocabulary than local/tiny (vocab_size 512 vs 1024, or other "
        "tokens): a reference scores the policy's tokens, so it must share its tokenizer",
        "--reference-model local/tiny does not fit local/tiny-untied's architecture: its tensor lm_head.weight is "
        "missing, not of shape [1024, 64]; the reference is run in the policy's model, so it must be the same "
        "architecture",
        "ok",
        f"--reference-model {tmp_path / 'pairs'} is a dataset (as DATA-HF writes one), not a model: a dataset goes to "
        "--dataset-name",
        f"--reference-model {tmp_path / 'data'} is a directory without config.json"]
    assert not (tmp_path / "runs").exists()


def test_each_answer_of_packed_pairs_has_the_log_probability_the_model_gives_it_alone(tiny_models):
    """Pairs tokenized (conversational by the chat template, standard as TRL concatenates them), packed several to a
    block with positions restarting: each answer's summed log-probability from the packed forward equals the model's
    own forward of that sequence alone, and its target count is its trained tokens."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data import packing
    from pipeline.data.batches import make_batch
    from pipeline.data.pair_tokens import CHOSEN, REJECTED, count_pairs, pack_pairs, tokenize_pair
    from pipeline.model.head import Head
    from pipeline.objectives.preference import answers
    from pipeline.objectives.token_logps import token_logps

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["tied"], dtype=torch.float32).eval()
    pairs = [tokenize_pair(tokenizer, "", chat("What is 2+2?"), [chat("", "It is 4.")[1]],
                           [chat("", "Five, I think.")[1]], "26 Jul 2024", None),
             tokenize_pair(tokenizer, "The sky is", [], [{"role": "assistant", "content": " blue."}],
                           [{"role": "assistant", "content": " a green cheese."}], "26 Jul 2024", None),
             tokenize_pair(tokenizer, "", chat("Hi", "Hello!", "Name a colour."), [chat("", "Red.")[1]],
                           [chat("", "Seven.")[1]], "26 Jul 2024", None)]
    blocks, flags = pack_pairs(pairs, 256, tokenizer.eos_token_id)
    assert count_pairs(flags) == 3 and len(blocks) < 3  # several pairs share a block
    with torch.no_grad():
        logps, labels = token_logps(Head(model, False, 1), make_batch(blocks, flags, torch.device("cpu")))
        got = answers(torch.from_numpy(flags.astype(np.int64)), labels, logps)
        for kind, role in (("chosen", CHOSEN), ("rejected", REJECTED)):
            starts = ((flags & packing.START) > 0) & ((flags & role) > 0)
            order = [(b, a) for b in range(len(blocks)) for a in np.flatnonzero(starts[b])]
            assert len(order) == 3
            for k, (b, a) in enumerate(order):
                pair = next(p for p in pairs
                            if np.array_equal(getattr(p, kind), blocks[b, a:a + len(getattr(p, kind))]))
                ids = torch.from_numpy(getattr(pair, kind).astype(np.int64))[None]
                alone = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
                trained = torch.from_numpy(getattr(pair, f"{kind}_trained"))[1:]
                own = alone.gather(1, ids[0, 1:, None]).squeeze(1)[trained].sum()
                torch.testing.assert_close(got[kind][k], own, rtol=0, atol=1e-5)
                assert got[f"{kind}_len"][k] == int(trained.sum())


def test_a_pair_is_cut_from_the_left_but_never_below_its_prompt_floor():
    """Truncation keeps the end of the prompt in both answers alike; a pair whose prompt would keep fewer than
    MIN_PROMPT tokens (or a shorter prompt that would be cut at all) is dropped, not trained answers-first."""
    import numpy as np

    from pipeline.data.pair_tokens import MIN_PROMPT, TokenPair, fit_pair

    def pair(prompt: int, answer: int = 5) -> TokenPair:
        ids = np.arange(prompt + answer, dtype=np.uint32)
        mask = np.r_[np.zeros(prompt, bool), np.ones(answer, bool)]
        return TokenPair(ids, mask, ids.copy(), mask.copy(), prompt)

    assert fit_pair(pair(40), 90)[1] == "kept"
    cut, status = fit_pair(pair(40), 2 * (MIN_PROMPT + 5))  # exactly the floor left
    assert status == "truncated" and cut.prompt == MIN_PROMPT and cut.chosen[0] == 40 - MIN_PROMPT
    assert fit_pair(pair(40), 2 * (MIN_PROMPT + 5) - 2) == (None, "prompt_cut_too_far")
    assert fit_pair(pair(10), 28) == (None, "prompt_cut_too_far")  # a short prompt is not cut
    assert fit_pair(pair(40, answer=60), 100) == (None, "dropped_too_long")


def test_a_dataset_of_pairs_becomes_blocks_of_whole_pairs(tmp_path, tiny_models, caplog):
    """DATA-HF's pair rows through the token cache: every kept pair in one block, its chosen answer right before its
    rejected one, both starting with the same prompt; the counts in meta.json."""
    import numpy as np
    from transformers import AutoTokenizer

    from pipeline.data import packing, pair_tokens
    from pipeline.data.dataset import BlockSpec
    from pipeline.data.pair_tokens import CHOSEN, REJECTED
    from pipeline.data.token_cache import build_blocks

    rows = [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."}
            for i in range(40)]
    rows.append({"prompt": "x " * 400, "chosen": "a", "rejected": "b"})  # its prompt is cut from the left
    write_jsonl(tmp_path / "data" / "pairs.jsonl", rows)
    build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "ds", num_proc=1))
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    build_blocks(datasets.load_from_disk(str(tmp_path / "ds")), tokenizer,
                 BlockSpec(128, 0.1, 0, pairs=True, chat_date="26 Jul 2024"), 1, tmp_path / "cache")
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert meta["pairs"] == {"kept": 40, "truncated": 1, "dropped_too_long": 0, "malformed": 0,
                             "template_mismatch": 0, "template_error": 0, "tools_not_rendered": 0,
                             "reasoning_not_rendered": 0, "prompt_cut_too_far": 0}
    whole = len(tokenizer("x " * 400, add_special_tokens=False)["input_ids"]) + 1  # BOS
    cut = meta["pairs_prompt_tokens_cut"]
    assert 0 < cut < whole - pair_tokens.MIN_PROMPT
    from pipeline.train.blocks import log_cache_meta

    with caplog.at_level("INFO", logger="pipeline"):
        log_cache_meta(tmp_path / "cache")
    assert f"preference pairs: kept 40, truncated 1; {meta['pair_blocks']} blocks of them" in caplog.text
    assert (f"1 preference pairs were longer than a block and had their prompts cut from the left: {cut} prompt "
            f"tokens in all, {cut:.1f} each (a larger --seq-length keeps them whole)") in caplog.text
    assert meta["pairs_kept"] == 41 and meta["train_blocks"] + meta["val_blocks"] == meta["blocks"]
    seen = 0
    for split in ("train", "val"):
        ids, flags = np.load(tmp_path / "cache" / f"{split}.npy"), np.load(tmp_path / "cache" / f"{split}_flags.npy")
        for block, flag in zip(ids, flags, strict=True):
            starts = list(np.flatnonzero(flag & packing.START)) + [len(block)]
            kinds = [("chosen" if flag[a] & CHOSEN else "rejected" if flag[a] & REJECTED else "pad", a, b)
                     for a, b in zip(starts[:-1], starts[1:], strict=True)]
            for (k1, a1, b1), (k2, a2, b2) in zip(kinds[::2], kinds[1::2], strict=False):
                if k1 == "pad":
                    break
                assert (k1, k2) == ("chosen", "rejected")
                prompt = int(np.argmax(flag[a1:b1] & packing.TRAIN))
                assert np.array_equal(block[a1:a1 + prompt], block[a2:a2 + prompt])
                chosen, rejected = (tokenizer.decode(block[a:b][flag[a:b] & packing.TRAIN > 0]) for a, b in
                                    ((a1, b1), (a2, b2)))
                assert chosen != rejected and chosen.endswith(tokenizer.eos_token)
                seen += 1
    assert seen == 41


def reference_of(model, flags):
    """A reference reading each pair's (chosen, rejected) summed log-probabilities under model from the packed
    batch, as the objectives read the policy's (flags: the blocks' packing flags)."""
    import torch

    from pipeline.model.head import Head
    from pipeline.objectives.preference import answers
    from pipeline.objectives.token_logps import token_logps

    torch_flags = torch.from_numpy(flags.astype(np.int64))

    def reference(b):
        got = answers(torch_flags, *token_logps(Head(model, False, 1), b)[::-1])
        return got["chosen"], got["rejected"]
    return reference


def alone_logp(model, ids, trained):
    """The summed log-probability model gives the trained tokens of one sequence, run on its own."""
    import torch

    ids = torch.from_numpy(ids.astype(np.int64))[None]
    picked = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1)
    return picked[torch.from_numpy(trained)[1:]].sum()


def test_dpo_on_packed_pairs_has_the_gradient_of_dpo_on_each_pair_alone(tiny_models):
    """The objective over a packed block (policy and reference log-probabilities read per answer from the block)
    gives the loss and every parameter's gradient that DPO written out over each pair's sequences alone gives, and
    its TRL-named metrics; at a reference equal to the policy every pair's loss is ln 2."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data.batches import make_batch
    from pipeline.data.pair_tokens import pack_pairs, tokenize_pair
    from pipeline.model.head import Head
    from pipeline.objectives.preference import PreferenceObjective
    from pipeline.objectives.preference_losses import PreferenceSettings

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    policy = AutoModelForCausalLM.from_pretrained(tiny_models["tied"], dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_models["untied"], dtype=torch.float32).eval()
    pairs = [tokenize_pair(tokenizer, f"Sum {i} and {i}:", [], [{"role": "assistant", "content": f" {2 * i}"}],
                           [{"role": "assistant", "content": f" not {i}"}], "", None) for i in range(4)]
    blocks, flags = pack_pairs(pairs, 64, tokenizer.eos_token_id)
    batch = make_batch(blocks, flags, torch.device("cpu"))

    with torch.no_grad():
        same = PreferenceObjective(Head(policy, False, 1), PreferenceSettings("dpo", 0.1), reference_of(policy, flags))
        torch.testing.assert_close(same(batch, 4), torch.tensor(np.log(2), dtype=torch.float32))
    objective = PreferenceObjective(Head(policy, False, 1), PreferenceSettings("dpo", 0.1),
                                    reference_of(ref_model, flags))
    loss = objective(batch, 4)
    loss.backward()
    packed = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()

    terms = []
    for p in pairs:
        with torch.no_grad():
            ref = (alone_logp(ref_model, p.chosen, p.chosen_trained)
                   - alone_logp(ref_model, p.rejected, p.rejected_trained))
        margin = (alone_logp(policy, p.chosen, p.chosen_trained) - alone_logp(policy, p.rejected, p.rejected_trained)
                  - ref)
        terms.append(-torch.nn.functional.logsigmoid(0.1 * margin))
    alone = torch.stack(terms).sum() / 4
    alone.backward()
    torch.testing.assert_close(loss, alone, rtol=0, atol=1e-6)
    for name, param in policy.named_parameters():
        torch.testing.assert_close(packed[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)
    metrics = objective.read_metrics(reduce=False)
    assert set(metrics) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                            "logps/chosen", "logps/rejected"}
    assert metrics["rewards/margins"] == pytest.approx(metrics["rewards/chosen"] - metrics["rewards/rejected"])


def test_dpo_with_lora_and_simpo_train_on_two_ranks_and_dpo_resumes_bitwise(tmp_path, train_env):
    """DPO with LoRA starts at ln 2 (the adapters are zero, so the policy is its reference) on the base validation
    and the first step, its rewards part as it trains and a rerun from a checkpoint repeats the steps after it bit for
    bit; SimPO full fine-tuning trains without a reference."""
    import shutil

    from conftest import ROOT, events, torchrun

    arithmetic_pairs(tmp_path, 10)

    def run(name: str, *extra: object):
        proc = torchrun(2, ROOT / "fsdp1.py", "-e", name, "-d", tmp_path / "pairs", "-m", "local/tiny", "--save-dir",
                        tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--seq-length", 128,
                        "--max-steps", 6, "--log-freq", 1, "--ckpt-freq", 3, "--lr", 1e-2, *extra,
                        env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    done = run("dpo", "--adapter", "lora", "--objective", "dpo", "--strategy", "fsdp2")
    dpo = tmp_path / "runs" / "dpo"
    train, evals = events(dpo, "train"), events(dpo, "eval")
    assert train[0]["loss"] == pytest.approx(0.6931472, abs=1e-6) and evals[0]["loss"] == pytest.approx(0.6931472)
    assert train[-1]["loss"] < 0.69 and train[-1]["rewards/accuracies"] > 0.5
    assert train[-1]["rewards/margins"] == pytest.approx(train[-1]["rewards/chosen"] - train[-1]["rewards/rejected"])
    assert evals[-1]["loss"] < evals[0]["loss"] and "rewards/accuracies" in evals[-1]
    assert f"validation dpo loss 0.6931 -> {evals[-1]['loss']:.4f} over " in done.stdout + done.stderr
    # pipeline.evaluate: the adapter against its base with it off, as validated; the base alone, without a reference
    for model, reference in ((dpo / "adapter", "the base, adapter off"), ("local/tiny", None)):
        proc = run_evaluate(train_env["env"], model, "--config", dpo / "config.yaml", "--out", tmp_path / "e.json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads((tmp_path / "e.json").read_text())
        assert report["reference"] == reference and report["pairs"] > 0
        if reference:
            assert report["loss"] == pytest.approx(evals[-1]["loss"], abs=1e-5)
            assert report["preference_accuracy"] == evals[-1]["rewards/accuracies"]
        else:  # rewards beta times the model's own log-probabilities
            assert report["rewards/chosen"] == pytest.approx(0.1 * report["logps/chosen"], rel=1e-5)
            assert "reference  none (the model's own log-probabilities)" in proc.stdout
    shutil.copytree(dpo, tmp_path / "runs" / "again")
    run("again", "--adapter", "lora", "--objective", "dpo", "--strategy", "fsdp2", "--resume-from", "step-00000003")
    again = events(tmp_path / "runs" / "again", "train")
    assert [e["step"] for e in again] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
    assert [[e[k] for k in keys] for e in again[6:]] == [[e[k] for k in keys] for e in train[3:]]
    run("simpo", "--objective", "simpo", "--pref-beta", 2, "--lr", 1e-3)
    simpo = events(tmp_path / "runs" / "simpo", "eval")
    assert simpo[-1]["loss"] < simpo[0]["loss"]


def test_full_fine_tuning_dpo_computes_its_reference_once_and_resumes_bitwise(tmp_path, train_env):
    """DPO without adapters: the base's log-probabilities of every pair computed once before the first step, under
    the run's strategy (fsdp2's vocabulary-parallel head), so step 1 and the base validation are ln 2; a rerun from a
    checkpoint reuses them from beside the token cache and repeats the steps after it bit for bit, under another
    strategy too; the run ends with the preference accuracy base -> final, and pipeline.evaluate gives the same
    figures for the export and for the base against itself (ln 2, accuracy 0)."""
    import shutil

    from conftest import ROOT, events, torchrun

    arithmetic_pairs(tmp_path, 10)

    def run(name: str, *extra: object) -> str:
        proc = torchrun(2, ROOT / "fsdp1.py", "-e", name, "-d", tmp_path / "pairs", "-m", "local/tiny", "--save-dir",
                        tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--seq-length", 128,
                        "--max-steps", 6, "--log-freq", 1, "--ckpt-freq", 3, "--lr", 3e-3, "--objective", "dpo",
                        "--precision", "fp32", *extra, env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    said = run("full", "--strategy", "fsdp2")
    full = tmp_path / "runs" / "full"
    train, evals = events(full, "train"), events(full, "eval")
    assert "reference log-probabilities of 100 pairs under local/tiny: computed in " in said
    assert train[0]["loss"] == pytest.approx(0.6931472, abs=1e-6) and evals[0]["loss"] == pytest.approx(0.6931472)
    assert train[0]["rewards/chosen"] == pytest.approx(0, abs=1e-6) and evals[0]["rewards/margins"] == pytest.approx(0)
    assert train[-1]["loss"] < 0.69 and evals[-1]["loss"] < evals[0]["loss"]
    final = evals[-1]
    assert re.search(rf"validation dpo loss 0\.6931 -> {final['loss']:.4f} over \d+ pairs; preference accuracy "
                     rf"0\.000 -> {final['rewards/accuracies']:.3f}, mean margin 0\.0000 -> "
                     rf"{final['rewards/margins']:.4f}, base -> step 6", said), said[-2000:]
    # pipeline.evaluate on the same pairs: the run's final validation, and the base against itself
    reports = []
    for model, loss, margin in ((full / "hf", final["loss"], final["rewards/margins"]), ("local/tiny", 0.6931472, 0)):
        proc = run_evaluate(train_env["env"], model, "--config", full / "config.yaml", "--reference", "local/tiny",
                            "--out", tmp_path / "e.json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads((tmp_path / "e.json").read_text())
        assert (report["objective"], report["reference"], report["split"]) == ("dpo", "local/tiny", "val")
        # (the base against itself: margins of float noise, its reference computed by 2 ranks' vocabulary-parallel
        # head and the model here by its own, so its accuracy is that noise's sign, not asserted)
        assert report["loss"] == pytest.approx(loss, abs=1e-5) and report["mean_margin"] == pytest.approx(margin,
                                                                                                          abs=1e-5)
        assert "under local/tiny: reused" in proc.stderr
        assert f"dpo loss   {report['loss']:.5f}\naccuracy   {report['preference_accuracy']:.4f}\n" in proc.stdout
        reports.append(report)
    assert reports[0]["preference_accuracy"] == final["rewards/accuracies"]
    for strategy in ("fsdp2", "ddp"):
        shutil.copytree(full, tmp_path / "runs" / strategy, ignore=shutil.ignore_patterns("hf"))
        said = run(strategy, "--strategy", strategy, "--resume-from", "step-00000003")
        assert "reference log-probabilities of 100 pairs under local/tiny: reused " in said
        again = events(tmp_path / "runs" / strategy, "train")
        assert [e["step"] for e in again] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
        keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
        repeated = [e[k] for e in again[6:] for k in keys]
        if strategy == "fsdp2":
            assert repeated == [e[k] for e in train[3:] for k in keys]
        else:  # another strategy: the same reference, the model's own head instead of the vocabulary-parallel one
            assert repeated == pytest.approx([e[k] for e in train[3:] for k in keys], rel=1e-4, abs=1e-5)


def test_the_reference_pass_resumes_from_its_saved_chunks(tmp_path, tiny_models, group_of_one, monkeypatch):
    """The pass before full fine-tuning's first step saves every chunk as it finishes: rerun after a kill, it reads
    the chunks done (here one holding marked values, to see it read) and computes only the rest, which equal an
    uninterrupted pass's; each pair's values are the model's own log-probabilities of its answers."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data.batches import make_batch
    from pipeline.data.pair_tokens import pack_pairs, tokenize_pair
    from pipeline.model.head import Head
    from pipeline.objectives import reference_pass
    from pipeline.objectives.preference import answers
    from pipeline.objectives.token_logps import token_logps

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["tied"], dtype=torch.float32).eval()
    pairs = [tokenize_pair(tokenizer, f"Sum {i} and {i}:", [], [{"role": "assistant", "content": f" {2 * i}"}],
                           [{"role": "assistant", "content": f" not {i * 37}"}], "", None) for i in range(12)]
    blocks, flags = pack_pairs(pairs, 48, tokenizer.eos_token_id)
    assert len(blocks) >= 4
    monkeypatch.setattr(reference_pass, "CHUNK_BLOCKS", 2)
    head = Head(model, False, 1)
    whole, read, chunks = reference_pass.reference_pass(head, blocks, flags, 3, group_of_one, tmp_path / "a")
    assert (read, chunks) == (0, -(-len(blocks) // 2))
    with torch.no_grad():
        got = answers(torch.from_numpy(flags.astype(np.int64)),
                      *token_logps(head, make_batch(blocks, flags, torch.device("cpu")))[::-1])
    listed = whole.reshape(-1, 2)[~np.isnan(whole.reshape(-1, 2)[:, 0])]
    np.testing.assert_allclose(listed, torch.stack([got["chosen"], got["rejected"]], 1).numpy(), rtol=1e-5)
    assert len(listed) == 12
    saved = sorted((tmp_path / "a").iterdir())
    assert [p.name for p in saved] == [f"chunk-{i:05d}.npy" for i in range(len(saved))]
    marked = np.where(np.isnan(whole[:2]), np.nan, 7.0).astype(np.float32)
    np.save(saved[0], marked)
    for later in saved[1:]:
        later.unlink()
    resumed, read, _ = reference_pass.reference_pass(head, blocks, flags, 3, group_of_one, tmp_path / "a")
    assert read == 1
    np.testing.assert_array_equal(resumed[:2], marked)
    np.testing.assert_array_equal(resumed[2:], whole[2:])


@pytest.mark.slow
def test_answer_logps_equal_each_familys_own_forward_packed_and_unpacked_under_fsdp2_and_ddp(tmp_path):
    """Three families (Llama, Qwen3's q/k norms and head size, Mistral's sliding window; Gemma's scaled embedding
    takes no vocabulary-parallel head), each
    answer's summed log-probability as training computes it (pipeline/objectives/preference.sequence_logps) against
    transformers' forward of that sequence alone: three pairs packed in one block and one pair per block, under fsdp2
    with the vocabulary-parallel head (every rank's pairs) and ddp (the plain head), 2 real ranks, fp32."""
    from conftest import ROOT, torchrun

    from pipeline.prep.tiny import build_family

    families = {f: build_family(tmp_path / f, f) for f in ("llama", "qwen3", "mistral")}
    out = tmp_path / "logps.json"
    proc = torchrun(2, ROOT / "tests" / "helpers" / "pair_logps.py", out, *(f"{f}={d}" for f, d in families.items()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {(r["family"], r["strategy"], r["layout"]) for r in results} == {
        (f, s, layout) for f in families for s in ("fsdp2", "ddp") for layout in ("packed", "unpacked")}
    for r in results:
        vocab_parallel = r["strategy"] == "fsdp2"
        assert r["vocab_parallel"] is vocab_parallel, r
        assert r["rows"] == (1 if r["layout"] == "packed" else 3), r
        assert r["matched"] == sorted([0, 1, 2] * (2 if vocab_parallel else 1)), r  # each pair once per rank's rows
        assert r["worst"] < 1e-5, r


@pytest.mark.slow
def test_a_run_killed_during_its_reference_pass_resumes_the_pass_from_its_saved_chunks(tmp_path, train_env):
    """Full-fine-tuning DPO SIGKILLed (torchrun and its workers) once the reference pass has saved its first chunk of
    256 blocks and before it finished, then stopped by SIGTERM within its third chunk: the same command again reads the
    chunks done, computes the rest, and trains from ln 2 with every reward 0 at step 1 (the reference equal to the
    policy: a wrong resumed value would show)."""
    import os
    import signal
    import subprocess
    import time

    from conftest import ROOT, events, kill_tree, start_torchrun, torchrun

    from pipeline.prep.tiny import build_tiny

    # about 1,700 pairs, 3 per block of 64 tokens: 3 chunks, the kill leaving two to do; a model wide enough that a
    # chunk takes a second or two
    rows = [{"prompt": f"Add {a} and {b}.", "chosen": f" {a + b}", "rejected": f" {a * b + 1}"}
            for a in range(42) for b in range(42)]
    write_jsonl(tmp_path / "data" / "pairs.jsonl", rows)
    build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "pairs", num_proc=1))
    model = build_tiny(tmp_path / "model", layers=4, hidden=256)
    cmd = ["-e", "dpo", "-d", str(tmp_path / "pairs"), "-m", str(model), "--save-dir",
           str(tmp_path / "runs"), "--config", str(ROOT / "configs" / "demo.yaml"), "--seq-length", "64",
           "--max-steps", "2", "--log-freq", "1", "--objective", "dpo", "--precision", "fp32", "--val-fraction", "0"]
    env = train_env["env"]
    with open(tmp_path / "killed.log", "w") as log:
        proc = start_torchrun(2, ROOT / "fsdp1.py", *cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        references = tmp_path / "runs" / "token_cache"
        while proc.poll() is None and not list(references.glob("*/reference/*.partial/train/chunk-00000.npy")):
            time.sleep(0.02)
        kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    assert not list(references.glob("*/reference/*/meta.json")), "the pass finished before the kill"
    # SIGTERM (a scheduler's preemption) while the rerun computes its second chunk: every rank stops before its next
    # round of forwards, in one line, instead of finishing the chunk, the pass (and the step-0 validation) first
    with open(tmp_path / "stopped.log", "w") as log:
        proc = start_torchrun(2, ROOT / "fsdp1.py", *cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None and not list(references.glob("*/reference/*.partial/train/chunk-00001.npy")):
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher forwards it to the workers
        proc.wait(timeout=120)
    stopped = (tmp_path / "stopped.log").read_text()
    done = re.search(r"stopped by signal during the reference pass, with ([23]) of 3 chunks saved \(kept\); rerun "
                     r"the same command to resume", stopped)
    assert done and not list(references.glob("*/reference/*/meta.json")), stopped[-3000:]
    assert not events(tmp_path / "runs" / "dpo", "train")
    again = torchrun(2, ROOT / "fsdp1.py", *cmd, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert re.search(r"reference log-probabilities of \d+ pairs under \S+: computed in [0-9.]+ s, "
                     rf"{done.group(1)} of 3 chunks read from an interrupted pass", said), said[-3000:]
    first = events(tmp_path / "runs" / "dpo", "train")[0]
    assert first["loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert first["rewards/chosen"] == pytest.approx(0, abs=1e-5) and first["rewards/rejected"] == pytest.approx(
        0, abs=1e-5)
    assert not list(references.glob("*/reference/*.partial"))


@pytest.mark.slow
def test_dpo_trains_alike_under_fsdp1_and_the_hand_written_zero3(tmp_path, train_env):
    """The objective is strategy-blind: full-fine-tuning DPO under fsdp1 and manual starts at ln 2 with zero rewards
    and takes the same steps under both (2 ranks, fp32)."""
    from conftest import ROOT, events, torchrun

    arithmetic_pairs(tmp_path, 8)
    runs = {}
    for strategy in ("fsdp1", "manual"):
        proc = torchrun(2, ROOT / "fsdp1.py", "-e", strategy, "-d", tmp_path / "pairs", "-m", "local/tiny",
                        "--save-dir", tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--seq-length",
                        128, "--max-steps", 3, "--log-freq", 1, "--ckpt-freq", 0, "--eval-freq", 0, "--lr", 3e-3,
                        "--objective", "dpo", "--precision", "fp32", "--strategy", strategy, env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[strategy] = events(tmp_path / "runs" / strategy, "train")
    for train in runs.values():
        assert train[0]["loss"] == pytest.approx(0.6931472, abs=1e-6) and train[0]["rewards/margins"] == pytest.approx(
            0, abs=1e-5)
        assert train[-1]["loss"] < 0.69
    keys = ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen")
    assert [e[k] for e in runs["manual"] for k in keys] == pytest.approx(
        [e[k] for e in runs["fsdp1"] for k in keys], rel=1e-4, abs=1e-5)


def test_a_cache_that_kept_nothing_gets_the_fix_for_its_cause(tmp_path, tiny_models):
    """No block at all: pairs whose answers alone are longer than a block want a larger --seq-length (not the
    smaller one the generic advice names), conversations whose tool calls the template leaves out a template that
    renders them. Real caches of each, through the trainer's own check."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.config_merge import resolve
    from pipeline.data.dataset import BlockSpec
    from pipeline.data.token_cache import build_blocks, open_blocks
    from pipeline.distributed.runtime import Dist
    from pipeline.train.blocks import check_one_batch

    long = [{"prompt": f"Question {i}?", "chosen": "yes " * 80, "rejected": "no " * 80} for i in range(6)]
    call = {"type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}
    tools = [{"messages": [{"role": "user", "content": f"find {i}"},
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "content": "found", "tool_call_id": "c"},
                           {"role": "assistant", "content": "done"}]} for i in range(6)]
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    one = Dist(0, 1, 0, 1, torch.device("cpu"))
    for name, rows, pairs, seq, advice in (
            ("pairs", long, True, 64, "none of its 6 pairs was kept: 6 were longer than a block even with the prompt "
                                      "cut; use a larger --seq-length (now 64)"),
            ("agents", tools, False, 512, "none of its 6 conversations was kept: 6 were left without their tool calls "
                                          "or schemas by the chat template; use a template that renders tools "
                                          "(--chat-template)")):
        write_jsonl(tmp_path / name / "rows.jsonl", rows)
        build_dataset(CorpusConfig(tmp_path / name, tmp_path / f"{name}-ds", num_proc=1))
        spec = BlockSpec(seq, 0.1, 0, pairs=pairs, chat_date="26 Jul 2024")
        build_blocks(datasets.load_from_disk(str(tmp_path / f"{name}-ds")), tokenizer, spec, 1, tmp_path / name / "c")
        cfg = resolve(["-e", "x", "-m", "org/model", "-d", str(tmp_path / f"{name}-ds"), "--seq-length", str(seq)])
        with pytest.raises(UserError) as caught:
            check_one_batch(open_blocks(tmp_path / name / "c"), cfg, one)
        assert str(caught.value) == (f"the dataset gives 0 training blocks of {seq} tokens, fewer than one global "
                                     f"batch (1 processes x batch 1 x grad accum 1 = 1); {advice}")
