"""What the trainer, validation and the evaluate command know of an objective: one interface, so none of them tells
the causal-LM loss from a preference objective (pipeline/objectives/build.py picks which)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pipeline.data.batches import Batch


@dataclass(frozen=True)
class HeldOut:
    """An objective's figures over held-out blocks (pipeline/eval/heldout.py): validation, pipeline.evaluate."""

    loss: float
    """The objective's mean loss per item (the causal-LM loss: cross-entropy per target token, in nats)."""
    tokens: int
    """Items the mean is over: target tokens, or a preference objective's pairs."""
    blocks: int
    metrics: dict[str, float] = field(default_factory=dict)
    """The objective's own figures over the same items (a preference objective's rewards/*, logps/*)."""
    by_part: list[float | None] = field(default_factory=list)
    """The mean loss of each part the blocks came in (a mixture's sources), None where a part holds no item."""

    @property
    def ppl(self) -> float:
        return math.inf if self.loss > 700 else math.exp(self.loss)  # exp overflows there; NaN stays NaN


@dataclass(frozen=True)
class StepSource:
    """What an objective draws a step's micro-batches from: the trainer's sampler over the train blocks."""

    part: object
    """The train split (pipeline/data/batches.Part or a prompts' part): its blocks and flags by row."""
    upcoming: Callable[[], np.ndarray]
    """The step's rows over every rank and micro-step (the global permutation), drawing nothing."""
    draw: Callable[[], list[np.ndarray]]
    """This rank's micro-batches' rows for the step; the sampler moves on to the next step."""
    make: Callable[[np.ndarray], Batch]
    """A micro-batch from its rows, on the device, as the strategy splits it."""


@dataclass(frozen=True)
class Prepared:
    """A step's micro-batches as the trainer runs them: each key made into a batch by make (pipeline/train/step.py),
    the loss a mean over items."""

    keys: Sequence
    make: Callable[[object], Batch | None]
    items: float


class Objective(Protocol):
    generates: bool
    """Whether it makes the step's items itself (GRPO: its completions, generated in prepare()) instead of finding
    them in the blocks."""
    phase: str | None
    """The timer phase prepare() runs under where it is work of its own (GRPO's "generate"); None: not timed apart."""
    counted: str
    """What items() counts, as the log names its rate: "trained_tokens", "pairs" or "examples"
    (`trained_tokens_per_s`...)."""
    shown: tuple[tuple[str, str], ...]
    """(metric, short name) of the figures the log line shows beside the loss, in the training and the validation
    line; none: the validation line shows the perplexity."""

    def prepare(self, source: StepSource, step: int) -> Prepared:
        """The step's micro-batches and the items its loss is a mean over: drawn from the blocks (offline), or made
        now (GRPO's rollouts; a collective every rank calls, which may raise signals.Stopped)."""

    def __call__(self, batch: Batch, num_items: float) -> torch.Tensor:
        """The batch's share of the step's loss, its sum divided by num_items (the step's items over every rank and
        micro-step). A collective where the head is vocabulary-parallel: every rank calls it with the same shapes."""

    def items(self, ids: np.ndarray, flags: np.ndarray | None, valid_rows: int | None = None) -> int:
        """What the loss of these blocks is a mean over (target tokens, pairs), with rows from valid_rows on
        padding."""

    def read_metrics(self, reduce: bool) -> dict[str, float]:
        """The figures it kept since last read (means over the window's items), then reset; {} for none. reduce:
        over every rank first (a collective: every rank calls it)."""

    def window_apart(self) -> contextlib.AbstractContextManager:
        """A pass whose figures are read on their own (validation): the training window is set aside meanwhile."""

    def closing(self, base: HeldOut, final: HeldOut) -> str:
        """The run's closing comparison of the validation figures, base -> final."""

    def samples(self) -> list[dict]:
        """Examples of what it trained on since last asked, for the samples log (GRPO's completions); [] for none."""

    def state_dict(self) -> dict | None:
        """This rank's state a checkpoint must keep (GRPO's rollouts between two generations); None for none."""

    def load_state_dict(self, state: dict | None) -> None:
        """The state state_dict gave, from a checkpoint (None: none was saved)."""


class Offline:
    """What an objective over the token cache's blocks answers where an online one (GRPO) does more."""

    generates = False
    phase = None

    def prepare(self, source: StepSource, step: int) -> Prepared:
        """The sampler's micro-batches, made one at a time as the step reaches them; the items of the step's rows
        over every rank (no communication: the permutation is global)."""
        idx = source.upcoming()
        items = self.items(source.part.blocks[idx], source.part.flags_at(idx))
        return Prepared(source.draw(), source.make, items)

    def samples(self) -> list[dict]:
        return []

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """Nothing to restore: its state is the blocks'."""
