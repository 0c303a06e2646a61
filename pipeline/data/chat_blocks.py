"""Conversation and preference rows to packed blocks for the token cache: each row rendered and masked
(pipeline/data/chat_tokens.py, pair_tokens.py) in datasets.map workers, fitted, counted by status, and packed whole."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
from jinja2.exceptions import TemplateError

from pipeline.data import chat_tokens, packing, pair_tokens
from pipeline.data.chat_render import NotRendered
from pipeline.data.dataset import BlockSpec
from pipeline.data.mapped import datasets_bars, map_kwargs, ragged
from pipeline.errors import naming
from pipeline.prep.conversations import BadConversation


def _tokenize_chats(batch: dict, tokenizer, spec: BlockSpec) -> dict:
    """Each conversation -> its samples (one, or one per run of turns when its template rewrites earlier turns:
    chat_tokens.tokenize_turns), each with its ids, trained mask (uint8) and status (an index into
    chat_tokens.STATUS), fitted into one block; the first sample of a split conversation carries how many samples
    it became, the tokens of one whole rendering of it and its samples' tokens beyond those, before fitting (split,
    whole, extra; 0 otherwise)."""
    out: dict[str, list] = {"input_ids": [], "trained": [], "status": [], "split": [], "whole": [], "extra": []}
    keep_as_text = None if spec.special_tokens_in_data else chat_tokens.special_texts(tokenizer)
    tools = batch.get("tools") or [""] * len(batch["messages"])  # datasets written before tools had no column
    for messages, schemas in zip(batch["messages"], tools, strict=True):
        whole = extra = 0
        try:
            turns = chat_tokens.tokenize_turns(tokenizer, messages, spec.chat_date, spec.train_on, keep_as_text,
                                               capacity=spec.seq_length, tools=schemas,
                                               train_reasoning=spec.train_reasoning)
            fitted = [chat_tokens.fit(r, spec.seq_length) if r is not None else (None, "dropped_too_long")
                      for r in turns.samples]
            whole, extra = turns.whole, turns.extra
        except BadConversation:
            fitted = [(None, "malformed")]
        except chat_tokens.TemplateMismatch:
            fitted = [(None, "template_mismatch")]
        except NotRendered as exc:
            fitted = [(None, str(exc))]
        except TemplateError:
            fitted = [(None, "template_error")]
        for part, (sample, status) in enumerate(fitted):
            out["input_ids"].append(sample.ids if sample else np.zeros(0, np.uint32))
            out["trained"].append(sample.trained.astype(np.uint8) if sample else np.zeros(0, np.uint8))
            out["status"].append(chat_tokens.STATUS.index(status))
            out["split"].append(len(fitted) if part == 0 and whole else 0)
            out["whole"].append(whole if part == 0 else 0)
            out["extra"].append(extra if part == 0 else 0)
    return out


def _tokenize_pairs(batch: dict, tokenizer, spec: BlockSpec) -> dict:
    """Each preference row -> its two answers' ids and trained masks and its status (pair_tokens.STATUS), fitted
    into one block."""
    keep_as_text = None if spec.special_tokens_in_data else chat_tokens.special_texts(tokenizer)
    return pair_tokens.tokenize_pairs_batch(batch, tokenizer, spec.chat_date, spec.seq_length, keep_as_text)


def _tokenize_kto(batch: dict, indices: list[int], answers, tokenizer, spec: BlockSpec) -> dict:
    """Each preference row -> its KTO examples (pair_tokens.tokenize_kto_batch), each fitted into a block."""
    keep_as_text = None if spec.special_tokens_in_data else chat_tokens.special_texts(tokenizer)
    return pair_tokens.tokenize_kto_batch(batch, indices, answers, tokenizer, spec.chat_date, spec.seq_length,
                                          keep_as_text)


def pair_blocks(ds, tokenizer, spec: BlockSpec, num_proc: int, work: Path
                ) -> tuple[np.ndarray, np.ndarray, dict, int]:
    """Preference rows tokenized, fitted and packed whole into blocks, each chosen answer before its rejected one
    (under KTO each example's completion before its KL sequence); what happened to them, by status; the prompt tokens
    truncation cut, over every kept pair."""
    with datasets_bars(sys.stderr.isatty()), naming(work):
        if spec.kto:
            tokenized = ds.map(_tokenize_kto, remove_columns=ds.column_names, desc="tokenizing KTO examples",
                               with_indices=True, fn_kwargs={"answers": ds.select_columns(["chosen", "rejected"]),
                                                             "tokenizer": tokenizer, "spec": spec},
                               **map_kwargs(work, "kto", num_proc, len(ds)))
        else:
            tokenized = ds.map(_tokenize_pairs, remove_columns=ds.column_names, desc="tokenizing preference pairs",
                               fn_kwargs={"tokenizer": tokenizer, "spec": spec},
                               **map_kwargs(work, "pairs", num_proc, len(ds)))
    codes = np.asarray(tokenized.data.column("status").to_numpy())
    status = Counter(pair_tokens.STATUS[c] for c in codes.tolist())
    kept = np.flatnonzero(codes <= pair_tokens.STATUS.index("truncated"))
    columns = {name: ragged(tokenized, name, np.uint32 if name in ("chosen", "rejected") else np.uint8)
               for name in ("chosen", "chosen_trained", "rejected", "rejected_trained")}
    pairs = [pair_tokens.TokenPair(columns["chosen"][i], columns["chosen_trained"][i].astype(bool),
                                   columns["rejected"][i], columns["rejected_trained"][i].astype(bool), 0)
             for i in kept]
    undesirable = (np.asarray(tokenized.data.column("desirable").to_numpy())[kept] == 0) if spec.kto else None
    blocks, flags = pair_tokens.pack_pairs(pairs, spec.seq_length, tokenizer.eos_token_id, undesirable) if pairs else (
        np.zeros((0, spec.seq_length), np.uint32), np.zeros((0, spec.seq_length), np.uint8))
    cut = int(np.asarray(tokenized.data.column("cut").to_numpy())[kept].sum())
    return blocks, flags, {s: status.get(s, 0) for s in pair_tokens.STATUS}, cut


def chat_blocks(ds, tokenizer, spec: BlockSpec, num_proc: int, work: Path
                 ) -> tuple[np.ndarray, np.ndarray, dict, dict]:
    """Conversation rows rendered, masked and packed whole into blocks; what happened to their samples, by status;
    what rendering turn by turn cost (_turn_by_turn)."""
    with datasets_bars(sys.stderr.isatty()), naming(work):
        tokenized = ds.map(_tokenize_chats, remove_columns=ds.column_names, desc="tokenizing conversations",
                           fn_kwargs={"tokenizer": tokenizer, "spec": spec},
                           **map_kwargs(work, "chats", num_proc, len(ds)))
    codes = np.asarray(tokenized.data.column("status").to_numpy())
    status = Counter(chat_tokens.STATUS[c] for c in codes.tolist())
    kept = codes <= chat_tokens.STATUS.index("truncated")
    ids = [x for x, k in zip(ragged(tokenized, "input_ids", np.uint32), kept, strict=True) if k]
    trained = [x.astype(bool) for x, k in zip(ragged(tokenized, "trained", np.uint8), kept, strict=True) if k]
    blocks, flags = packing.pack(ids, trained, spec.seq_length, tokenizer.eos_token_id)
    return blocks, flags, {s: status.get(s, 0) for s in chat_tokens.STATUS}, _turn_by_turn(tokenized)


def _turn_by_turn(tokenized) -> dict:
    """The conversations split into samples, the samples, the tokens of one whole rendering of each and the tokens
    their samples hold beyond those (before fitting into blocks: what rendering turn by turn costs)."""
    split, whole, extra = (np.asarray(tokenized.data.column(name).to_numpy()) for name in ("split", "whole", "extra"))
    return {"conversations": int((split > 0).sum()), "samples": int(split.sum()), "whole_tokens": int(whole.sum()),
            "extra_tokens": int(extra.sum())}
