"""The settings of online RL (--objective grpo): its rewards, its generation and its loss, named as TRL's GRPOConfig
names them, so a TRL user's settings carry over. The section is checked on its own here; that its flags are given
only under --objective grpo is checked with the objective (pipeline/train/preflight.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from pipeline.config_base import Section, in_range, require

LossType = Literal["dapo", "dr_grpo", "grpo", "bnpo"]
ScaleRewards = Literal["group", "batch", "none"]
LongPrompts = Literal["cut", "drop"]
SamplingLevel = Literal["token", "sequence"]
MAX_LENGTH = 1 << 20
"""The longest prompt or completion, in tokens: beyond it a cache or a mask would not fit any accelerator."""


@dataclass(frozen=True)
class Rollouts:
    """What a run that generates makes per prompt, as the memory estimate counts it (pipeline/strategies/memory.py's
    Generation)."""

    group: int
    """Completions per prompt."""
    prompt: int
    """The longest prompt, in tokens."""
    completion: int
    """The longest completion, in tokens."""
    reference: bool
    """A frozen copy of the base resident beside the policy."""


@dataclass
class GRPOConfig(Section):
    reward: str = ""
    """grpo: the rewards, comma-separated (a YAML list): FILE.py:FUNCTION[:WEIGHT] (TRL's signature
    `fn(prompts, completions, completion_ids, **columns) -> list[float | None]`), or a built-in NAME[:WEIGHT]
    (`accuracy`: the completion's last number or \\boxed{} answer equals the `answer` column; `think_format`: a
    <think>...</think> then the answer). The reward is their weighted sum (weight 1 by default)."""
    reward_timeout: float = 600.0
    """grpo: seconds one call of a reward function (on one micro-batch's completions) may take before the run stops
    in one line naming it and the prompt; 0: no limit. A stop signal interrupts a reward at once either way."""
    num_generations: int = 8
    """grpo: completions per prompt (G), compared within their group; each group lives on one rank."""
    max_prompt_length: int = 512
    """grpo: the longest prompt, in tokens; a longer one is cut from the left or dropped (--long-prompts)."""
    long_prompts: LongPrompts = "cut"
    """grpo: a prompt longer than --max-prompt-length: cut (its first tokens dropped, counted) or drop (the prompt
    skipped, counted)."""
    max_completion_length: int = 256
    """grpo: the most tokens generated per completion; one that reaches it without a stop token is clipped."""
    temperature: float = 1.0
    """grpo: the sampling temperature of the training completions (validation's are greedy)."""
    top_p: float = 1.0
    """grpo: nucleus sampling: the smallest set of tokens whose probability reaches it (1: all)."""
    top_k: int = 0
    """grpo: sample among the k likeliest tokens only (0: all)."""
    scale_rewards: ScaleRewards = "group"
    """grpo: the advantage is the reward minus its group's mean, divided by the group's std (group), by the std over
    every rank's completions of the step (batch), or not divided (none: Dr. GRPO)."""
    loss_type: LossType = "dapo"
    """grpo: how the per-token losses are averaged, as TRL defines each: dapo (over every completion token of the
    step), dr_grpo (over completions x --max-completion-length), grpo (each completion's mean, then their mean),
    bnpo (over the tokens of each micro-batch)."""
    importance_sampling_level: SamplingLevel = "token"
    """grpo: the policy ratio per token (TRL's default), or per completion (sequence: GSPO, the exp of its tokens' mean
    log ratio, clipped as one; with --loss-type grpo it is the GSPO paper's objective)."""
    mask_truncated_completions: bool = False
    """grpo: completions that reached --max-completion-length without ending train nothing (DAPO's overlong
    filtering, TRL's flag): a cut-off text's reward is no signal about the finished answer."""
    epsilon: float = 0.2
    """grpo: the policy ratio is clipped to [1 - epsilon, 1 + epsilon-high]."""
    epsilon_high: float = 0.0
    """grpo: the upper clip (DAPO's clip-higher); 0: the same as --epsilon."""
    grpo_beta: float = 0.0
    """grpo: the weight of the KL penalty against the reference (the base with the adapters off); 0: none, and no
    reference pass."""
    num_iterations: int = 1
    """grpo: optimizer steps per generation (TRL's mu): the completions of one are trained on this many times, the
    later steps' ratio against the generating policy (clipped by --epsilon)."""
    log_completions: int = 2
    """grpo: completions (with their prompt and rewards) logged at each log line, to the samples log and
    TensorBoard's text tab; 0: none."""
    tools: str = ""
    """grpo: FILE.py[:NAME,...], plain functions with type hints and a docstring (TRL's rule; every public function
    of the file unless named) offered to the model through the chat template's tools; its calls (JSON between
    <tool_call> tags) run in the training process and their results go back to it as tool turns, which the loss
    leaves out, until a turn calls no tool (pipeline/rl/episodes.py)."""
    environment: str = ""
    """grpo: FILE.py:CLASS, TRL's environment_factory: one instance per rollout, reset(**row) with the prompt row's
    columns before it (an observation it returns is appended to the prompt), its public methods the model's tools
    beside --tools', get_reward() (optional) a reward of its own beside --reward's, which get the instances as
    `environments` (pipeline/rl/environments.py)."""
    max_tool_calling_iterations: int = 0
    """grpo, --tools or --environment: turns that call tools per episode at most (TRL's
    max_tool_calling_iterations); 0: no limit but --max-completion-length, which bounds the whole episode."""
    tool_timeout: float = 60.0
    """grpo, --tools or --environment: seconds one tool call may run before it is stopped and answered with a
    timeout message (counted; the episode goes on), and an environment's constructor or reset() before the run stops
    in one line; 0: no limit. A stop signal interrupts either at once."""

    def rollouts(self, adapter: str) -> Rollouts:
        """Its rollouts' shape; with --adapter the reference is the base with the adapters off, not a copy."""
        return Rollouts(self.num_generations, self.max_prompt_length, self.max_completion_length,
                        self.grpo_beta > 0 and adapter == "none")

    def check(self) -> None:
        in_range(self.reward_timeout, 0, 1e6, "reward_timeout")
        require(self.reward_timeout == 0 or self.reward_timeout >= 1e-3,
                f"--reward-timeout must be 0 (no limit) or at least 0.001 s, got {self.reward_timeout!r}")
        in_range(self.num_generations, 2, 4096, "num_generations")  # a group of one has no std to compare with
        in_range(self.max_prompt_length, 1, MAX_LENGTH, "max_prompt_length")
        in_range(self.max_completion_length, 1, MAX_LENGTH, "max_completion_length")
        in_range(self.temperature, 1e-3, 100, "temperature")  # dividing logits by less overflows bf16
        in_range(self.top_p, 0, 1, "top_p", low_open=True)
        in_range(self.top_k, 0, 1 << 24, "top_k")
        # the ratio's lower clip, 1 - epsilon, must stay above 0 (objectives/grpo_losses.GRPOLossSettings' check)
        require(0 < self.epsilon < 1, f"--epsilon must be in (0, 1), got {self.epsilon:g}")
        in_range(self.epsilon_high, 0, 10, "epsilon_high")
        in_range(self.grpo_beta, 0, 1e3, "grpo_beta")
        in_range(self.log_completions, 0, 1000, "log_completions")
        in_range(self.num_iterations, 1, 1024, "num_iterations")
        in_range(self.max_tool_calling_iterations, 0, MAX_LENGTH, "max_tool_calling_iterations")
        in_range(self.tool_timeout, 0, 1e6, "tool_timeout")
        require(self.tool_timeout == 0 or self.tool_timeout >= 1e-3,
                f"--tool-timeout must be 0 (no limit) or at least 0.001 s, got {self.tool_timeout!r}")
        require(self.tools or self.environment or not {"max_tool_calling_iterations", "tool_timeout"} & set(
            self.given()), "--max-tool-calling-iterations and --tool-timeout are for --tools or --environment")

    @property
    def clip_high(self) -> float:
        return self.epsilon_high or self.epsilon

    def given(self) -> list[str]:
        """The fields set away from their defaults (refused under another objective)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
