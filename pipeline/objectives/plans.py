"""What preflight checks and resolves of the objectives, for their components (pipeline/objectives/kinds.py): the
data fits the objective, a reward model trains as one, a preference objective's reference and settings, and which
objective pipeline.evaluate scores a dataset with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Config, ObjectiveConfig
from pipeline.errors import UserError
from pipeline.model.reward_head import is_reward_model, reward_head_layout
from pipeline.model.weight_check import WeightCheck, unchanged_weights, weights_digest
from pipeline.model.weight_files import read_index
from pipeline.objectives.build import REFERENCE_OBJECTIVES
from pipeline.objectives.grpo_plan import check_prompts
from pipeline.prep.hub import resolve_model_dir
from pipeline.rl.rewards import Rewards
from pipeline.rl.tools import Tools


@dataclass(frozen=True)
class ObjectivePlan:
    """What preflight resolved for the objective."""

    fingerprint: dict
    """The objective's fields of the run's fingerprint (none for sft, so runs from before objectives resume)."""
    rewards: Rewards | None = None
    """grpo: the reward functions, loaded (pipeline/rl/rewards.py)."""
    tools: Tools | None = None
    """grpo --tools: the functions offered to the model, loaded (pipeline/rl/tools.py)."""

    @property
    def resident_params(self) -> int:
        """Other models' parameters every rank holds beside the policy (GRPO's reward models)."""
        return self.rewards.model_params if self.rewards else 0


def check_data(cfg: Config, pairs: int, unpaired: int, prompts: int) -> None:
    """The objective fits the data's records (pairs, unpaired labelled completions, prompts alone): one line."""
    check_objective(cfg, pairs, unpaired)
    check_prompts(cfg, prompts)


def refuse_reward_model(cfg: Config, hf_config) -> None:
    """A reward model trains further as one and as nothing else (it has no language-model head)."""
    if is_reward_model(hf_config):
        raise UserError(f"--model-name {cfg.model.model_name} is a reward model ({hf_config.architectures[0]}): it "
                        "trains further with --objective reward only (it has no language-model head)")


@dataclass(frozen=True)
class ReferencePlan:
    model_dir: Path
    name: str
    """As the user named it (--model-name or --reference-model)."""
    weights: str
    """Its weights' digest (weight_check.weights_digest): the key of its log-probabilities beside the token cache."""


def objective_settings(o: ObjectiveConfig) -> dict:
    """A preference run's objective as its fingerprint holds it. An SFT run's fingerprint has no such field, so runs
    from before preference objectives still resume; reference_model only where given and an objective's own fields
    (KTO's weights) only under it, so runs from before those existed still resume."""
    if o.objective == "reward":  # the preference objectives' settings play no part in it
        return {"objective": o.objective, "center_rewards_coefficient": o.center_rewards_coefficient}
    return {k: v for k, v in dataclasses.asdict(o).items()
            if (k != "reference_model" or v) and o.ONLY.get(k, o.objective) == o.objective}


def check_objective(cfg: Config, pairs: int, unpaired: int) -> None:
    """The objective fits the data: pairs train with a preference objective (SFT on them would train the prompts
    alone), unpaired records with kto (any other would read a labelled completion as a pair or as an answer to
    imitate), text and conversations with sft."""
    objective, data = cfg.objective.objective, cfg.data.dataset_name
    if unpaired and objective != "kto":
        raise UserError(f"{data} holds {unpaired:,} unpaired preference records (a prompt, one completion and its "
                        "label): train them with --objective kto")
    if pairs and objective == "sft":
        raise UserError(f"{data} holds {pairs:,} preference pairs (chosen and rejected answers): train them with "
                        "--objective dpo, ipo, simpo, orpo or kto")
    if not pairs and not unpaired and objective == "kto":
        raise UserError(f"--objective kto trains on labelled completions and {data} holds none (DATA-HF reads "
                        "records with a prompt, a completion and a true/false label, and pairs, as KTO's records)")
    if not pairs and objective not in ("sft", "kto", "grpo"):
        raise UserError(f"--objective {objective} trains on preference pairs and {data} holds none (DATA-HF reads "
                        "records with chosen and rejected answers as pairs)")


def check_reward(cfg: Config, hf_config) -> tuple[str, str]:
    """A reward model neither generates nor answers lm-eval's tasks; its family must have a sequence-classification
    class that reads it (reward_head_layout). One line each, before any weight is read."""
    if cfg.model.strategy == "manual":  # its own flat shards take no parameter a transform initialises
        raise UserError("--objective reward trains under --strategy ddp, fsdp2 or fsdp1 (auto picks among them), not "
                        "manual")
    for given, name in ((cfg.train.sample_prompts, "--sample-prompts"), (cfg.train.lm_eval_tasks, "--lm-eval-tasks")):
        if given:
            raise UserError(f"{name}: a reward model scores text and does not generate; drop it (its validation "
                            "gives the held-out accuracy)")
    return reward_head_layout(hf_config)


