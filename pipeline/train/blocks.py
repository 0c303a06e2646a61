"""The token cache of a run's data, as the training processes meet it: the first rank of each node builds it (or
finds it) under a file lock while the others poll for it, with no collective, so no timeout however long a build
takes; `--prepare-only` builds it and exits."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

from pipeline.config import Config, ObjectiveConfig
from pipeline.data import pair_tokens
from pipeline.data.mixture import MixedBlocks
from pipeline.data.sampler import BlockSampler, MixtureSampler
from pipeline.data.token_cache import (
    Blocks,
    BuildStopped,
    beyond_vocabulary,
    ensure_token_cache,
    open_blocks,
    token_cache_dir,
)
from pipeline.distributed.launch import Launch
from pipeline.distributed.runtime import Dist, gather_objects
from pipeline.errors import UserError
from pipeline.model.reward_head import pad_id
from pipeline.objectives.kto import KTOSettings, balance_advice
from pipeline.rl.prompts import PromptBlocks, build_prompt_blocks
from pipeline.signals import Interrupted, StopRequest
from pipeline.train.preflight import DataSource, Plan
from pipeline.train.telemetry import log


def cache_path(cfg: Config, plan: Plan, source: DataSource | None = None) -> Path:
    """The token cache of one of the run's datasets (the only one by default)."""
    return token_cache_dir(cfg.cache_root, (source or plan.data[0]).fingerprint, plan.model_dir, plan.spec)


def ensure_blocks(cfg: Config, plan: Plan, builder: bool) -> list[tuple[str, Path]]:
    """The token cache of each of this run's datasets: ("hit" | "built" | "waited", its path). The builder (one
    process per node) builds each under a file lock; the others poll for it. No collective, so no timeout however
    long it takes. A stop signal ends the build before its next chunk, or the wait, on each process by itself (no
    collective either): Interrupted, after one line."""
    try:
        return [(ensure_token_cache(source.dataset, plan.tokenizer, plan.spec, cfg.data.num_proc or os.cpu_count() or 1,
                                    path := cache_path(cfg, plan, source), builder,
                                    stopping=lambda: StopRequest.signum != 0), path) for source in plan.data]
    except BuildStopped as stop:
        (log.warning if builder else log.info)("stopped by signal %s; rerun the same command to resume", stop)
        raise Interrupted(StopRequest.signum or signal.SIGTERM) from None


def prepare_blocks(cfg: Config, plan: Plan, d: Dist) -> Blocks | MixedBlocks | PromptBlocks:
    """Every rank memory-maps the token caches its node's first rank built (or found): one dataset's blocks, or a
    mixture's sources' as one. An objective that reads prompts (GRPO) has them tokenized by every rank instead
    (pipeline/rl/prompts.py)."""
    if cfg.objective.generates:
        return prompt_blocks(cfg, plan, d)
    caches = []
    for source, (status, path) in zip(plan.data, ensure_blocks(cfg, plan, d.is_local_main), strict=True):
        if d.is_main:
            log.info("token cache %s: %s%s", status, path, f" ({source.source.name})" if plan.mixture else "")
            log_cache_meta(path, cfg.objective)
        caches.append(open_blocks(path))
    blocks = MixedBlocks([s.source for s in plan.data], caches) if plan.mixture else caches[0]
    if plan.mixture and d.is_main:
        log.info("mixture: %s", _shares(plan, caches))
    for cache in caches:
        check_vocabulary(cache, plan, d)
    return blocks


def prompt_blocks(cfg: Config, plan: Plan, d: Dist) -> PromptBlocks:
    blocks = build_prompt_blocks(plan.data[0].dataset, plan.tokenizer, cfg.grpo, cfg.data.chat_date,
                                 cfg.data.val_fraction, cfg.run.seed, pad_id(plan.tokenizer),
                                 plan.tools.schemas if plan.tools else None)
    if d.is_main:
        counts = blocks.counts
        log.info("prompts: %d kept (%d train, %d validation), %d cut from the left to --max-prompt-length %d "
                 "(%d tokens in all), %d dropped as longer%s%s", counts["kept"], len(blocks.train), len(blocks.val),
                 counts["cut"], cfg.grpo.max_prompt_length, counts["prompt_tokens_cut"], counts["dropped"],
                 f", {counts['empty']} skipped as empty (no token)" if counts["empty"] else "",
                 f"; {counts['prefilled']} end with the assistant's text, which the model continues"
                 if counts["prefilled"] else "")
    return blocks


