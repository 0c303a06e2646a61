"""Preflight: every user mistake that can be found cheaply, found before any process joins a group or loads weights.

It runs identically on every rank (no collective), so each rank prints the same one line and exits; what it
resolves (the model folder, its config, the dataset, the run's fingerprint) is the Plan the trainer builds on.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.config import Config, ModelConfig
from pipeline.data.dataset import (
    BlockSpec,
    conversation_rows,
    dataset_fingerprint,
    load_text_dataset,
    preference_rows,
    prompt_rows,
    size_fingerprint,
    tokenizer_fingerprint,
)
from pipeline.data.sources import Source, parse_sources
from pipeline.distributed.launch import Launch
from pipeline.errors import UserError
from pipeline.eval.samples import Prompt, read_prompts
from pipeline.model.adapters import chosen_targets
from pipeline.model.modeling import cannot_train, meta_model
from pipeline.model.reward_head import RewardHead
from pipeline.model.router import RouterBalance, balancing_coef
from pipeline.model.tiled_mlp import TiledMLP
from pipeline.model.weight_check import WeightCheck, read_line, unchanged_weights, weights_digest
from pipeline.model.weight_files import read_index
from pipeline.objectives.kinds import Kind, kind_of
from pipeline.objectives.plans import ReferencePlan, check_data, plan_reference
from pipeline.ownership import check_apart, check_not_nested, check_target
from pipeline.prep.hub import resolve_model_dir
from pipeline.rl.rewards import Rewards
from pipeline.rl.tools import Tools
from pipeline.strategies import sequence_parallel
from pipeline.strategies.auto import MemoryPlan, plan_memory
from pipeline.train.checkpoint import read_state
from pipeline.train.export import check_replaceable, run_exports
from pipeline.train.trackers import check_installed


@dataclass
class DataSource:
    """One dataset of the run, loaded."""

    source: Source
    dataset: object
    fingerprint: str
    """dataset_fingerprint of its contents: the key of its token cache."""


@dataclass
class Plan:
    """What preflight resolved: everything later stages need, found without heavy work."""

    model_dir: Path
    hf_config: object
    data: list[DataSource]
    """The datasets -d names: one, or a mixture's sources in the order given."""
    tokenizer: object
    """The model's tokenizer, its chat template replaced by --chat-template when given."""
    spec: BlockSpec
    fingerprint: dict
    memory: MemoryPlan
    """--strategy auto resolved, and the estimated peak memory per rank."""
    prompts: list[Prompt] = field(default_factory=list)
    """--sample-prompts, tokenized."""
    reference: ReferencePlan | None = None
    """dpo, ipo without adapters or with --reference-model: the model whose log-probabilities are computed before
    the first step (pipeline/objectives/reference_pass.py)."""
    reward_head: RewardHead | None = None
    """reward: the transform that makes the model a reward model (pipeline/model/reward_head.py)."""
    rewards: Rewards | None = None
    """grpo: the reward functions, loaded (pipeline/rl/rewards.py)."""
    tools: Tools | None = None
    """grpo --tools: the functions offered to the model, loaded (pipeline/rl/tools.py)."""

    @property
    def mixture(self) -> bool:
        return len(self.data) > 1

    @property
    def config(self) -> Config:
        """The run's config, --strategy auto resolved (the memory plan's)."""
        return self.memory.config


def run_fingerprint(cfg: Config, model_dir: Path, hf_config, data: list[DataSource], spec: BlockSpec) -> dict:
    """What defines the run: the one definition of the resume guard, which refuses a rerun that changes any of these
    fields (epochs, steps and frequencies may change between reruns). A field added here is guarded. A mixture's
    dataset is each source's name, contents and weight (another weight is another run)."""
    conf = {k: v for k, v in hf_config.to_dict().items() if k not in ("transformers_version", "_name_or_path")}
    dataset = data[0].fingerprint if len(data) == 1 else ",".join(
        f"{d.source.name}={d.fingerprint}:{d.source.weight!r}" for d in data)
    return {
        "model_name": cfg.model.model_name,
        "model_config": hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "tokenizer": tokenizer_fingerprint(model_dir)[:16],
        "dataset": dataset,
        **spec.key(),
        **({"adapter": adapter_settings(cfg.model)} if cfg.model.adapter != "none" else {}),
    }


