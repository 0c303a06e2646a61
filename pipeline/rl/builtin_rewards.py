"""The built-in GRPO rewards (--reward accuracy, think_format), with TRL's reward signature."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

RewardFn = Callable[..., Sequence]


def _last_answer(text: str) -> str | None:
    """A completion's answer: its last \\boxed{...}, else its last number (thousands' commas dropped)."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    numbers_found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return numbers_found[-1].replace(",", "") if numbers_found else None


def _same(answer: str, expected: object) -> bool:
    """Equal as numbers where both are numbers (7 and 7.0), else as stripped text."""
    want = str(expected).strip()
    try:
        return math.isclose(float(answer.replace(",", "")), float(want.replace(",", "")), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return answer == want


def text_of(completion: str | list) -> str:
    """A completion's text: itself, or its messages' contents joined."""
    return completion if isinstance(completion, str) else "".join(m.get("content") or "" for m in completion)


def accuracy(prompts: list, completions: list, completion_ids: list, **columns) -> list[float | None]:
    """1 where the completion's last \\boxed{} answer (else its last number) equals the row's `answer`, else 0; None
    (abstains) for a row without one."""
    answers = columns.get("answer") or [None] * len(completions)
    out: list[float | None] = []
    for completion, expected in zip(completions, answers, strict=True):
        if expected is None:
            out.append(None)
            continue
        found = _last_answer(text_of(completion))
        out.append(float(found is not None and _same(found, expected)))
    return out


THINK = re.compile(r"^\s*<think>.*?</think>\s*\S", re.DOTALL)


def think_format(prompts: list, completions: list, completion_ids: list, **columns) -> list[float | None]:
    """1 where the completion is a <think>...</think> reasoning block followed by an answer, else 0."""
    return [float(bool(THINK.match(text_of(c)))) for c in completions]


BUILT_IN: dict[str, RewardFn] = {"accuracy": accuracy, "think_format": think_format}
