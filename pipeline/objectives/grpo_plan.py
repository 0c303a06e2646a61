"""Preflight's part for online RL (pipeline/objectives/plans.py calls it): a prompts dataset trains with --objective
grpo and nothing else, GRPO's flags are given only with it, its rewards load (the user's code runs here, once per
process, before any heavy work), and what defines a GRPO run goes into its fingerprint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.config import Config
from pipeline.config_base import flag
from pipeline.data.chat_render import render
from pipeline.errors import UserError
from pipeline.rl.environments import Environment
from pipeline.rl.prompts import prompt_columns
from pipeline.rl.rewards import Rewards
from pipeline.rl.tool_calls import call_reader
from pipeline.rl.tools import Tools

GENERATION = ("num_generations", "max_prompt_length", "long_prompts", "max_completion_length", "temperature", "top_p",
              "top_k", "scale_rewards", "loss_type", "importance_sampling_level", "mask_truncated_completions",
              "epsilon", "epsilon_high", "grpo_beta", "num_iterations", "max_tool_calling_iterations")
"""The settings that decide a GRPO run's completions and loss: changed on resume, the run would be another."""
LATER = {"importance_sampling_level": "token", "mask_truncated_completions": False, "max_tool_calling_iterations": 0}
"""Settings added after GRPO runs existed, with their defaults: in the fingerprint only away from them, so that a run
checkpointed before they were added resumes."""


def check_prompts(cfg: Config, prompts: int) -> None:
    """Prompt rows train with grpo, grpo trains on prompt rows, and GRPO's flags come with grpo: one line each."""
    objective, data = cfg.objective.objective, cfg.data.dataset_name
    if prompts and objective != "grpo":
        raise UserError(f"{data} holds {prompts:,} prompts alone (prompt-only records, for online RL): train them "
                        "with --objective grpo --reward FILE.py:FUNCTION")
    if objective == "grpo" and not prompts:
        raise UserError(f"--objective grpo generates completions of prompts and {data} holds none (DATA-HF reads "
                        "records with a \"prompt\" and no completion, e.g. {\"prompt\": \"...\", \"answer\": \"...\"}, "
                        "as prompts)")
    if objective != "grpo" and (given := cfg.grpo.given()):
        raise UserError(f"{flag(given[0])} is for --objective grpo, not {objective}")


def plan_rewards(cfg: Config, hf_config: object, environment: Environment | None = None) -> Rewards:
    """The rewards of a GRPO run (with the environment's get_reward where it has one), loaded; and the settings GRPO
    cannot take, refused in one line."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    longest = cfg.grpo.max_prompt_length + cfg.grpo.max_completion_length
    if limit is not None and longest > limit:  # as --seq-length past it is refused: positions the model never saw
        raise UserError(f"--max-prompt-length {cfg.grpo.max_prompt_length} + --max-completion-length "
                        f"{cfg.grpo.max_completion_length} = {longest} tokens is above the model's limit "
                        f"(max_position_embeddings {limit}); lower either so that they sum to {limit} at most")
    if cfg.model.vocab_parallel == "on":
        raise UserError("--vocab-parallel on: GRPO scores its completions through the model's own head; use "
                        "--vocab-parallel auto or off")
    if cfg.train.sample_prompts:
        raise UserError("--sample-prompts: a GRPO run logs its own completions (--log-completions); drop it")
    return Rewards(cfg.grpo.reward, cfg.data.chat_date, cfg.grpo.reward_timeout, environment)


def check_reward_columns(rewards: Rewards, data: list) -> None:
    """The rewards told the prompt rows' columns (each function is passed them all); a built-in that needs one no
    row has is one line."""
    held: dict[str, int] = {}
    rows = 0
    for source in data:
        columns, n = prompt_columns(source.dataset)
        rows += n
        for name, count in columns.items():
            held[name] = held.get(name, 0) + count
    rewards.check_columns(held, rows, ", ".join(s.source.path for s in data))


def grpo_settings(cfg: Config, rewards: Rewards, tools: Tools | None = None) -> dict:
    """A GRPO run's fingerprint field: its generation and loss settings, each reward's identity (file content hash,
    function, weight), its tools' (file, functions, content hash) and its environment's (file, class, content hash)
    where it has them."""
    values = dataclasses.asdict(cfg.grpo)
    environment = tools.environment if tools else None
    return {"rewards": rewards.identity, **({"tools": tools.identity} if tools and tools.identity else {}),
            **({"environment": environment.identity} if environment else {}),
            **{k: values[k] for k in GENERATION if k not in LATER or values[k] != LATER[k]}}


def plan_tools(cfg: Config, tokenizer, data: list, environment: Environment | None = None) -> Tools | None:
    """--tools loaded (the user's file imported here, before any heavy work) with the environment's methods, and what
    they need: prompts as conversations (a text prompt has no template to offer tools through) and a chat template
    that renders tools. An environment without a tool of its own, and no --tools, needs neither (its rollouts are
    one turn)."""
    if not cfg.grpo.tools and environment is None:
        return None
    tools = Tools(cfg.grpo.tools, cfg.grpo.tool_timeout, environment)
    if not tools.schemas:
        return tools
    given = "--tools" if cfg.grpo.tools else "--environment"
    if not tokenizer.chat_template:
        raise UserError(f"{given} offers tools through the chat template, and {cfg.model.model_name} has none; use "
                        "its Instruct version, or pass --chat-template FILE.jinja")
    text = sum(bool(columns) and not messages for source in data
               for messages, columns in zip(source.dataset["messages"], source.dataset["columns"], strict=True))
    if text:
        raise UserError(f"{given}: {text:,} prompts of {cfg.data.dataset_name} are plain text, which no chat template "
                        "renders with tools; give them as conversations ({\"prompt\": [{\"role\": \"user\", "
                        "\"content\": ...}]})")
    probe, date = [{"role": "user", "content": "?"}], cfg.data.chat_date
    if render(tokenizer, probe, date, tools=tools.schemas) == render(tokenizer, probe, date):
        raise UserError(f"{given}: the chat template of {cfg.model.model_name} renders no tools (a prompt reads the "
                        "same with them and without), so the model would never see them; use a template that does "
                        "(the model's Instruct version's, or --chat-template FILE.jinja)")
    tools.reader = call_reader(tokenizer, date, tools.schemas, cfg.model.model_name, given)  # read as written
    return tools


def grpo_changed(run_dir: Path, saved: dict, current: dict) -> str:
    """The resume guard's line for a GRPO run whose rewards or generation settings changed: the first that did."""
    if saved.get("rewards") != current.get("rewards"):
        return (f"refusing to resume {run_dir}: its rewards were {', '.join(saved.get('rewards', []))} and are now "
                f"{', '.join(current.get('rewards', []))} (FILE:FUNCTION:WEIGHT:content hash): a changed reward file, "
                "function or weight trains toward another goal; restore them, or pass --no-resume to start a new run "
                "beside it")
    key = next(k for k in [*current, *saved] if saved.get(k) != current.get(k))
    was, now = saved.get(key, LATER.get(key)), current.get(key, LATER.get(key))  # a later setting left at its default
    return (f"refusing to resume {run_dir}: {flag(key)} was {was!r} and is now {now!r}; "
            "rerun with the original value, or pass --no-resume to start a new run beside it")
