"""A micro-batch's rollout: its prompts, each repeated G times and completed by the policy (with --tools, each
completion an episode continued through tool turns: pipeline/rl/episodes.py), the completions decoded and scored by
the rewards. What the loss needs of it is kept on the device; the texts only for the samples log."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.data.batches import Batch
from pipeline.rl.environments import Environment
from pipeline.rl.episodes import Episode, Turns
from pipeline.rl.generation import Sampling, generate, padded
from pipeline.rl.prompts import PromptRow, with_observation
from pipeline.rl.rewards import Rewards, RewardState
from pipeline.signals import Stopped, StopRequest, agreed_stop


@dataclass
class Rollout:
    prompt_ids: torch.Tensor
    """[rows, P] left-padded, each prompt repeated G times in a row (its group)."""
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    """[rows, C] right-padded."""
    completion_mask: torch.Tensor
    """[rows, C] 1 up to and including the first stop token."""
    rewards: torch.Tensor
    """[rows] the weighted sum (float32, on the CPU)."""
    per_reward: torch.Tensor
    """[rows, F] each function's value, NaN where it abstained."""
    valid: torch.Tensor
    """[rows] bool: a real prompt's completion (False: a padding row of a validation batch)."""
    clipped: torch.Tensor
    """[rows] bool: reached --max-completion-length without a stop token."""
    prompts: list
    texts: list[str]
    advantages: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    """The generating policy's log-probabilities (--num-iterations > 1; None: on-policy)."""
    extra: dict[str, list] = field(default_factory=dict)
    """The reward functions' log_extra columns, one value per row (None for a padding row)."""
    tool_mask: torch.Tensor | None = None
    """[rows, C] with --tools: 1 where the model wrote the token, 0 where a tool turn's rendering did (no loss)."""
    episodes: dict[str, torch.Tensor] = field(default_factory=dict)
    """With --tools, per row: calls, failures, parse_failures, timeouts, turns, and length (every token of the
    episode)."""

    @property
    def lengths(self) -> torch.Tensor:
        """The model's tokens of each completion (an episode's tool turns left out, as TRL counts them)."""
        return (self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask).sum(-1)


