"""`python -m pipeline.evaluate`: the held-out loss of any model (a hub id in the offline cache, a model folder, a
run's hf/) or of a base with an adapter, on a dataset packed exactly as training packs it: the same token cache,
found by the same key, so `--config RUN/config.yaml` scores the very blocks that run held out. With --lm-eval-tasks,
also (or only) lm-evaluation-harness tasks, offline, on the same model (eval/harness.py).

    python -m pipeline.evaluate local/tiny-llama -d hf_datasets/corpus --seq-length 128
    python -m pipeline.evaluate outputs/RUN/hf --config outputs/RUN/config.yaml --out after.json
    torchrun --nproc_per_node 4 -m pipeline.evaluate org/big-model --adapter outputs/RUN/adapter -d DATA --split all
    python -m pipeline.evaluate outputs/RUN/hf --lm-eval-tasks my_qa --lm-eval-include tasks/ --out bench.json
    python -m pipeline.evaluate outputs/RUN/hf -d hf_datasets/pairs --reference local/tiny-llama

On a dataset of preference pairs it scores the pairs as DPO does (--objective and --pref-beta choose how): the loss,
the preference accuracy (how often the chosen answer's reward is the higher) and the mean margin, against --reference
(its log-probabilities computed once and kept beside the token cache), an adapter's base with the adapter off, or
without either the model's own log-probabilities. On KTO's unpaired records, as KTO does: the loss, the mean margin
of the desirable and undesirable completions' rewards and the KL term.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline import config_merge as config_mod
from pipeline.config import Config
from pipeline.config_merge import add_config_arguments
from pipeline.data.dataset import load_text_dataset, preference_rows, prompt_rows
from pipeline.data.sources import parse_sources
from pipeline.distributed.launch import detect as detect_launch
from pipeline.distributed.runtime import Dist, compute_dtype, init_distributed
from pipeline.errors import ArgumentParser, UserError
from pipeline.eval.adapter_folder import (
    WEIGHTS,
    AdapterFolder,
    base_dir,
    is_adapter_folder,
    load_adapter,
    read_adapter_folder,
)
from pipeline.eval.harness import Tasks, check_tasks, run_tasks
from pipeline.eval.heldout import held_out_loss
from pipeline.fsutil import sha256_file, write_text_atomic
from pipeline.model.registry import transforms_for
from pipeline.model.reward_head import is_reward_model
from pipeline.objectives.kinds import Inputs, kind_of, kind_of_report
from pipeline.objectives.objective import HeldOut
from pipeline.objectives.plans import held_out_objective, plan_reference
from pipeline.objectives.reference import none as no_reference
from pipeline.objectives.reference import precomputed
from pipeline.prep.hub import resolve_model_dir
from pipeline.strategies.auto import check_agreed
from pipeline.strategies.registry import make_strategy, settle
from pipeline.train.blocks import prepare_blocks
from pipeline.train.preflight import Plan, check_base_weights, resolve_inputs
from pipeline.train.reference import with_reference
from pipeline.train.telemetry import finite_or_text

SPLITS = ("val", "all")
OWN = ("model", "adapter_dir", "split", "out", "reference")
"""This command's own arguments; every other one is a config key."""


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description="Held-out loss and perplexity of a model, or of a base model with an adapter, on a "
                       "dataset packed exactly as training packs it (the same token cache). The data and model flags "
                       "are fsdp1.py's; --config RUN/config.yaml packs as that run did. With --lm-eval-tasks, also "
                       "(without a dataset: only) lm-evaluation-harness tasks, offline.",
                       argument_default=argparse.SUPPRESS, allow_abbrev=False)
    p.add_argument("model", help="a hub id in the offline cache, a model folder (RUN/hf, RUN/best), or an adapter "
                   "folder (RUN/adapter: on the base model its adapter_config.json names)")
    p.add_argument("--adapter", dest="adapter_dir", type=Path, default=None,
                   help="a PEFT adapter folder (LoRA or DoRA) to put on MODEL")
    p.add_argument("--split", choices=SPLITS, default="val", help="val: the blocks training holds out (default); "
                   "all: every block, training and validation")
    p.add_argument("--out", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument("--reference", default=None, help="preference pairs: the reference model the rewards are measured "
                   "against (a hub id or folder of MODEL's vocabulary and architecture; default: an adapter's base, "
                   "else none)")
    # the run's flags but those this command sets: the model (MODEL), the adapter (--adapter's folder), the run name
    add_config_arguments(p, leave_out=frozenset({"model_name", "experiment_name", "adapter"}))
    return p


def resolve(argv: list[str] | None) -> tuple[Config, AdapterFolder | None, argparse.Namespace]:
    """The config to pack and build by (the flags given, MODEL and the adapter's settings over them), the adapter
    folder if any, and this command's own arguments."""
    parsed = vars(build_parser().parse_args(argv))
    args = argparse.Namespace(**{k: parsed.pop(k) for k in OWN})
    check_out(args.out)
    adapter_dir = args.adapter_dir or (Path(args.model) if is_adapter_folder(Path(args.model)) else None)
    adapter = read_adapter_folder(adapter_dir) if adapter_dir is not None else None
    model = args.model
    if adapter is not None:  # the base found is the one the adapter was trained on, before any work
        model = adapter.base_model if args.adapter_dir is None else model
        base_dir(adapter.path, adapter.base_model, "" if args.adapter_dir is None else model)
    # a run config's prompts are the trainer's: not read here (nor required to exist)
    cfg = config_mod.merge({**parsed, "experiment_name": "evaluate", "model_name": model, "sample_prompts": ""})
    if args.reference and not cfg.data.dataset_name:
        raise UserError("--reference is for a dataset of preference pairs: the rewards of their answers are measured "
                        "against it")
    if len(parse_sources(cfg.data.dataset_name)) > 1:
        raise UserError(f"--dataset-name {cfg.data.dataset_name} is a mixture: pipeline.evaluate measures one dataset; "
                        "evaluate each source apart (a mixture run's eval events hold eval/loss/NAME per source)")
    if not cfg.data.dataset_name and Tasks.of(cfg.train) is None:
        raise UserError("nothing to evaluate: give a dataset (-d DATASET, or --config RUN/config.yaml) for the "
                        "held-out loss, or --lm-eval-tasks, or both")
    if Tasks.of(cfg.train) is not None and adapter is None and reward_model(model):
        raise UserError(f"--lm-eval-tasks: {model} is a reward model, which scores text and does not generate; "
                        "evaluate it on preference pairs (-d PAIRS)")
    settings = {"adapter": "none"}
    if adapter is not None:
        settings = dict(adapter.settings)
        if cfg.model.adapter == "qlora" and settings["adapter"] == "lora":  # a QLoRA run's: scored on its NF4 base
            settings["adapter"] = "qlora"
    # no dropout: evaluation runs in eval mode anyway, and the setting is not in the folder; whole sequences on each
    # rank (a run's --sequence-parallel is how it trained, not how it is scored)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_dropout=0.0, sequence_parallel=1,
                                                             **settings))
    return settle(cfg), adapter, args