def _shares(plan: Plan, caches: list[Blocks]) -> str:
    """Each source's training blocks and share of the run's."""
    total = sum(s.source.weight for s in plan.data)
    return ", ".join(f"{s.source.name} {len(c.train):,} training blocks at {100 * s.source.weight / total:.1f}%"
                     for s, c in zip(plan.data, caches, strict=True))


def make_sampler(blocks: Blocks | MixedBlocks | PromptBlocks, cfg: Config, d: Dist) -> BlockSampler:
    """The run's sampler: one permutation of a dataset's blocks, or a mixture's sources drawn by weight."""
    # dealt to the data shares (a sequence-parallel group's ranks share theirs: Dist.data_rank)
    shape = (cfg.run.seed, d.data_world, d.data_rank, cfg.train.batch_size, cfg.train.grad_accum)
    if isinstance(blocks, MixedBlocks):
        return MixtureSampler(blocks.sizes, [s.weight for s in blocks.sources], *shape)
    return BlockSampler(len(blocks.train), *shape)


def check_one_batch(blocks: Blocks | MixedBlocks | PromptBlocks, cfg: Config, d: Dist) -> None:
    """Training needs at least one global batch of training blocks, and a mixture a block of each source: one line
    naming what to change."""
    global_batch = d.data_world * cfg.train.batch_size * cfg.train.grad_accum
    ranks = f"{d.world_size} processes" if d.sequence_parallel == 1 else \
        f"{d.data_world} sequence-parallel groups of {d.sequence_parallel}"
    if isinstance(blocks, MixedBlocks):  # a source without blocks would be drawn its share from nothing
        for source, n in zip(blocks.sources, blocks.sizes, strict=True):
            if not n:
                raise UserError(f"the mixture's source {source.name} ({source.path}) gives no training blocks of "
                                f"{cfg.data.seq_length} tokens; give it more data, or leave it out of --dataset-name")
    if isinstance(blocks, PromptBlocks) and len(blocks.train) < global_batch:
        raise UserError(f"the dataset gives {len(blocks.train)} training prompts, fewer than one global batch "
                        f"({ranks} x batch {cfg.train.batch_size} prompts x grad accum "
                        f"{cfg.train.grad_accum} = {global_batch}); use more prompts or a smaller --batch-size, "
                        "--grad-accum or --val-fraction")
    if len(blocks.train) < global_batch:
        raise UserError(f"the dataset gives {len(blocks.train)} training blocks of {cfg.data.seq_length} tokens, "
                        f"fewer than one global batch ({ranks} x batch {cfg.train.batch_size} x "
                        f"grad accum {cfg.train.grad_accum} = {global_batch}); "
                        + (why_none_kept(json.loads((blocks.path / "meta.json").read_text()), cfg.data.seq_length)
                           or "use more data or a smaller --seq-length, --batch-size or --grad-accum"))


NONE_KEPT = {
    "dropped_too_long": ("longer than a block even with the prompt cut", "use a larger --seq-length (now {seq})"),
    "tools_not_rendered": ("left without their tool calls or schemas by the chat template",
                           "use a template that renders tools (--chat-template)"),
    "reasoning_not_rendered": ("left without their reasoning by the chat template",
                               "use a template that renders it (--chat-template), or --train-on-reasoning off"),
    "template_mismatch": ("rendered differently turn by turn by the chat template", "use another --chat-template"),
    "template_error": ("refused by the chat template (it raised)", "use another --chat-template"),
    "malformed": ("malformed (the dataset's prep_report.json says how)", "fix the data"),
    "prompt_cut_too_far": (f"fitted only with their prompts cut below {pair_tokens.MIN_PROMPT} tokens",
                           "use a larger --seq-length (now {seq})"),
}
"""Why a token cache kept no pair or conversation, by the commonest reason: what happened, and the fix that fits."""