@dataclass
class Roller:
    """What makes a rollout: the model's head, the prompts' rows, the rewards, the tokenizer and the stop tokens."""

    head: object
    prompts: list[PromptRow]
    rewards: Rewards
    tokenizer: object
    stops: set[int]
    pad_id: int
    collective: bool = True
    """The head's forward is a collective (every rank steps its generation until all are done); False over a whole
    replica (Strategy.replica_head), where each rank stops when its own rows are."""
    turns: Turns | None = None
    """--tools: what continues each completion through tool turns (None: one turn)."""
    environment: Environment | None = None
    """--environment: one instance per rollout, reset with its prompt row before generation."""
    observed: Callable[[PromptRow], list[int]] | None = None
    """With an environment: a prompt row's ids once reset()'s observation is appended (prompts.observed_ids)."""

    def roll(self, batch: Batch, group: int, sampling: Sampling, generator: torch.Generator | None,
             state: RewardState | None = None) -> Rollout:
        """G completions of each prompt of the batch (padding rows, `rows` -1, completed too: every rank runs the
        same micro-batches), decoded and scored. A collective: the generation where the head's forward is one, and
        at the end whether any rank got a stop signal (then Stopped on every rank: a rank's generation or reward
        cut short by one has nothing to give)."""
        rows = np.repeat(batch.rows, group)
        ids, mask = batch.input_ids.repeat_interleave(group, 0), batch.flags.repeat_interleave(group, 0)
        chosen = [self.prompts[r] if r >= 0 else self.prompts[0] for r in rows]
        instances, shared = None, group
        if self.environment is not None:
            instances = [None] * len(rows)
            try:
                instances = self._instances(rows)
                chosen, ids, mask, shared = self._reset(instances, chosen, ids, mask, group)
            except Stopped:  # the user's code cut short: the generation below stops every rank alike, at its first step
                pass
        completion, cmask = generate(self.head, ids, mask, sampling, self.stops, self.pad_id, generator,
                                     self.collective, repeats=shared)
        lengths = cmask.sum(-1).tolist()  # a host sync per micro-batch: the texts are decoded on the CPU
        token_lists = [c[:n] for c, n in zip(completion.tolist(), lengths, strict=True)]
        episodes = None
        if self.turns is not None:
            starts = _unpadded(ids, mask)
            episodes = self.turns.continue_all(self.head, starts, token_lists, sampling, generator, self.collective,
                                               completion.device, instances)
            token_lists = [e.ids for e in episodes]
            completion, cmask = padded([e.ids for e in episodes], self.pad_id, completion.device)
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in token_lists]
        valid = rows >= 0
        prompts = [p.prompt for p in chosen]
        completions = [e.messages for e in episodes] if episodes else [
            t if isinstance(p, str) else [{"role": "assistant", "content": t}] for t, p in zip(texts, prompts,
                                                                                                 strict=True)]
        keep = np.flatnonzero(valid)
        rewards = torch.zeros(len(rows))
        per = torch.full((len(rows), len(self.rewards.functions)), torch.nan)
        extra: dict[str, list] = {}
        where = "during generation" if StopRequest.signum else "during the rollouts"
        try:
            if len(keep) and not StopRequest.signum:  # (a signal over a replica ends its generation early)
                r, p = self.rewards.score([prompts[i] for i in keep], [completions[i] for i in keep],
                                          [token_lists[i] for i in keep], [chosen[i].columns for i in keep], state,
                                          [instances[i] for i in keep] if instances else None)
                rewards[keep], per[keep] = r, p
                for column, values in self.rewards.extra.items():
                    extra[column] = [None] * len(rows)
                    for i, value in zip(keep, values, strict=True):
                        extra[column][i] = value
        except Stopped as stopped:  # this rank's reward cut short: the others hear of it below
            where = str(stopped)
        if agreed_stop():  # every rank, once per rollout
            raise Stopped(where)
        # what generate kept of each row ends at its first stop token: one that reached the limit without one
        clipped = torch.tensor([len(t) >= sampling.max_tokens and t[-1] not in self.stops for t in token_lists])
        rollout = Rollout(ids, mask, completion, cmask, rewards, per, torch.from_numpy(valid), clipped, prompts,
                          texts, extra=extra)
        if episodes:
            rollout.tool_mask = padded([e.model for e in episodes], 0, completion.device)[0]
            rollout.episodes = episode_counts(episodes)
        return rollout

    def _instances(self, rows: np.ndarray) -> list:
        """An environment instance for each real prompt's rollout (the pool's, grown where it has too few); None for
        a padding row's, which no reset() sees (its tools are --tools' alone)."""
        real = np.flatnonzero(rows >= 0)
        instances: list = [None] * len(rows)
        for i, instance in zip(real, self.environment.instances(len(real)), strict=True):
            instances[i] = instance
        return instances

    def _reset(self, instances: list, chosen: list[PromptRow], ids: torch.Tensor, mask: torch.Tensor, group: int
               ) -> tuple[list[PromptRow], torch.Tensor, torch.Tensor, int]:
        """Each rollout's instance reset with its prompt row (TRL's reset(**row): every column of the run's prompt
        rows, None where this one has none, and the prompt), and the prompts its observations lengthened, tokenized
        again (the others' ids as they were): (rows, ids, mask, the rollouts that share one prompt: the group where
        every instance observed alike, else 1)."""
        blank = dict.fromkeys(self.rewards.columns)
        seen = [None if env is None else self.environment.reset(env, {**blank, **row.columns, "prompt": row.prompt})
                for env, row in zip(instances, chosen, strict=True)]
        if all(o is None for o in seen):
            return chosen, ids, mask, group
        chosen = [row if o is None else with_observation(row, o) for row, o in zip(chosen, seen, strict=True)]
        lists = [ids_ if o is None else self.observed(row)
                 for ids_, row, o in zip(_unpadded(ids, mask), chosen, seen, strict=True)]
        ids, mask = padded(lists, self.pad_id, ids.device, left=True)
        alike = all(seen[i] == seen[i - i % group] for i in range(len(seen)))
        return chosen, ids, mask, group if alike else 1


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's tokens where its mask is 1 (a host transfer of both)."""
    return [[t for t, m in zip(r, k, strict=True) if m] for r, k in zip(ids.tolist(), mask.tolist(), strict=True)]


def episode_counts(episodes: list[Episode]) -> dict[str, torch.Tensor]:
    """Each episode's counts, by name, one value per row."""
    names = ("calls", "failures", "parse_failures", "timeouts", "turns")
    counts = {name: torch.tensor([float(getattr(e, name)) for e in episodes]) for name in names}
    return {**counts, "length": torch.tensor([float(len(e.ids)) for e in episodes])}
