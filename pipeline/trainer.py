"""The trainer: preflight checks, then one Trainer whose loop reads on one screen.

Order matters: every check that can fail on a user mistake runs first, on every rank, before the process group
does anything heavy (so every rank prints the same one line and exits). Then rank 0 of each node builds the token
cache, the model is built on meta, sharded and loaded, and the loop runs.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pipeline import config as config_mod
from pipeline.config import Config
from pipeline.data import (
    Blocks,
    BlockSampler,
    build_blocks,
    data_fingerprint,
    load_text_dataset,
    open_blocks,
    tokenizer_fingerprint,
)
from pipeline.errors import UserError
from pipeline.parallel import (
    Dist,
    build_mesh,
    compute_dtype,
    load_weights,
    materialize,
    shard_model,
)
from pipeline.telemetry import PhaseTimer, Telemetry, flops_per_token, log, memory_gb, peak_flops, setup_logging


@dataclass
class Plan:
    """What preflight resolved: everything later stages need, found without heavy work."""

    model_dir: Path
    hf_config: object
    dataset: object


def resolve_model_dir(model_name: str) -> Path:
    """A local model directory, or a hub id from the offline cache (never the network)."""
    local = Path(model_name)
    if local.is_dir():
        if not (local / "config.json").exists():
            raise UserError(f"--model-name {model_name} is a directory without config.json")
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_name, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        raise UserError(f"model {model_name} is not in the offline cache; on this machine run: "
                        f"python MODEL_DOWNLOAD.py --model-name {model_name} (add --source DIR if "
                        "offline)") from None


def preflight(cfg: Config) -> Plan:
    """Every user mistake we can detect cheaply; identical on every rank."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(cfg.model.model_name)
    hf_config = AutoConfig.from_pretrained(model_dir)
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and cfg.data.seq_length > limit:
        raise UserError(f"--seq-length {cfg.data.seq_length} is above the model's limit "
                        f"(max_position_embeddings {limit})")
    return Plan(model_dir, hf_config, load_text_dataset(cfg.data.dataset_name))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _broadcast_error(d: Dist, error: str | None) -> None:
    """Raise on every rank what one rank found (a collective: all ranks must reach it)."""
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise UserError(box[0])


def prepare_blocks(cfg: Config, plan: Plan, d: Dist, tokenizer) -> Blocks:
    """Rank 0 of each node builds the token cache while the others wait at a barrier; then all memory-map it."""
    fp = data_fingerprint(plan.dataset._fingerprint, tokenizer_fingerprint(plan.model_dir), cfg.data.seq_length,
                          cfg.data.val_fraction, cfg.run.seed)
    path = Path(cfg.run.save_dir) / "token_cache" / fp[:24]
    error = None
    if d.is_local_main and not (path / "meta.json").exists():
        log.info("building token cache %s", path)
        try:
            build_blocks(plan.dataset, tokenizer, cfg.data.seq_length, cfg.data.val_fraction, cfg.run.seed,
                         cfg.data.num_proc or os.cpu_count() or 1, path)
        except UserError as exc:
            error = str(exc)
    elif d.is_main:
        log.info("token cache hit: %s", path)
    _broadcast_error(d, error)
    blocks = open_blocks(path)
    global_batch = d.world_size * cfg.train.batch_size * cfg.train.grad_accum
    if len(blocks.train) < global_batch:
        raise UserError(f"the dataset gives {len(blocks.train)} training blocks of {cfg.data.seq_length} tokens, "
                        f"fewer than one global batch ({d.world_size} processes x batch {cfg.train.batch_size} x "
                        f"grad accum {cfg.train.grad_accum} = {global_batch}); use more data or a smaller "
                        "--seq-length, --batch-size or --grad-accum")
    return blocks


