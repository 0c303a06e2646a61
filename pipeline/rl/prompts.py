"""GRPO's data: the prompt rows of a DATA-HF prompts dataset, tokenized as the model will continue them (a standard
prompt's text as it is, a conversational one through the chat template with the assistant's header, or ending in the
assistant's own text when it ends with that turn), each at most
--max-prompt-length tokens, split into train and validation as blocks are, and served to the trainer as blocks.

A prompts dataset is small beside a corpus (a prompt per row, thousands of rows), so every rank tokenizes it at
start in memory, deterministically, instead of through the token cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.config_grpo import GRPOConfig
from pipeline.data.batches import Batch
from pipeline.data.chat_render import render, template_messages
from pipeline.data.token_cache import split_blocks
from pipeline.errors import UserError


@dataclass(frozen=True)
class PromptRow:
    """What a reward function is given of a prompt: the prompt (text or messages) and the row's other columns."""

    prompt: str | list[dict]
    columns: dict


@dataclass
class PromptPart:
    """A split of the prompts, as the sampler and the validation pass meet a split of blocks (batches.Part)."""

    blocks: np.ndarray
    """(n, P) token ids, left-padded: a row's prompt ends at the last column, where generation continues."""
    mask: np.ndarray
    """(n, P) 1 at a prompt's tokens, 0 at its padding."""
    rows: np.ndarray
    """(n,) each prompt's index in PromptBlocks.prompts."""
    flags = None

    def flags_at(self, idx: np.ndarray) -> None:
        return None

    def batch(self, idx: np.ndarray, device: torch.device, valid_rows: int | None = None) -> Batch:
        """The prompts at idx; rows from valid_rows on are padding (their `rows` entry -1)."""
        rows = self.rows[idx].astype(np.int64)
        if valid_rows is not None:
            rows[valid_rows:] = -1
        # the batch's own width: the columns its longest prompt needs (blocks are as wide as the longest of all)
        first = int(np.argmax(self.mask[idx].any(axis=0)))
        ids = torch.from_numpy(np.ascontiguousarray(self.blocks[idx][:, first:], dtype=np.int64)).to(device)
        mask = torch.from_numpy(np.ascontiguousarray(self.mask[idx][:, first:], dtype=np.int64)).to(device)
        return Batch(ids, torch.full_like(ids, -100), None, mask, rows=rows)


@dataclass
class PromptBlocks:
    """The run's prompts: tokenized, split, and the rows the rewards read."""

    train_part: PromptPart
    val_part: PromptPart
    prompts: list[PromptRow]
    counts: dict = field(default_factory=dict)
    """kept, cut (the first tokens dropped to fit), dropped (too long, under --long-prompts drop), prompt_tokens_cut,
    prefilled (ending with the assistant's text, continued)."""
    path = None
    """No token cache holds them (they are tokenized in memory)."""

    @property
    def train(self) -> np.ndarray:
        return self.train_part.blocks

    @property
    def val(self) -> np.ndarray:
        return self.val_part.blocks

    def part(self, split: str) -> PromptPart:
        return self.train_part if split == "train" else self.val_part

    def val_parts(self) -> list[tuple[str, PromptPart]]:
        return [("", self.val_part)]


def prompt_rows_of(ds) -> list[PromptRow]:
    """Every prompt row of a DATA-HF prompts dataset (non-empty `columns`): its prompt and its columns."""
    out = []
    for text, messages, columns, tools in zip(ds["text"], ds["messages"], ds["columns"],
                                              ds["tools"] if "tools" in ds.column_names else [""] * len(ds),
                                              strict=True):
        if columns:
            prompt = template_messages(messages, conversation=False) if messages else text
            row = json.loads(columns)
            out.append(PromptRow(prompt, {**row, **({"tools": json.loads(tools)} if tools else {})}))
    return out


def prompt_columns(ds) -> tuple[dict[str, int], int]:
    """The columns of a DATA-HF prompts dataset's rows beside the prompt ({name: rows holding a value}) and its
    prompt rows: what a reward function is passed."""
    held: dict[str, int] = {}
    rows = 0
    for columns in ds["columns"]:
        if columns:
            rows += 1
            for name, value in json.loads(columns).items():
                held[name] = held.get(name, 0) + (value is not None)
    return held, rows


def prefilled(row: PromptRow) -> bool:
    """A conversational prompt ending with the assistant's text: the model continues that turn (TRL's
    continue_final_message), where any other prompt gets the assistant's header to answer after."""
    return not isinstance(row.prompt, str) and row.prompt[-1]["role"] == "assistant"