def adapter_settings(m: ModelConfig) -> dict:
    """What defines an adapter run's adapters: guarded on resume, and what pipeline.export rebuilds them from (a
    full fine-tuning run's fingerprint has no such field, so runs from before adapters existed still resume)."""
    return {"adapter": m.adapter, "lora_rank": m.lora_rank, "lora_alpha": m.lora_alpha,
            "lora_dropout": m.lora_dropout, "lora_targets": m.lora_targets}


def check_fingerprint(run_dir: Path, saved: dict, current: dict, older: dict | None = None,
                      kind: Kind | None = None) -> None:
    """The resume guard: every field of either fingerprint must be unchanged, or the rerun would silently train
    something else. older: a field's value as an earlier version of this code computed it for the same input,
    also accepted (the run's next checkpoint records the current one). kind: the run's objective, which words the
    line for a field of its own."""
    older, kind = older or {}, kind or Kind()
    for key in [*current, *(k for k in saved if k not in current)]:
        if saved.get(key) not in (current.get(key), older.get(key, current.get(key))):
            if key == "reference_weights":
                raise UserError(f"refusing to resume {run_dir}: it was trained against a reference with weights "
                                f"{saved[key][:16]}..., and the reference's weights now are {current[key][:16]}...; "
                                "restore them, or pass --no-resume to start a new run against this reference")
            if key == "base_weights":
                raise UserError(f"refusing to resume {run_dir}: its adapters were trained on base model "
                                f"{current['model_name']} with weights {saved[key][:16]}..., and the weights there "
                                f"now are {current[key][:16]}... (another model, or changed ones); restore the base "
                                "it was trained on, or pass --no-resume to train new adapters on this one")
            if line := kind.changed(run_dir, key, saved, current):
                raise UserError(line)
            raise UserError(f"refusing to resume {run_dir}: {key} was {saved.get(key)!r} and is now "
                            f"{current.get(key)!r}; rerun with the original value, or pass --no-resume to start a "
                            "new run beside it")


