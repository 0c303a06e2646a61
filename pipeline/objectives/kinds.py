"""Each objective as one component (torchtitan's way): what the trainer and pipeline.evaluate need of it, behind one
interface, so that neither names an objective. `kind_of(cfg)` gives the run's: how many optimizer steps each draw of
the sampler trains, and `build(...)`, the objective the trainer calls on each micro-batch. What preflight checks of
an objective and keeps in the fingerprint is pipeline/objectives/plans.py's; what the memory estimate counts comes
from the config's own description of the workload (pipeline/config.py, Config.rollouts)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import Config
from pipeline.eval.samples import stop_ids
from pipeline.model.head import Head
from pipeline.model.reward_head import RewardHead, pad_id
from pipeline.objectives.build import make_grpo, make_objective
from pipeline.objectives.kl_reference import frozen_copy
from pipeline.objectives.objective import Objective
from pipeline.objectives.preference import Reference
from pipeline.rl.rewards import Rewards
from pipeline.strategies.base import Strategy


@dataclass(frozen=True)
class Inputs:
    """What an objective is built from, in a run (pipeline/train/trainer.py) or an evaluation (pipeline.evaluate)."""

    cfg: Config
    strategy: Strategy
    """The built model's strategy: its head, its gather and release (generation), its replica head."""
    head: Head
    blocks: object
    """What the sampler draws from: the token cache's blocks, or the prompts (pipeline/rl/prompts.py)."""
    dtype: torch.dtype
    tokenizer: object
    model_dir: Path
    hf_config: object
    reference: Reference | None = None
    """A preference objective's reference where it is not the base with the adapters off: the log-probabilities
    computed before training (objectives/reference.precomputed) or none (reference.none)."""
    reward_head: RewardHead | None = None
    rewards: Rewards | None = None
    """Online RL's reward functions, loaded by preflight."""
    max_steps: int = 0
    """The run's steps, as an objective's user code sees them (GRPO's rewards: trainer_state); 0 in an evaluation."""
    training: bool = True
    """False in an evaluation, which holds no frozen copy of the base."""


class Kind:
    """An objective over the token cache's blocks: the causal-LM loss, a preference objective, KTO, a reward model."""

    def iterations(self, cfg: Config) -> int:
        """Optimizer steps trained on each draw of the sampler."""
        return 1

    def build(self, inputs: Inputs) -> Objective:
        return make_objective(inputs.cfg.objective, inputs.head, inputs.reference, inputs.reward_head)


class Online(Kind):
    """GRPO: completions generated from prompts and scored by rewards, each generation trained --num-iterations
    times."""

    def iterations(self, cfg: Config) -> int:
        return cfg.grpo.num_iterations

    def build(self, inputs: Inputs) -> Objective:
        """The rollouts' maker over the prompts; under full fine-tuning with a KL penalty the frozen copy of the base
        built here (a collective under fsdp2)."""
        cfg, s = inputs.cfg, inputs.strategy
        frozen = frozen_copy(cfg, inputs.model_dir, inputs.hf_config, s.dist, inputs.dtype) if inputs.training \
            else None
        return make_grpo(cfg, inputs.head, inputs.blocks, inputs.rewards, inputs.tokenizer,
                         stop_ids(inputs.tokenizer, inputs.model_dir), pad_id(inputs.tokenizer), s.dist, s.release,
                         s.gathered, inputs.dtype, frozen, inputs.max_steps, replica=s.replica_head())


KINDS: dict[str, Kind] = {"grpo": Online()}
"""--objective -> its component, where it is not an offline objective over blocks (Kind)."""


def kind_of(cfg: Config) -> Kind:
    return KINDS.get(cfg.objective.objective, Kind())

