"""`python -m pipeline.evaluate`: the held-out loss of any model (a hub id in the offline cache, a model folder, a
run's hf/) or of a base with an adapter, on a dataset packed exactly as training packs it: the same token cache,
found by the same key, so `--config RUN/config.yaml` scores the very blocks that run held out.

    python -m pipeline.evaluate local/tiny-llama -d hf_datasets/corpus --seq-length 128
    python -m pipeline.evaluate outputs/RUN/hf --config outputs/RUN/config.yaml --out after.json
    torchrun --nproc_per_node 4 -m pipeline.evaluate org/big-model --adapter outputs/RUN/adapter -d DATA --split all
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from pipeline import config as config_mod
from pipeline.config import Config
from pipeline.dist.launch import detect as detect_launch
from pipeline.dist.runtime import Dist, compute_dtype, init_distributed
from pipeline.errors import ArgumentParser, UserError
from pipeline.eval.adapter_folder import AdapterFolder, is_adapter_folder, load_adapter, read_adapter_folder
from pipeline.eval.heldout import HeldOut, held_out_loss
from pipeline.fsutil import sha256_file, write_text_atomic
from pipeline.model.registry import transforms_for
from pipeline.strategies.registry import make_strategy, settle
from pipeline.train.blocks import prepare_blocks
from pipeline.train.preflight import Plan, check_base_weights, resolve_inputs

SPLITS = ("val", "all")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description="Held-out loss and perplexity of a model, or of a base model with an adapter, on a "
                       "dataset packed exactly as training packs it (the same token cache). Every fsdp1.py flag of the "
                       "data and the model is accepted too (-d, --seq-length, --val-fraction, --seed, --train-on, "
                       "--chat-template, --save-dir or --cache-dir for the token cache, --strategy, -b), or --config "
                       "RUN/config.yaml to pack as that run did.", allow_abbrev=False)
    p.add_argument("model", help="a hub id in the offline cache, a model folder (RUN/hf, RUN/best), or an adapter "
                   "folder (RUN/adapter: on the base model its adapter_config.json names)")
    p.add_argument("--adapter", type=Path, help="a PEFT adapter folder to put on MODEL (LoRA or DoRA)")
    p.add_argument("--split", choices=SPLITS, default="val", help="val: the blocks training holds out (default); "
                   "all: every block, training and validation")
    p.add_argument("--out", type=Path, help="also write the results to this JSON file")
    return p


def resolve(argv: list[str] | None) -> tuple[Config, AdapterFolder | None, object]:
    """The config to pack and build by (the run flags given, MODEL and the adapter's settings over them), the adapter
    folder if any, and the parsed arguments."""
    args, rest = build_parser().parse_known_args(argv)
    adapter_dir = args.adapter or (Path(args.model) if is_adapter_folder(Path(args.model)) else None)
    adapter = read_adapter_folder(adapter_dir) if adapter_dir is not None else None
    model = args.model
    if args.adapter is None and adapter is not None:
        if not adapter.base_model:
            raise UserError(f"{adapter.path}/adapter_config.json names no base model; pass the base as MODEL and the "
                            "folder as --adapter")
        model = adapter.base_model
    # MODEL last, so it wins over a -m or a config file's model_name; the experiment name names no folder here
    cfg = config_mod.resolve([*rest, "-e", "evaluate", "-m", model])
    settings = adapter.settings if adapter else {"adapter": "none"}
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_dropout=0.0, **settings))
    if args.out is not None and not args.out.parent.is_dir():
        raise UserError(f"--out {args.out}: its folder {args.out.parent} does not exist")
    return settle(cfg), adapter, args


def main(argv: list[str] | None = None) -> int:
    cfg, adapter, args = resolve(argv)
    detect_launch()  # a launcher's missing variable is one line before any heavy work
    plan = resolve_inputs(cfg)
    cfg = plan.config  # --strategy auto resolved
    weights = check_base_weights(cfg, plan.model_dir)
    d = init_distributed(timedelta(seconds=cfg.run.collective_timeout_s))
    if d.is_main:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    result, cache = evaluate(cfg, plan, adapter, args.split, d)
    if d.is_main:
        report = {**results(cfg, plan, adapter, args, result, weights.digests), "token_cache": str(cache)}
        print(table(report))
        if args.out is not None:
            write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    # on success only: after a failure another rank may still be in a collective (errors.leave)
    dist.destroy_process_group()
    return 0


def evaluate(cfg: Config, plan: Plan, adapter: AdapterFolder | None, split: str, d: Dist) -> tuple[HeldOut, Path]:
    """The token cache (found or built), the model distributed and filled, and its loss over the split; and the
    cache's folder. A collective."""
    blocks = prepare_blocks(cfg, plan, d)
    parts = [(blocks.val, blocks.val_flags)] + ([(blocks.train, blocks.train_flags)] if split == "all" else [])
    if not sum(len(b) for b, _ in parts):
        raise UserError(f"{cfg.data.dataset_name} has no validation blocks at --val-fraction {cfg.data.val_fraction:g}"
                        f" and --seq-length {cfg.data.seq_length}; pass --split all, or the run's --val-fraction")
    dtype = compute_dtype(cfg.model.precision, d.device)
    strategy = make_strategy(cfg.model, d, dtype, transforms_for(cfg.model, dtype))
    strategy.build(plan.hf_config)
    strategy.load_weights(plan.model_dir)
    if adapter is not None:
        load_adapter(strategy, adapter)
    return held_out_loss(strategy, parts, cfg.train.batch_size, d), blocks.path


def results(cfg: Config, plan: Plan, adapter: AdapterFolder | None, args, result: HeldOut,
            digests: dict[str, str]) -> dict:
    """What --out writes: the figures, and what they were measured on (model, adapter and dataset fingerprints)."""
    weights = hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()
    return {
        "model": args.model, "base_model": cfg.model.model_name,
        "adapter": None if adapter is None else str(adapter.path),
        "dataset": cfg.data.dataset_name, "split": args.split, "seq_length": cfg.data.seq_length,
        "loss": result.loss, "ppl": result.ppl if math.isfinite(result.ppl) else str(result.ppl),
        "tokens": result.tokens, "blocks": result.blocks,
        "fingerprint": {
            "dataset": plan.fingerprint["dataset"], "tokenizer": plan.fingerprint["tokenizer"],
            "model_config": plan.fingerprint["model_config"], "weights": weights[:16],
            **({"adapter": sha256_file(adapter.path / "adapter_model.safetensors")[:16]} if adapter else {}),
        },
    }


def table(report: dict) -> str:
    rows = {"model": report["base_model"] + (f" + adapter {report['adapter']}" if report["adapter"] else ""),
            "dataset": f"{report['dataset']} ({report['split']}: {report['blocks']:,} blocks of "
                       f"{report['seq_length']} tokens, {report['tokens']:,} target tokens)",
            "loss": f"{report['loss']:.5f}", "ppl": f"{report['ppl']:.3f}" if isinstance(report["ppl"], float)
            else report["ppl"]}
    return "\n".join(f"{k:<8} {v}" for k, v in rows.items())