def why_none_kept(meta: dict, seq: int) -> str:
    """The advice for a cache whose pairs or conversations were all dropped ("" when some were kept or there were
    none: then more data or a smaller shape is the fix)."""
    for what in ("pairs", "conversations"):
        counts = meta.get(what) or {}
        if counts and not counts.get("kept") and not counts.get("truncated") and sum(counts.values()):
            reason = max(counts, key=counts.get)
            if reason in NONE_KEPT:
                n, (happened, fix) = counts[reason], NONE_KEPT[reason]
                return (f"none of its {sum(counts.values())} {what} was kept: {n} {'was' if n == 1 else 'were'} "
                        f"{happened}; {fix.format(seq=seq)}")
    return ""


def check_vocabulary(blocks: Blocks, plan: Plan, d: Dist) -> None:
    """Every token id has an embedding row; each rank scans its share of the blocks (the cache is read once in all)
    and every rank refuses alike. A collective every rank must reach. Cost: BENCHMARKS.md section 14."""
    vocab = getattr(plan.hf_config, "vocab_size", None)
    if not vocab:
        return
    if found := [p for p in gather_objects(beyond_vocabulary(blocks, vocab, d.rank, d.world_size)) if p]:
        raise UserError(found[0])


def prepare_only(cfg: Config, plan: Plan, launch: Launch) -> int:
    """--prepare-only: the token cache and nothing else (no process group, no GPU)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    builder = launch.local_rank == 0
    for status, path in ensure_blocks(cfg, plan, builder):
        meta = json.loads((path / "meta.json").read_text())
        if builder:
            print(f"token cache {status}: {path}: {meta['train_blocks']} training and {meta['val_blocks']} "
                  f"validation blocks of {meta['seq_length']} tokens; the same command without --prepare-only "
                  "trains on it", flush=True)
    return 0


def log_cache_meta(path: Path, objective: ObjectiveConfig | None = None) -> None:
    """What the cache holds: conversations kept, truncated and dropped, and the share of tokens trained; under kto,
    weights that do not balance its labels (balance_advice)."""
    meta = json.loads((path / "meta.json").read_text())
    if "kto" in meta and objective is not None and (advice := balance_advice(
            meta["kto"]["desirable"], meta["kto"]["undesirable"],
            KTOSettings(objective.pref_beta, objective.kto_desirable_weight, objective.kto_undesirable_weight))):
        log.warning("KTO: %s", advice)
    if "conversations" in meta:
        counts = ", ".join(f"{k} {v}" for k, v in meta["conversations"].items() if v)
        what = "conversation samples" if "turn_by_turn" in meta else "conversations"  # split ones count per sample
        log.info("%s: %s; %d blocks of them, %d of text", what, counts, meta["chat_blocks"], meta["text_blocks"])
    if "pairs" in meta:
        counts, cut = meta["pairs"], meta.get("pairs_prompt_tokens_cut", 0)
        what = "KTO examples (each its completion and its KL sequence)" if "kto" in meta else "preference pairs"
        log.info("%s: %s; %d blocks of them%s", what, ", ".join(f"{k} {v}" for k, v in counts.items() if v),
                 meta["pair_blocks"], "; of those kept, {desirable} desirable and {undesirable} undesirable".format(
                     **meta["kto"]) if "kto" in meta else "")
        if counts.get("truncated"):
            log.warning("%d %s were longer than a block and had their prompts cut from the left: %d prompt tokens in "
                        "all, %.1f each (a larger --seq-length keeps them whole)", counts["truncated"],
                        what.split(" (")[0], cut, cut / counts["truncated"])
    if split := meta.get("turn_by_turn"):
        log.info("%d conversations trained turn by turn (their template rewrites earlier turns) as %d samples: "
                 "%d tokens more than one rendering of each (+%.1f%%)", split["conversations"], split["samples"],
                 split["extra_tokens"], 100 * split["extra_tokens"] / max(split["whole_tokens"], 1))
    if meta.get("flags"):
        total = meta["blocks"] * (meta["seq_length"] - 1)
        log.info("%d of %d tokens (%.1f%%) are targets of the loss", meta["targets"], total,
                 100 * meta["targets"] / max(total, 1))