def reward_model(model: str) -> bool:
    """Whether the model named is a reward model (reward_head.is_reward_model of its config)."""
    from transformers import AutoConfig

    return is_reward_model(AutoConfig.from_pretrained(resolve_model_dir(model)))


def scored_as(cfg: Config, reference: str | None) -> Config:
    """cfg with the objective that scores its dataset (pipeline/objectives/plans.held_out_objective)."""
    ds = load_text_dataset(cfg.data.dataset_name) if cfg.data.dataset_name else None
    pairs, unpaired = preference_rows(ds) if ds is not None else (0, 0)
    prompts = prompt_rows(ds) if ds is not None else 0
    return held_out_objective(cfg, reference, pairs, unpaired, prompts, lambda: reward_model(cfg.model.model_name))


def check_out(out: Path | None) -> None:
    """--out refused before any work, rather than after the evaluation."""
    if out is None:
        return
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; give a file name such as {out / 'eval.json'}")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: its folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK):
        raise UserError(f"--out {out}: its folder {out.parent} is not writable")


def main(argv: list[str] | None = None) -> int:
    cfg, adapter, args = resolve(argv)
    launch = detect_launch()  # a launcher's missing variable is one line before any heavy work
    tasks = Tasks.of(cfg.train)
    if tasks is not None:  # on every rank: one refusing alone would leave the others at the rendezvous
        check_tasks(tasks)
    report = held_out(cfg, adapter, args) if cfg.data.dataset_name else {}
    if launch.rank != 0:
        return 0
    model_dir = resolve_model_dir(cfg.model.model_name)
    report = report or identity(cfg, adapter, args, check_base_weights(cfg, model_dir).digests)
    if tasks is not None:
        device = torch.device(f"cuda:{launch.local_rank}" if torch.cuda.is_available() else "cpu")
        with mapped_oom(0, device, "running the lm-eval tasks", "a smaller --lm-eval-batch-size"):
            report["lm_eval"] = run_tasks(tasks, model_dir, adapter_dir=adapter and adapter.path, device=device,
                                          dtype=compute_dtype(cfg.model.precision, device),
                                          batch_size=cfg.train.lm_eval_batch_size)
    if "loss" in report:
        print(table(report))
    if args.out is not None:
        write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    return 0