def build_model(cfg: Config, plan: Plan, d: Dist, dtype: torch.dtype) -> nn.Module:
    """Meta-device model, sharded with FSDP2, materialised shard by shard and loaded from safetensors."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plan.hf_config, dtype=torch.float32, attn_implementation="sdpa")
    shard_model(model, cfg.model, build_mesh(cfg.model.sharding, d), dtype)
    materialize(model, cfg.model, d.device)
    load_weights(model, plan.model_dir, d.device)
    return model


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with decay on matrices only; fused kernels where the device has them."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type == "cuda" and not cfg.model.cpu_offload
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.optim.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.optim.warmup_steps, num_training_steps=total_steps)


class Trainer:
    """Owns the model, optimizer, schedule, sampler and counters; its state is what a checkpoint holds."""

    def __init__(self, cfg: Config, d: Dist, plan: Plan):
        from transformers import AutoTokenizer

        self.cfg, self.dist = cfg, d
        self.run_dir = cfg.run_dir
        self.dtype = compute_dtype(cfg.model.precision, d.device)
        seed_everything(cfg.run.seed)
        tokenizer = AutoTokenizer.from_pretrained(plan.model_dir)
        if tokenizer.eos_token_id is None:
            raise UserError(f"the tokenizer of {cfg.model.model_name} has no EOS token to separate documents")
        self.blocks = prepare_blocks(cfg, plan, d, tokenizer)
        self.sampler = BlockSampler(len(self.blocks.train), cfg.run.seed, d.world_size, d.rank,
                                    cfg.train.batch_size, cfg.train.grad_accum)
        self.total_steps = cfg.train.max_steps or cfg.train.num_epochs * self.sampler.steps_per_epoch
        self.model = build_model(cfg, plan, d, self.dtype)
        self.optimizer = build_optimizer(self.model, cfg, d.device)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        self.step = 0
        self.timer = PhaseTimer(d.device)
        n_params = sum(p.numel() for p in self.model.parameters())
        n_embed = self.model.get_input_embeddings().weight.numel()
        self.flops_per_token = flops_per_token(plan.hf_config, n_params, n_embed, cfg.data.seq_length)
        self.peak = peak_flops(d.device)
        self.tokens_per_step = self.sampler.global_batch * cfg.data.seq_length
        log.info("model %s: %s parameters, %s compute, %s; %d train / %d val blocks of %d tokens; global batch "
                 "%d blocks; %d steps", type(self.model).__name__.removeprefix("FSDP"), f"{n_params:,}", self.dtype,
                 cfg.model.sharding, len(self.blocks.train), len(self.blocks.val), cfg.data.seq_length,
                 self.sampler.global_batch, self.total_steps)

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Counters, sampler and schedule (JSON-able); model and optimizer are saved through DCP beside it."""
        return {"step": self.step, "sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])

    # ------------------------------------------------------------------------------------------------- loop

    def fit(self) -> None:
        telemetry = Telemetry(self.run_dir, self.dist.is_main, self.total_steps, self.step)
        window_loss = torch.zeros((), device=self.dist.device)
        window_start, window_steps = time.perf_counter(), 0
        self.model.train()
        while self.step < self.total_steps:
            if not self.sampler.has_next():  # epoch boundary
                self.sampler.start_epoch(self.sampler.epoch + 1)
                continue
            loss, grad_norm = self.train_step()
            self.step += 1
            window_loss += loss
            window_steps += 1
            telemetry.advance()
            if self.step % self.cfg.train.log_freq == 0 or self.step == self.total_steps:
                self.log_window(telemetry, window_loss / window_steps, grad_norm,
                                time.perf_counter() - window_start, window_steps)
                window_loss.zero_()
                window_start, window_steps = time.perf_counter(), 0
            if self.cfg.train.eval_freq and self.step % self.cfg.train.eval_freq == 0 and self.step < self.total_steps:
                self.evaluate(telemetry)
        self.evaluate(telemetry)
        telemetry.close()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches. Returns (mean loss, grad norm) as device tensors."""
        micro = self.sampler.next_step()
        total = torch.zeros((), device=self.dist.device)
        with self.timer.phase("total"):
            for i, idx in enumerate(micro):
                with self.timer.phase("data"):
                    ids = torch.from_numpy(self.blocks.train[idx].astype(np.int64)).to(self.dist.device,
                                                                                        non_blocking=True)
                # reduce-scatter gradients only on the last micro-step; earlier ones accumulate locally
                self.model.set_requires_gradient_sync(i == len(micro) - 1)
                with self.timer.phase("forward"):
                    # every block is full, so each micro-batch has the same token count and the mean of the
                    # micro-batch means (and FSDP's mean over ranks) is the mean over all tokens
                    loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss / len(micro)
                with self.timer.phase("backward"):
                    loss.backward()
                total += loss.detach()
            with self.timer.phase("update"):
                max_norm = self.cfg.optim.max_grad_norm or math.inf
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        self.timer.step_done()
        return total, grad_norm

    def log_window(self, telemetry: Telemetry, loss: torch.Tensor, grad_norm: torch.Tensor, seconds: float,
                   steps: int) -> None:
        # collective + host sync, once per log window: every rank must reach it (SUM: gloo has no AVG)
        dist.all_reduce(loss)
        loss /= self.dist.world_size
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        tokens_per_s = self.tokens_per_step * steps / seconds
        mfu = (tokens_per_s / self.dist.world_size * self.flops_per_token / self.peak) if self.peak else None
        fields = {"epoch": self.sampler.epoch, "loss": round(loss.item(), 5),
                  "lr": self.scheduler.get_last_lr()[0], "grad_norm": round(norm.item(), 5),
                  "tokens_per_s": round(tokens_per_s, 1), "mfu": None if mfu is None else round(mfu, 4),
                  "time_ms": self.timer.read(), "mem_gb": memory_gb(self.dist.device)}
        telemetry.event("train", self.step, **fields)
        t = fields["time_ms"]
        telemetry.human({"global_step": self.step, "epoch": fields["epoch"], "loss": fields["loss"],
                         "lr": f"{fields['lr']:.3g}", "grad_norm": fields["grad_norm"],
                         "tok/s": round(tokens_per_s), "mfu": fields["mfu"], **{f"time/{k}": t[k] for k in t},
                         "mem/peak_alloc_gb": fields["mem_gb"]["peak_alloc"]})

    @torch.no_grad()
    def evaluate(self, telemetry: Telemetry) -> float | None:
        """Loss and perplexity over the whole validation split, its blocks dealt round-robin to the ranks."""
        val = self.blocks.val
        if len(val) == 0:
            return None
        self.model.eval()
        bs, world = self.cfg.train.batch_size, self.dist.world_size
        mine = np.arange(self.dist.rank, len(val), world)
        batches = math.ceil(math.ceil(len(val) / world) / bs)
        sums = torch.zeros(2, dtype=torch.float64, device=self.dist.device)
        for b in range(batches):
            idx = mine[b * bs:(b + 1) * bs]
            # every rank must run the same number of forwards (FSDP all-gathers inside): a rank out of blocks
            # runs block 0 with weight 0
            weight = 1.0 if len(idx) else 0.0
            idx = idx if len(idx) else np.array([0])
            ids = torch.from_numpy(val[idx].astype(np.int64)).to(self.dist.device)
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
            tokens = weight * len(idx) * (ids.shape[1] - 1)
            sums += torch.stack([loss.double() * tokens, torch.tensor(tokens, dtype=torch.float64,
                                                                        device=self.dist.device)])
        dist.all_reduce(sums)
        self.model.train()
        loss = (sums[0] / sums[1]).item()
        ppl = math.exp(loss) if loss < 700 else math.inf
        telemetry.event("eval", self.step, loss=round(loss, 5), ppl=round(ppl, 4))
        telemetry.human({"global_step": self.step, "eval_loss": round(loss, 5), "eval_ppl": round(ppl, 3)})
        return loss


def run(cfg: Config, d: Dist, plan: Plan) -> Trainer:
    """Set up the run directory and logs, then train."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(cfg.run_dir, d.rank)
    if d.is_main:
        config_mod.save(cfg, cfg.run_dir / "config.yaml")
        log.info("run directory %s (world size %d, device %s)", cfg.run_dir, d.world_size, d.device)
    trainer = Trainer(cfg, d, plan)
    trainer.fit()
    if d.is_main:
        log.info("done: metrics %s, plot %s, log %s", cfg.run_dir / "metrics.jsonl", cfg.run_dir / "loss.png",
                 cfg.run_dir / "train.log")
    return trainer


def main(argv: list[str] | None = None) -> int:
    """fsdp1.py: resolve the config, check everything cheap, then join the process group and train."""
    from pipeline.parallel import init_distributed

    cfg = config_mod.resolve(argv)
    plan = preflight(cfg)
    d = init_distributed()
    try:
        run(cfg, d, plan)
    finally:
        dist.destroy_process_group()
    return 0