def load_tokenizer(cfg: Config, model_dir: Path, chats: bool):
    """The model's tokenizer; with conversations to train on, one with a chat template (the model's own, or
    --chat-template's), else the one-line fix."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer of {cfg.model.model_name} has no EOS token to separate documents")
    if cfg.data.chat_template:
        tokenizer.chat_template = Path(cfg.data.chat_template).read_text(encoding="utf-8")
    if chats and not tokenizer.chat_template:
        raise UserError(f"{cfg.data.dataset_name} holds conversations but {cfg.model.model_name} has no chat template "
                        "to render them; use its Instruct version, or pass --chat-template FILE.jinja (the "
                        "template is exported with the model)")
    if chats and not tokenizer.is_fast:
        raise UserError(f"the tokenizer of {cfg.model.model_name} is not a fast tokenizer (no tokenizer.json): "
                        "conversations need its character offsets to find the assistant turns")
    return tokenizer


def check_base_weights(cfg: Config, model_dir: Path) -> WeightCheck:
    """Weights whose content changed since they were checked (MODEL_DOWNLOAD, or this check on a first start): one
    line. Every rank checks (no process group yet); a file needing a read is read by each rank of a node at once,
    from one page cache. The first rank says what the read cost."""
    check = unchanged_weights(model_dir, cfg.model.model_name)
    if check.read and os.environ.get("RANK", "0") == "0":
        print(read_line(check), file=sys.stderr, flush=True)
    return check


def resolve_inputs(cfg: Config, launch: Launch | None = None) -> Plan:
    """The model, its tokenizer and the dataset as the config names them, the blocks' spec and the run's fingerprint,
    with every cheap check of them; no run folder is read. Identical on every rank. What pipeline.evaluate plans
    with too (the same token cache as training)."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(cfg.model.model_name)
    hf_config = AutoConfig.from_pretrained(model_dir)
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and cfg.data.seq_length > limit:
        raise UserError(f"--seq-length {cfg.data.seq_length} is above the model's limit "
                        f"(max_position_embeddings {limit})")
    if why := cannot_train(hf_config):
        raise UserError(f"--model-name {cfg.model.model_name}: {why}")
    kind = kind_of(cfg)
    layout = kind.check_model(cfg, hf_config)
    check_model_changes(cfg, hf_config)
    data = load_sources(cfg)
    chats = any(bool(conversation_rows(d.dataset).any()) for d in data)
    tokenizer = load_tokenizer(cfg, model_dir, chats)
    spec = BlockSpec(cfg.data.seq_length, cfg.data.val_fraction, cfg.run.seed, chats, cfg.data.train_on,
                     cfg.data.chat_date, cfg.data.chat_template and tokenizer.chat_template, cfg.data.document_mask,
                     cfg.data.allow_special_tokens_in_data, pairs=cfg.objective.preference,
                     kto=cfg.objective.unpairs, train_reasoning=cfg.data.train_on_reasoning)
    objective = kind.resolve(cfg, hf_config, tokenizer, data, layout)
    fingerprint = {**run_fingerprint(cfg, model_dir, hf_config, data, spec), **objective.fingerprint}
    # answers scored through the model's own head: completions generated (their log-probabilities per token), or
    # answers whose rows sequence parallelism splits (scored whole from the gathered rows: token_logps)
    if cfg.model.vocab_parallel == "auto" and (cfg.objective.generates or (
            cfg.model.sequence_parallel > 1 and cfg.objective.scores_answers)):
        cfg.model.vocab_parallel = "off"
    check_cache_root(cfg, inputs(cfg, model_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    memory = plan_memory(cfg, hf_config, device, launch, objective.resident_params)
    return Plan(model_dir, hf_config, data, tokenizer, spec, fingerprint, memory,
                reward_head=kind.reward_head(cfg, hf_config, tokenizer, layout), rewards=objective.rewards,
                tools=objective.tools)


def check_model_changes(cfg: Config, hf_config) -> None:
    """What the config asks of the model, tried on one meta-device build before any weight is read, each refusal
    one line: a kernel the family refuses, --lora-targets naming no linear layer, --tiled-mlp on a mixture of
    experts, a balancing-loss coefficient for a family without one (or a dense model), an attention
    --sequence-parallel cannot split."""
    m = cfg.model
    if m.attn_implementation == "auto" and m.adapter == "none" and m.tiled_mlp == "off" and \
            m.router_aux_loss_coef <= 0 and m.sequence_parallel == 1:
        return
    model = meta_model(hf_config, attn_implementation=m.attn_implementation)
    if m.adapter != "none":  # reads the model only: before the changes below
        chosen_targets(model, m)
    if m.tiled_mlp == "on":
        TiledMLP().apply(model)
    if m.router_aux_loss_coef > 0:
        RouterBalance(m).apply(model)
    if m.sequence_parallel > 1:
        sequence_parallel.refuse(model, m.sequence_parallel)
        if coef := balancing_coef(m, model.config):  # transformers' balancing loss: a product of means over tokens
            raise UserError(f"--sequence-parallel {m.sequence_parallel}: {model.config.model_type}'s load-balancing "
                            f"loss (coefficient {coef:g}) is defined over whole sequences and each rank would "
                            "see a slice; use --router-aux-loss-coef 0, or --sequence-parallel 1")


def load_sources(cfg: Config) -> list[DataSource]:
    """The datasets -d names, loaded and fingerprinted, and the objective checked against them: a mixture trains
    text and conversations (a preference objective's reference pass and pair blocks take one dataset)."""
    sources = parse_sources(cfg.data.dataset_name)
    data = [DataSource(s, ds := load_text_dataset(s.path), dataset_fingerprint(ds)) for s in sources]
    held: dict[str, str] = {}
    for d in data:  # one folder under two names (a symlink, a copy) would train as two sources at twice its weight
        if d.fingerprint in held:
            raise UserError(f"--dataset-name: {d.source.path} and {held[d.fingerprint]} hold the same dataset (one "
                            "fingerprint); a mixture names each dataset once, with one weight")
        held[d.fingerprint] = d.source.path
    counts = [preference_rows(d.dataset) for d in data]
    pairs, unpaired = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if len(data) > 1 and (pairs or unpaired or cfg.objective.preference):
        raise UserError(f"--dataset-name {cfg.data.dataset_name} mixes datasets for a preference objective or of "
                        "preference pairs: a mixture trains text and conversations with --objective sft; train pairs "
                        "from one dataset")
    check_data(cfg, pairs, unpaired, sum(prompt_rows(d.dataset) for d in data))
    return data


def inputs(cfg: Config, model_dir: Path) -> list[tuple[Path, str]]:
    """The folders a run reads, which no output of it may hold or sit in: the model and the local datasets."""
    found = [(model_dir, "the model folder")]
    if cfg.data.dataset_name:
        found += [(Path(s.path), "--dataset-name") for s in parse_sources(cfg.data.dataset_name)
                  if Path(s.path).exists()]
    return found


def check_cache_root(cfg: Config, read: list[tuple[Path, str]]) -> None:
    """The token cache's folder is one, or new, and apart from what the run reads (pipeline/ownership.py)."""
    flag = "--cache-dir" if cfg.data.cache_dir else "the token cache folder"
    check_target(cfg.cache_root, "token_cache", flag, "pass --cache-dir with a folder of its own")
    check_not_nested(cfg.cache_root, "token_cache", flag)
    check_apart(cfg.cache_root, flag, read, "a later run would read the cache back as input")


RUN_HINT = "give this run another --experiment-name or --save-dir"


RUN_FILE_BYTES = 128
"""How much longer than the run folder's path the longest path a run writes is allowed to be (the longest today,
`.best.partial/model.safetensors.index.json` or a checkpoint's shard, is under 50): room for what comes."""


def check_run_folder(cfg: Config) -> None:
    """The run folder is a run's, or new, in no folder of another kind, and short enough for every file a run writes
    under it: refused in one line before anything is written (pipeline/ownership.py)."""
    check_path_room(cfg.run_dir)  # first: the others look at the folder, which a path past the limit cannot name
    check_target(cfg.run_dir, "run", "the run folder", RUN_HINT)
    check_not_nested(cfg.run_dir, "run", "the run folder")


def named_and_exists(path: Path) -> bool:
    """Path.exists, False for a path past the system's limit (stat fails with ENAMETOOLONG: Python 3.11 raises it)."""
    try:
        return path.exists()
    except OSError:
        return False


def check_path_room(run_dir: Path) -> None:
    """The system's longest path (PATH_MAX, of the folder's nearest existing ancestor) leaves RUN_FILE_BYTES under
    the run folder: else the run would train, checkpoint, then fail to export (ENAMETOOLONG) hours later."""
    full = Path(os.path.abspath(run_dir))
    existing = next(p for p in (full, *full.parents) if named_and_exists(p))
    limit = os.pathconf(existing, "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
    size = len(os.fsencode(full))
    if size + RUN_FILE_BYTES >= limit:
        raise UserError(f"the run folder's path is {size} bytes long ({str(full)[:60]}...): the files a run writes "
                        f"under it would pass this system's limit of {limit} bytes a path; use a shorter --save-dir")


def preflight(cfg: Config, launch: Launch | None = None) -> Plan:
    """Every user mistake we can detect cheaply; identical on every rank. launch: the workers' launch, for a
    parent that checks before it starts them (else this process's own)."""
    check_run_folder(cfg)
    check_installed(cfg.run.report_to)
    plan = resolve_inputs(cfg, launch)
    check_apart(cfg.run_dir, "the run folder", inputs(cfg, plan.model_dir), RUN_HINT)
    if cfg.train.sample_prompts:
        plan.prompts = read_prompts(Path(cfg.train.sample_prompts), plan.tokenizer, cfg.data.chat_date,
                                    cfg.data.seq_length, cfg.train.sample_max_tokens)
    exports = {**run_exports(cfg), **(run_exports(cfg, best=True) if cfg.run.save_best else {})}
    for folder in exports:  # what the run replaces at its end: refused now
        check_replaceable(cfg.run_dir / folder, f"the run's export folder {folder}/:")
    state, check = read_state(cfg.run_dir), None
    if not state or cfg.run.no_resume or cfg.model.adapter != "none":
        # the base weights are read (a fresh start; every start of an adapter run): their headers and content now,
        # before any process waits on another
        read_index(plan.model_dir)
        check = check_base_weights(cfg, plan.model_dir)
        if cfg.model.adapter != "none":  # the adapters are trained on these weights: a resume must find them again
            plan.fingerprint["base_weights"] = weights_digest(check)
    plan.reference = plan_reference(cfg, plan.model_dir, plan.hf_config, plan.tokenizer,
                                    lambda: check or check_base_weights(cfg, plan.model_dir))
    if plan.reference is not None:  # a resume against another reference would compare with other log-probabilities
        plan.fingerprint["reference_weights"] = plan.reference.weights
    if state and not cfg.run.no_resume:
        # runs from before a field existed resume: their dataset by sizes, adapter runs without base_weights
        older = {"dataset": size_fingerprint(plan.data[0].dataset)} if not plan.mixture else {}
        check_fingerprint(cfg.run_dir, state["fingerprint"], plan.fingerprint, {**older, "base_weights": None},
                          kind_of(cfg))
    return plan
