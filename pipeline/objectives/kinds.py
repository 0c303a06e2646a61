"""Each objective as one component (torchtitan's way): what preflight, the trainer and pipeline.evaluate need of it,
behind one interface, so that none of them names an objective. `kind_of(cfg)` gives the run's: what it checks of the
model and resolves before any heavy work (its fingerprint fields, GRPO's rewards, a reward model's head) and the
resume guard's line when one of those changed; how many optimizer steps each draw of the sampler trains;
`build(...)`, the objective the trainer calls on each micro-batch; and the figures and table rows pipeline.evaluate
reports of its held-out loss. That the data's records fit the
objective is checked across them (pipeline/objectives/plans.check_data); what the memory estimate counts comes from
the config's own description of the workload (pipeline/config.py, Config.rollouts), since the strategies sit below
the objectives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import Config
from pipeline.eval.samples import stop_ids
from pipeline.model.head import Head
from pipeline.model.reward_head import RewardHead, checked_pad_id, is_reward_model, pad_id
from pipeline.objectives.build import REFERENCE_OBJECTIVES, make_grpo, make_kto, make_preference, make_reward
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.objectives.grpo_plan import check_reward_columns, grpo_changed, grpo_settings, plan_rewards, plan_tools
from pipeline.objectives.kl_reference import frozen_copy
from pipeline.objectives.objective import HeldOut, Objective
from pipeline.objectives.plans import ObjectivePlan, check_reward, objective_settings, refuse_reward_model
from pipeline.objectives.preference import Reference
from pipeline.rl.environments import Environment
from pipeline.rl.rewards import Rewards
from pipeline.rl.tools import Tools
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
    tools: Tools | None = None
    """Online RL's tools (--tools), loaded by preflight."""
    max_steps: int = 0
    """The run's steps, as an objective's user code sees them (GRPO's rewards: trainer_state); 0 in an evaluation."""
    training: bool = True
    """False in an evaluation, which holds no frozen copy of the base."""


class Kind:
    """The causal-LM loss (sft), and what every objective over the token cache's blocks shares."""

    def check_model(self, cfg: Config, hf_config) -> tuple[str, str] | None:
        """The model fits the objective, one line each before any weight is read; a reward head's layout where the
        objective trains one."""
        refuse_reward_model(cfg, hf_config)
        return None

    def fingerprint(self, cfg: Config) -> dict:
        """Its fields of the run's fingerprint (none for sft: runs from before objectives existed resume)."""
        return {}

    def resolve(self, cfg: Config, hf_config, tokenizer, data: list, layout: tuple[str, str] | None
                ) -> ObjectivePlan:
        """What preflight resolves of it: its fingerprint fields, and what it loads now. layout: check_model's."""
        return ObjectivePlan(self.fingerprint(cfg))

    def changed(self, run_dir: Path, key: str, saved: dict, current: dict) -> str | None:
        """The resume guard's line for one of its fingerprint fields that changed; None for the generic line."""
        return None

    def reward_head(self, cfg: Config, hf_config, tokenizer, layout: tuple[str, str] | None) -> RewardHead | None:
        """The transform that makes the model a reward model, where the objective trains one (its pad token checked
        against the embedding: one line); layout: check_model's."""
        return None

    def iterations(self, cfg: Config) -> int:
        """Optimizer steps trained on each draw of the sampler."""
        return 1

    def build(self, inputs: Inputs) -> Objective:
        """What the trainer calls on each micro-batch, blind to which: (batch, items of the step) -> loss."""
        return CausalLMLoss(inputs.head)

    def figures(self, cfg: Config, result: HeldOut) -> dict:
        """pipeline.evaluate's report of the held-out result, beside the loss and the data it was measured on."""
        return {"ppl": result.ppl, "tokens": result.tokens}

    def rows(self, report: dict, model: str, data: str) -> dict[str, str]:
        """The report as pipeline.evaluate's table shows it. data: the dataset, split and blocks, to be closed by
        what was counted in them."""
        return {"model": model, "dataset": data + f"{report['tokens']:,} target tokens)",
                "loss": shown(report["loss"], ".5f"), "ppl": shown(report["ppl"], ".3f")}


class Pairs(Kind):
    """A preference objective over pairs (dpo, ipo, simpo, orpo): the loss, the preference accuracy and the mean
    margin of the rewards, against the reference where it has one."""

    def fingerprint(self, cfg: Config) -> dict:
        return {"objective": objective_settings(cfg.objective)}

    def build(self, inputs: Inputs) -> Objective:
        return make_preference(inputs.cfg.objective, inputs.head, inputs.reference)

    def figures(self, cfg: Config, result: HeldOut) -> dict:
        return {**self.settings(cfg), "pairs": result.tokens,
                "preference_accuracy": result.metrics["rewards/accuracies"],
                "mean_margin": result.metrics["rewards/margins"], **result.metrics}

    @staticmethod
    def settings(cfg: Config) -> dict:
        o = cfg.objective
        reference = o.reference_model or ("the base, adapter off" if cfg.model.adapter != "none" else None)
        return {"objective": o.objective, "pref_beta": o.pref_beta,
                "reference": reference if o.objective in REFERENCE_OBJECTIVES else None}

    def rows(self, report: dict, model: str, data: str) -> dict[str, str]:
        items = "pairs" if "pairs" in report else "examples"
        return {"model": model, "dataset": data + f"{report[items]:,} {items})", **self.reference_row(report),
                f"{report['objective']} loss": shown(report["loss"], ".5f"),
                **({"accuracy": format(report["preference_accuracy"], ".4f")} if items == "pairs" else {}),
                "margin": format(report["mean_margin"], ".4f") if math.isfinite(report["mean_margin"]) else
                "undefined (the examples hold desirable or undesirable completions only)",
                **({"kl": format(report["kl"], ".4f")} if "kl" in report else {})}

    @staticmethod
    def reference_row(report: dict) -> dict[str, str]:
        return {"reference": report["reference"] or "none (the model's own log-probabilities)"}