def tokenized(tokenizer, row: PromptRow, chat_date: str, tools: list[dict] | None = None) -> list[int]:
    """The prompt's ids: a text as it is; a conversation rendered by the chat template with the run's tools (--tools'
    schemas), else the row's own."""
    if isinstance(row.prompt, str):
        return tokenizer(row.prompt, add_special_tokens=False)["input_ids"]
    go_on = prefilled(row)
    text = render(tokenizer, row.prompt, chat_date, tools=tools or row.columns.get("tools"),
                  add_generation_prompt=not go_on, continue_final_message=go_on)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def with_observation(row: PromptRow, observation: str) -> PromptRow:
    """The row with an environment's observation (reset()'s) appended to its prompt's last message, as TRL appends
    it (a text prompt: to its text)."""
    if isinstance(row.prompt, str):
        return PromptRow(row.prompt + observation, row.columns)
    last = row.prompt[-1]
    return PromptRow([*row.prompt[:-1], {**last, "content": (last.get("content") or "") + observation}], row.columns)


def observed_ids(tokenizer, row: PromptRow, chat_date: str, tools: list[dict] | None, limit: int,
                 cut: bool = False) -> list[int]:
    """The ids of a prompt an environment's observation lengthened, at most --max-prompt-length (the run's memory
    plan holds no longer prompt): cut from the left where cut (--long-prompts cut, no tools' schemas to lose), else
    past it is one line (cutting would cut the tools the template puts first; a row cannot be dropped mid-batch)."""
    ids = tokenized(tokenizer, row, chat_date, tools)
    if len(ids) > limit and cut:
        return ids[-limit:]
    if len(ids) > limit:
        raise UserError(f"--environment: the observation reset() returned makes the prompt {len(ids):,} tokens, "
                        f"above --max-prompt-length {limit} (prompt {str(row.prompt)[-80:]!r}); raise "
                        "--max-prompt-length, or return a shorter observation")
    return ids


def build_prompt_blocks(ds, tokenizer, g: GRPOConfig, chat_date: str, val_fraction: float, seed: int,
                        pad_id: int, tools: list[dict] | None = None) -> PromptBlocks:
    """The prompts of ds as blocks: each cut from the left to --max-prompt-length (or dropped, --long-prompts drop),
    left-padded to the longest kept, split by the seeded permutation blocks use. tools: --tools' schemas, which every
    conversation is rendered with."""
    prompts = prompt_rows_of(ds)
    if any(not isinstance(p.prompt, str) for p in prompts) and not tokenizer.chat_template:
        raise UserError("the dataset holds conversational prompts but the model has no chat template to render them; "
                        "use its Instruct version, or pass --chat-template FILE.jinja")
    kept, index = [], []
    counts = dict.fromkeys(("kept", "cut", "dropped", "prompt_tokens_cut", "prefilled", "empty"), 0)
    for i, row in enumerate(prompts):
        ids = tokenized(tokenizer, row, chat_date, tools)
        if not ids:  # nothing to condition on (a text prompt of no token): skipped by reason, counted
            counts["empty"] += 1
            continue
        if len(ids) > g.max_prompt_length:
            if g.long_prompts == "drop":
                counts["dropped"] += 1
                continue
            counts["cut"] += 1
            counts["prompt_tokens_cut"] += len(ids) - g.max_prompt_length
            ids = ids[-g.max_prompt_length:]
        kept.append(ids)
        index.append(i)
        counts["prefilled"] += prefilled(row)  # of the prompts kept: the ones the run continues
    counts["kept"] = len(kept)
    if tools and counts["cut"]:  # the template renders the tools first: a cut from the left takes them away
        raise UserError(f"{counts['cut']:,} prompts with the tools' schemas (--tools, --environment) are longer than "
                        f"--max-prompt-length {g.max_prompt_length}, and cutting them from the left would cut the "
                        "tools the template puts first; raise --max-prompt-length, or pass --long-prompts drop")
    if not kept:
        raise UserError(f"no prompt is left of {len(prompts)}: {counts['dropped']} longer than --max-prompt-length "
                        f"{g.max_prompt_length} (raise it or use --long-prompts cut), {counts['empty']} empty")
    width = max(len(ids) for ids in kept)
    blocks = np.full((len(kept), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(kept), width), dtype=np.int8)
    for r, ids in enumerate(kept):
        blocks[r, width - len(ids):], mask[r, width - len(ids):] = ids, 1
    rows = np.asarray(index, dtype=np.int64)
    train_idx, val_idx = split_blocks(len(kept), val_fraction, seed)
    return PromptBlocks(PromptPart(blocks[train_idx], mask[train_idx], rows[train_idx]),
                        PromptPart(blocks[val_idx], mask[val_idx], rows[val_idx]), prompts, counts)
