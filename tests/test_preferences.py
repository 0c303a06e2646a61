"""Preference pairs: read by DATA-HF in TRL's forms (never as text), bad ones skipped by reason, and never trained
as text or conversations."""

import json
from pathlib import Path

import datasets
import pytest

from pipeline.errors import UserError
from pipeline.prep.corpus import CorpusConfig, build_dataset


def chat(*turns: str) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def write_jsonl(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


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
    got = [(r["text"], r["messages"], r["chosen"], r["rejected"]) for r in ds]
    assert got == [
        ("The sky is", [], chat("", " blue.")[1:], chat("", " green.")[1:]),
        ("", chat("Hi?"), chat("", "Hello!")[1:], chat("", "Go away.")[1:]),
        ("", chat("2+2?"), chat("", "4")[1:], chat("", "5")[1:]),
    ]
    prefs = report["preferences"]
    assert (prefs["rows"], prefs["by_form"]) == (3, {"conversational": 1, "implicit": 1, "standard": 1})
    assert {k: v["where"] for k, v in prefs["skipped"].items()} == {
        "empty_answer": ["pairs.jsonl:line 5"], "missing_field": ["pairs.jsonl:line 6"],
        "not_alternating": ["pairs.jsonl:line 9"], "prompt_not_shared": ["pairs.jsonl:line 8"],
        "same_answers": ["pairs.jsonl:line 4"], "unpaired_preference": ["pairs.jsonl:line 7"]}
    # our own to_json reads back to the same pairs
    ds.to_json(str(tmp_path / "again" / "rows.jsonl"))
    build_dataset(CorpusConfig(tmp_path / "again", tmp_path / "out2", num_proc=1))
    again = datasets.load_from_disk(str(tmp_path / "out2"))
    assert [(r["text"], r["messages"], r["chosen"], r["rejected"]) for r in again] == got


def test_a_folder_mixing_pairs_with_text_is_one_line(tmp_path):
    write_jsonl(tmp_path / "data" / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    (tmp_path / "data" / "notes.txt").write_text("a document\n")
    with pytest.raises(UserError, match=r"mixes 1 preference pairs with 1 text or conversation rows: a run trains "
                                        r"on one kind"):
        build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "out", num_proc=1))
    assert not (tmp_path / "out").exists()


def test_training_on_pairs_is_refused_in_one_line_until_an_objective_reads_them(tmp_path, train_env):
    """An SFT run on a pairs dataset would train the prompts alone: fsdp1.py refuses it before anything is built."""
    from conftest import ROOT, preflight_errors

    write_jsonl(tmp_path / "data" / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3)
    build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "pairs", num_proc=1))
    (refusal,) = preflight_errors([["-e", "r", "-d", tmp_path / "pairs", "-m", "local/tiny", "--save-dir",
                                    tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml"]], train_env["env"])
    assert refusal == (f"{tmp_path / 'pairs'} holds 3 preference pairs (chosen and rejected answers); fsdp1.py trains "
                       "text and conversations, and has no preference objective (DPO) yet")
    assert not (tmp_path / "runs").exists()