class Unpaired(Pairs):
    """KTO: no pairs, so no accuracy; the margin of the two labels' rewards."""

    def build(self, inputs: Inputs) -> Objective:
        return make_kto(inputs.cfg.objective, inputs.head, inputs.reference)

    def figures(self, cfg: Config, result: HeldOut) -> dict:
        return {**self.settings(cfg), "examples": result.tokens, "mean_margin": result.metrics["rewards/margins"],
                **result.metrics}


class RewardModel(Pairs):
    """A reward model: its family's sequence-classification head on the model, trained on pairs; its own rewards'
    accuracy and margin, no reference and no beta."""

    def check_model(self, cfg: Config, hf_config) -> tuple[str, str] | None:
        return check_reward(cfg, hf_config)

    def reward_head(self, cfg: Config, hf_config, tokenizer, layout: tuple[str, str] | None) -> RewardHead | None:
        return RewardHead(layout, checked_pad_id(tokenizer, hf_config, cfg.model.model_name),
                          is_reward_model(hf_config))

    def build(self, inputs: Inputs) -> Objective:
        return make_reward(inputs.cfg.objective, inputs.head, inputs.reward_head)

    def figures(self, cfg: Config, result: HeldOut) -> dict:
        return {**self.settings(cfg), "reference": None, "pref_beta": None, "pairs": result.tokens,
                "preference_accuracy": result.metrics["accuracy"], "mean_margin": result.metrics["margin"],
                **result.metrics}

    @staticmethod
    def reference_row(report: dict) -> dict[str, str]:
        return {}


class Online(Kind):
    """GRPO: completions generated from prompts and scored by rewards, each generation trained --num-iterations
    times."""

    def resolve(self, cfg: Config, hf_config, tokenizer, data: list, layout: tuple[str, str] | None
                ) -> ObjectivePlan:
        """Its rewards, loaded (the user's code runs here) and told the prompts' columns; their identity and the
        generation and loss settings in the fingerprint."""
        environment = Environment(cfg.grpo.environment, cfg.grpo.tool_timeout) if cfg.grpo.environment else None
        rewards = plan_rewards(cfg, hf_config, environment)
        check_reward_columns(rewards, data)
        tools = plan_tools(cfg, tokenizer, data, environment)
        return ObjectivePlan({"grpo": grpo_settings(cfg, rewards, tools)}, rewards=rewards, tools=tools)

    def changed(self, run_dir: Path, key: str, saved: dict, current: dict) -> str | None:
        if key == "grpo" and saved.get(key) and current.get(key):
            return grpo_changed(run_dir, saved[key], current[key])
        return None

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
                         s.gathered, inputs.dtype, frozen, inputs.max_steps, replica=s.replica_head(),
                         tools=inputs.tools)

    def figures(self, cfg: Config, result: HeldOut) -> dict:
        """Greedy completions' rewards, as the run's validation."""
        rewards = ", ".join(filter(None, [cfg.grpo.reward, cfg.grpo.environment]))  # its get_reward, if any
        return {"objective": cfg.objective.objective, "reward_functions": rewards, "prompts": result.tokens,
                "mean_reward": result.metrics["reward"], **result.metrics}

    def rows(self, report: dict, model: str, data: str) -> dict[str, str]:
        return {"model": model, "dataset": f"{report['dataset']} ({report['split']}: {report['prompts']:,} prompts, "
                f"greedy completions)", "rewards": report["reward_functions"],
                "mean reward": format(report["mean_reward"], ".4f"),
                "mean length": format(report["completions/mean_length"], ".2f")}


KINDS: dict[str, Kind] = {"sft": Kind(), **dict.fromkeys(("dpo", "ipo", "simpo", "orpo"), Pairs()), "kto": Unpaired(),
                          "reward": RewardModel(), "grpo": Online()}
"""--objective -> its component."""


def kind_of(cfg: Config) -> Kind:
    """The run's objective's component."""
    return KINDS[cfg.objective.objective]


def kind_of_report(report: dict) -> Kind:
    """The kind whose figures a pipeline.evaluate report holds (the causal-LM loss's name none)."""
    return KINDS[report.get("objective", "sft")]


def shown(value: float | str, spec: str) -> str:
    """A figure of a report as the table shows it: "nan" and "inf" (JSON's text for them) as they are."""
    return value if isinstance(value, str) else format(value, spec)