def plan_reference(cfg: Config, model_dir: Path, hf_config, tokenizer, base: Callable[[], WeightCheck]
                   ) -> ReferencePlan | None:
    """The reference whose log-probabilities a pass computes before training: --reference-model, or the base under
    full fine-tuning (an adapter run's reference is its base with the adapters off: None). A reference of another
    vocabulary or other tensors than the policy's is one line, before any weight is read. base: the base weights'
    check (made where preflight has not made it already)."""
    o = cfg.objective
    if o.objective not in REFERENCE_OBJECTIVES or (cfg.model.adapter != "none" and not o.reference_model):
        return None
    if not o.reference_model:
        return ReferencePlan(model_dir, cfg.model.model_name, weights_digest(base()))
    from transformers import AutoConfig, AutoTokenizer

    ref_dir = resolve_model_dir(o.reference_model, "--reference-model")
    ref_config = AutoConfig.from_pretrained(ref_dir)
    if is_reward_model(ref_config):  # run as a causal LM, its head would be missing (or a tied embedding)
        raise UserError(f"--reference-model {o.reference_model} is a reward model ({ref_config.architectures[0]}): a "
                        "reference gives log-probabilities, which a reward model has no head for")
    mine, theirs = getattr(hf_config, "vocab_size", None), getattr(ref_config, "vocab_size", None)
    if mine != theirs or AutoTokenizer.from_pretrained(ref_dir).get_vocab() != tokenizer.get_vocab():
        raise UserError(f"--reference-model {o.reference_model} has another vocabulary than {cfg.model.model_name} "
                        f"(vocab_size {theirs} vs {mine}, or other tokens): a reference scores the policy's tokens, "
                        "so it must share its tokenizer")
    policy, ref = read_index(model_dir), read_index(ref_dir)
    for name, entry in policy.items():
        if name not in ref or list(ref[name].shape) != list(entry.shape):
            found = "missing" if name not in ref else f"of shape {list(ref[name].shape)}"
            raise UserError(f"--reference-model {o.reference_model} does not fit {cfg.model.model_name}'s "
                            f"architecture: its tensor {name} is {found}, not of shape {list(entry.shape)}; the "
                            "reference is run in the policy's model, so it must be the same architecture")
    check = unchanged_weights(ref_dir, o.reference_model)
    return ReferencePlan(ref_dir, o.reference_model, weights_digest(check))


def held_out_objective(cfg: Config, reference: str | None, pairs: int, unpaired: int, prompts: int,
                       reward_model: Callable[[], bool]) -> Config:
    """pipeline.evaluate's objective for a dataset of these records: pairs are scored by a preference objective (dpo
    unless another is given: the next-token loss of both answers would say nothing of the preference), or by a
    reward model's own loss; unpaired records by kto, with --reference as its reference model; prompts by GRPO's
    rewards of greedy completions; anything else by the causal-LM loss. reward_model: whether the model is one
    (asked only where it decides)."""
    if prompts:  # the mean reward of greedy completions, as GRPO validates
        if reference:
            raise UserError("--reference is for a dataset of preference pairs; prompts are scored by --reward")
        if not cfg.grpo.reward:
            raise UserError(f"{cfg.data.dataset_name} holds prompts: their completions are scored by --reward "
                            "FILE.py:FUNCTION[:WEIGHT] (or a built-in; --config RUN/config.yaml gives the run's)")
        return dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, objective="grpo"))
    if reference and not pairs and not unpaired:
        raise UserError("--reference is for a dataset of preference pairs: the rewards of their answers are measured "
                        "against it")
    reward = reward_model()
    if cfg.objective.objective == "reward" and not reward:  # its score would be drawn at random, not read
        raise UserError(f"{cfg.model.model_name} is not a reward model (a run of --objective reward exports one to "
                        "RUN/hf): its rewards would come from a score drawn at random")
    if reward:
        if not pairs:  # a reward model scores pairs alone: the next-token loss of its score would be no figure
            raise UserError(f"{cfg.model.model_name} is a reward model: it is evaluated on preference pairs (-d "
                            "PAIRS), its figures the accuracy and margins of its rewards")
        if reference:
            raise UserError("--reference is for --objective dpo, ipo or kto: a reward model is scored alone")
    if not pairs and not unpaired:
        return cfg
    objective = "reward" if reward else "kto" if unpaired else \
        cfg.objective.objective if cfg.objective.preference else "dpo"
    if reference and objective not in REFERENCE_OBJECTIVES:
        raise UserError(f"--reference is for --objective dpo, ipo or kto, not {objective}, which has no reference")
    return dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, objective=objective,
                                                                  reference_model=reference or ""))
