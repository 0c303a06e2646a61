"""Samples while training: prompts from a JSONL file, tokenized as training tokenizes (text rows without special
tokens added; conversations through the chat template, ending in the assistant's header), completed greedily by the
model as the strategy distributed it.

Every rank decodes every prompt together: under FSDP each forward all-gathers the parameters, and with the
vocabulary-parallel head each rank holds only its rows of the logits, so a rank-0-only generate would hang. No
KV cache: each new token costs one forward over the sequence so far (prompts are short, samples few).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.data.chat_render import render
from pipeline.distributed.runtime import Dist
from pipeline.errors import UserError
from pipeline.model.head import Head
from pipeline.model.modeling import trunk
from pipeline.model.vocab_parallel import argmax_token, vocab_row_offset
from pipeline.strategies.base import Strategy


@dataclass(frozen=True)
class Prompt:
    shown: str
    """The prompt as logged: the text, or the conversation's last message."""
    ids: list[int]


def read_prompts(path: Path, tokenizer, chat_date: str, seq_length: int, max_tokens: int) -> list[Prompt]:
    """The prompts of a JSONL file, one object per line: {"prompt": TEXT} or {"messages": [{"role", "content"}, ...]},
    each with room for max_tokens more in a block of seq_length (the model's positions). Any other line, or a prompt
    too long, is one error naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--sample-prompts {path} cannot be read: {exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            prompts.append(_prompt(json_line(path, number, line), tokenizer, chat_date, f"{path}:{number}"))
    if not prompts:
        raise UserError(f"--sample-prompts {path} holds no prompt")
    if too_long := [p for p in prompts if len(p.ids) + max_tokens > seq_length]:
        raise UserError(f"--sample-prompts {path}: the prompt {too_long[0].shown[:60]!r} is {len(too_long[0].ids)} "
                        f"tokens, and with --sample-max-tokens {max_tokens} more it would not fit --seq-length "
                        f"{seq_length}; shorten it or lower --sample-max-tokens")
    return prompts


def json_line(path: Path, number: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except ValueError:
        row = None
    if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str) or _is_chat(row.get("messages"))):
        raise UserError(f"--sample-prompts {path}:{number} is not a JSON object with a \"prompt\" string or a "
                        "\"messages\" list of {\"role\", \"content\"} objects")
    return row


def _is_chat(messages) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)


def _prompt(row: dict, tokenizer, chat_date: str, where: str) -> Prompt:
    if "messages" not in row or not _is_chat(row["messages"]):
        return Prompt(row["prompt"], tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
    if not tokenizer.chat_template:
        raise UserError(f"--sample-prompts {where} is a conversation, but the model has no chat template; pass "
                        "--chat-template FILE.jinja or write it as a {\"prompt\": ...}")
    text = render(tokenizer, row["messages"], chat_date, add_generation_prompt=True)
    return Prompt(row["messages"][-1]["content"], tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_ids(tokenizer, model_dir: Path) -> set[int]:
    """The tokens that end a completion: EOS, and the end-of-turn tokens the model's generation_config.json lists."""
    listed = []
    if (model_dir / "generation_config.json").exists():
        from transformers import GenerationConfig

        listed = GenerationConfig.from_pretrained(model_dir).eos_token_id
        listed = listed if isinstance(listed, list) else [listed]
    return {i for i in [tokenizer.eos_token_id, *listed] if i is not None}


@torch.no_grad()
def complete(strategy: Strategy, prompts: list[Prompt], max_tokens: int, stops: set[int], d: Dist) -> list[list[int]]:
    """Each prompt's greedy completion (at most max_tokens, ending before a stop token). A collective: every rank
    runs the same forwards, then takes rank 0's token. The model is left in its mode, its root released."""
    head, model = strategy.head(), strategy.model
    training = model.training
    model.eval()
    with strategy.whole_sequences():
        completions = [_greedy(head, prompt, max_tokens, stops, d) for prompt in prompts]
    strategy.release()  # the root stays gathered after a forward without backward
    model.train(training)
    return completions


def _greedy(head: Head, prompt: Prompt, max_tokens: int, stops: set[int], d: Dist) -> list[int]:
    """One prompt's greedy completion. A collective (complete)."""
    ids = torch.tensor([prompt.ids], dtype=torch.long, device=d.device)
    out: list[int] = []
    while len(out) < max_tokens:
        token = next_token(head, ids)
        dist.broadcast(token, src=0)  # ranks that computed in another order still continue alike
        value = int(token.item())  # a host sync per token: sampling is not the training loop
        if value in stops:
            break
        out.append(value)
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return out


def next_token(head: Head, ids: torch.Tensor) -> torch.Tensor:
    """The argmax of the next token's logits, as a 1-element tensor on the device. Through the model's own forward
    (its head, any final soft cap), or, with the vocabulary-parallel head, each rank's best of its rows and the best
    of those (a collective)."""
    model = head.model
    if not head.vocab_parallel:
        with head.autocasting(ids.device):
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
        return logits.argmax().view(1)
    h = trunk(model)(input_ids=ids, use_cache=False).last_hidden_state[0, -1]
    weight = model.get_output_embeddings().weight
    return argmax_token(h, weight.to_local(), vocab_row_offset(weight.shape[0], head.group), head.group)
