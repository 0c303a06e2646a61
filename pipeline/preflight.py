"""Preflight: every user mistake that can be found cheaply, found before any process joins a group or loads weights.

It runs identically on every rank (no collective), so each rank prints the same one line and exits; what it
resolves (the model folder, its config, the dataset, the run's fingerprint) is the Plan the trainer builds on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoint import check_fingerprint, read_state
from pipeline.config import Config
from pipeline.data import dataset_fingerprint, load_text_dataset, tokenizer_fingerprint
from pipeline.errors import UserError
from pipeline.hub import resolve_model_dir
from pipeline.weights import read_index


@dataclass
class Plan:
    """What preflight resolved: everything later stages need, found without heavy work."""

    model_dir: Path
    hf_config: object
    dataset: object
    fingerprint: dict


def run_fingerprint(cfg: Config, model_dir: Path, hf_config, dataset) -> dict:
    """What defines the run, for the resume guard (epochs, steps and frequencies may change between reruns)."""
    conf = {k: v for k, v in hf_config.to_dict().items() if k not in ("transformers_version", "_name_or_path")}
    return {
        "model_name": cfg.model.model_name,
        "model_config": hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "tokenizer": tokenizer_fingerprint(model_dir)[:16],
        "dataset": dataset_fingerprint(dataset),
        "seq_length": cfg.data.seq_length,
        "val_fraction": cfg.data.val_fraction,
        "seed": cfg.run.seed,
    }


def preflight(cfg: Config) -> Plan:
    """Every user mistake we can detect cheaply; identical on every rank."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(cfg.model.model_name)
    hf_config = AutoConfig.from_pretrained(model_dir)
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and cfg.data.seq_length > limit:
        raise UserError(f"--seq-length {cfg.data.seq_length} is above the model's limit "
                        f"(max_position_embeddings {limit})")
    dataset = load_text_dataset(cfg.data.dataset_name)
    fingerprint = run_fingerprint(cfg, model_dir, hf_config, dataset)
    state = read_state(cfg.run_dir)
    if state and not cfg.run.no_resume:
        check_fingerprint(cfg.run_dir, state["fingerprint"], fingerprint)
    else:  # a fresh start loads the base weights: their headers now, before any process waits on another
        read_index(model_dir)
    return Plan(model_dir, hf_config, dataset, fingerprint)
