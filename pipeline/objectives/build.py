"""The objectives' constructors from their settings, which their components call (pipeline/objectives/kinds.py):
a preference objective or KTO with its reference, a reward model's loss, GRPO with its rollouts' maker."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

import torch

from pipeline.config import Config, ObjectiveConfig
from pipeline.distributed.runtime import Dist
from pipeline.model.adapters import adapters_disabled
from pipeline.model.head import Head
from pipeline.model.packed_rows import Costs, packing_refusal
from pipeline.model.reward_head import RewardHead
from pipeline.objectives.grpo import GRPOObjective, KLReference
from pipeline.objectives.kto import KTOObjective, KTOSettings
from pipeline.objectives.preference import PreferenceObjective, Reference
from pipeline.objectives.preference_losses import PreferenceSettings
from pipeline.objectives.reference import adapters_off
from pipeline.objectives.reward import RewardObjective
from pipeline.rl.episodes import Turns
from pipeline.rl.packing import model_config
from pipeline.rl.prompts import PromptBlocks, observed_ids
from pipeline.rl.rewards import Rewards
from pipeline.rl.rollout import Roller
from pipeline.rl.tools import Tools

log = logging.getLogger("pipeline")

REFERENCE_OBJECTIVES = ("dpo", "ipo", "kto")
"""Objectives measured against a reference: the base with the adapters off, or log-probabilities computed before
training (full fine-tuning, --reference-model)."""


def base_reference(head: Head, reference: Reference | None) -> Reference:
    """A reference objective's reference: the one given (reference.precomputed, reference.none), else the base with
    the adapters off."""
    off: Callable[[], contextlib.AbstractContextManager] = functools.partial(adapters_disabled, head.model)
    return reference or adapters_off(head, off)


def make_preference(o: ObjectiveConfig, head: Head, reference: Reference | None) -> PreferenceObjective:
    """dpo, ipo (against a reference), simpo or orpo (none)."""
    settings = PreferenceSettings(o.objective, o.pref_beta, o.pref_label_smoothing, o.simpo_gamma, o.orpo_lambda)
    return PreferenceObjective(head, settings, base_reference(head, reference)
                               if o.objective in REFERENCE_OBJECTIVES else None)


def make_kto(o: ObjectiveConfig, head: Head, reference: Reference | None) -> KTOObjective:
    return KTOObjective(head, KTOSettings(o.pref_beta, o.kto_desirable_weight, o.kto_undesirable_weight),
                        base_reference(head, reference))


def make_reward(o: ObjectiveConfig, head: Head, reward_head: RewardHead) -> RewardObjective:
    """A reward model's loss; reward_head: its pad token is where the rewards are read up to."""
    return RewardObjective(head, reward_head.pad_token_id, o.center_rewards_coefficient)


def make_grpo(cfg: Config, head: Head, blocks: PromptBlocks, rewards: Rewards, tokenizer, stops: set[int], pad_id: int,
              d: Dist, release: Callable[[], None], gathered: Callable[[], contextlib.AbstractContextManager],
              dtype: torch.dtype, frozen: KLReference | None = None, max_steps: int = 0,
              replica: Head | None = None, tools: Tools | None = None) -> GRPOObjective:
    """GRPO over the run's prompts: the rollouts' maker (its reward models placed on this rank's device in dtype),
    and, where a KL penalty asks for one, the reference: the base with the adapters off, or under full fine-tuning
    the frozen copy given. max_steps: the run's, as reward functions see it in trainer_state. replica: the strategy's
    head whose forward is no collective (Strategy.replica_head), which generation then runs through. tools: --tools,
    whose calls continue each completion through tool turns."""
    rewards.place(d.device, dtype)
    reference = frozen
    if cfg.grpo.grpo_beta and cfg.model.adapter != "none":
        reference = KLReference(head, functools.partial(adapters_disabled, head.model))
    turns = None
    schemas = tools.schemas if tools else []
    if schemas:
        turns = Turns(tools, tools.reader, tokenizer, cfg.data.chat_date, cfg.grpo.max_tool_calling_iterations,
                      stops, pad_id)
    environment = tools.environment if tools else None
    observed = functools.partial(observed_ids, tokenizer, chat_date=cfg.data.chat_date, tools=schemas or None,
                                 limit=cfg.grpo.max_prompt_length, cut=cfg.grpo.long_prompts == "cut" and not schemas)
    roller = Roller(replica or head, blocks.prompts, rewards, tokenizer, stops, pad_id, collective=replica is None,
                    turns=turns, environment=environment, observed=observed)
    config = model_config(head.model)
    # an environment's observation may differ between the rollouts of one prompt: packed rows hold it once
    refusal = "each rollout's prompt is its environment's (--environment)" if environment else packing_refusal(
        config, cfg.grpo.max_prompt_length + cfg.grpo.max_completion_length)
    if refusal and d.is_main:
        log.info("GRPO scores each completion in a row of its own (not its group's completions after one copy of "
                 "the prompt): %s", refusal)
    return GRPOObjective(head, cfg.grpo, roller, d, cfg.run.seed, release, gathered, reference, max_steps,
                         None if refusal else Costs.of(config), dtype)