def held_out(cfg: Config, adapter: AdapterFolder | None, args: argparse.Namespace) -> dict:
    """The held-out part of the report on rank 0, {} on the others. Joins the process group and leaves it: lm-eval
    then runs on rank 0 alone."""
    plan = resolve_inputs(scored_as(cfg, args.reference))
    cfg = plan.config  # --strategy auto resolved
    weights = check_base_weights(cfg, plan.model_dir)
    d = init_distributed(timedelta(seconds=cfg.run.collective_timeout_s))
    check_agreed(cfg, d)  # --strategy auto chose the same wrapper on every node, or its collectives would not match
    if d.is_main:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    with mapped_oom(d.rank, d.device, f"evaluating at batch {cfg.train.batch_size} x seq {cfg.data.seq_length}",
                    "a smaller -b, or more processes under torchrun with --strategy fsdp2"):
        result, cache = evaluate(cfg, plan, adapter, args.split, d)
    report = {}
    if d.is_main:
        model = identity(cfg, adapter, args, weights.digests)
        data = {key: plan.fingerprint[key] for key in ("dataset", "tokenizer", "model_config")}
        report = {**model, **held_out_figures(cfg, args, result), "fingerprint": {**data, **model["fingerprint"]},
                  "token_cache": cache and str(cache)}
    # the wrapped model is in a reference cycle (DDP's reducer holds the group): freed while the group lives. Freed
    # by a later gc.collect() (lm-eval's load) after destroy_process_group, ~ProcessGroupGloo once waited forever on
    # a mutex (make demo, 2026-11-26: hung until killed, once; not reproduced in 6 reruns of the command)
    gc.collect()
    # on success only: after a failure another rank may still be in a collective (errors.leave)
    dist.destroy_process_group()
    return report


@contextlib.contextmanager
def mapped_oom(rank: int, device: torch.device, doing: str, fix: str) -> Iterator[None]:
    """Running out of device memory: one line saying what ran out and what to change."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise UserError(f"rank {rank} ran out of {device.type.upper()} memory {doing}; use {fix}") from None


def evaluate(cfg: Config, plan: Plan, adapter: AdapterFolder | None, split: str, d: Dist
             ) -> tuple[HeldOut, Path | None]:
    """The token cache (found or built), the model distributed and filled, and its loss over the split; and the
    cache's folder (None for prompts, tokenized in memory). A collective."""
    blocks = prepare_blocks(cfg, plan, d)
    if not len(blocks.val) and split == "val":  # --split all always has blocks: training needs one batch of them
        raise UserError(f"{cfg.data.dataset_name} has no validation blocks at --val-fraction {cfg.data.val_fraction:g}"
                        f" and --seq-length {cfg.data.seq_length}; pass --split all, or the run's --val-fraction")
    dtype = compute_dtype(cfg.model.precision, d.device)
    reward = [plan.reward_head] if plan.reward_head else []
    strategy = make_strategy(cfg.model, d, dtype, [*transforms_for(cfg.model, dtype), *reward])
    strategy.build(plan.hf_config)
    head, reference = strategy.head(), None
    if cfg.objective.reference_model:  # before the model's own weights: the pass loads the reference's
        ref = plan_reference(cfg, plan.model_dir, plan.hf_config, plan.tokenizer,
                             lambda: check_base_weights(cfg, plan.model_dir))
        blocks = with_reference(blocks, ref, strategy, dtype, cfg.train.batch_size)
        reference = precomputed(head)
    elif adapter is None:
        reference = no_reference(head)
    strategy.load_weights(plan.model_dir)
    if adapter is not None:
        load_adapter(strategy, adapter)
    parts = [blocks.part("val"), *([blocks.part("train")] if split == "all" else [])]
    objective = kind_of(cfg).build(Inputs(cfg, strategy, head, blocks, dtype, plan.tokenizer, plan.model_dir,
                                          plan.hf_config, reference=reference, reward_head=plan.reward_head,
                                          rewards=plan.rewards, tools=plan.tools, training=False))
    result = held_out_loss(strategy, parts, cfg.train.batch_size, d, objective)
    if result is None:
        raise UserError(f"the {split} blocks of {cfg.data.dataset_name} hold no token the loss counts (--train-on "
                        f"{cfg.data.train_on}); use --split all or another --train-on")
    return result, blocks.path


def identity(cfg: Config, adapter: AdapterFolder | None, args: argparse.Namespace, digests: dict[str, str]) -> dict:
    """What the report was measured on: the model and adapter, with their fingerprints."""
    weights = hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()
    return {
        "model": args.model, "base_model": cfg.model.model_name,
        "adapter": None if adapter is None else str(adapter.path),
        "fingerprint": {"weights": weights[:16],
                        **({"adapter": sha256_file(adapter.path / WEIGHTS)[:16]} if adapter else {})},
    }


def held_out_figures(cfg: Config, args: argparse.Namespace, result: HeldOut) -> dict:
    """The held-out loss and the data it was measured on, and the objective's figures (the perplexity of the
    causal-LM loss, a preference objective's accuracy and margin, GRPO's rewards); a loss or perplexity that is not
    finite as text ("nan", "inf"), which JSON has no number for."""
    data = {"dataset": cfg.data.dataset_name, "split": args.split, "seq_length": cfg.data.seq_length,
            "loss": result.loss, "blocks": result.blocks, **kind_of(cfg).figures(cfg, result)}
    return {k: finite_or_text(v) if k in ("loss", "ppl") else v for k, v in data.items()}


def table(report: dict) -> str:
    model = report["base_model"] + (f" + adapter {report['adapter']}" if report["adapter"] else "")
    cut = f"{report['dataset']} ({report['split']}: {report['blocks']:,} blocks of {report['seq_length']} tokens, "
    rows = kind_of_report(report).rows(report, model, cut)
    width = max(map(len, rows)) + 1
    return "\n".join(f"{k:<{width}} {v}" for k, v in rows.items())
