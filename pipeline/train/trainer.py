"""The trainer: one Trainer whose loop reads on one screen, and fsdp1.py's main.

Order matters: preflight (pipeline/train/preflight.py) runs first, on every rank, before the process group does anything
heavy. Then rank 0 of each node builds the token cache under a file lock while the others poll for it (no
collective, so no timeout however long it takes), the strategy builds and distributes the model, a
checkpoint (or, on a fresh start, the base weights) fills it, and the loop runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pipeline import config as config_mod
from pipeline.config import VOCAB_PARALLEL_SHARDINGS, Config
from pipeline.data.batches import Batch, count_targets, make_batch
from pipeline.data.sampler import BlockSampler
from pipeline.data.token_cache import Blocks, ensure_token_cache, open_blocks, token_cache_dir
from pipeline.dist.launch import Launch
from pipeline.dist.launch import detect as detect_launch
from pipeline.dist.liveness import PeerWatch, is_collective_failure, watch_parent
from pipeline.dist.runtime import Dist, check_shared_dir, compute_dtype, init_distributed
from pipeline.errors import UserError
from pipeline.fsutil import write_text_atomic
from pipeline.strategies import ignored_knobs, make_strategy
from pipeline.train.checkpoint import Checkpointer, step_name
from pipeline.train.export import RUN_TEMPLATE, export_dtype, export_model
from pipeline.train.preflight import Plan, preflight
from pipeline.train.telemetry import (
    GIB,
    PhaseTimer,
    Telemetry,
    flops_per_token,
    log,
    memory_gb,
    memory_in_use,
    peak_flops,
    reset_peak_memory,
    setup_logging,
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cache_path(cfg: Config, plan: Plan) -> Path:
    root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.run.save_dir) / "token_cache"
    return token_cache_dir(root, plan.fingerprint["dataset"], plan.model_dir, plan.spec)


def ensure_blocks(cfg: Config, plan: Plan, builder: bool) -> tuple[str, Path]:
    """The token cache of this run's data: ("hit" | "built" | "waited", its path). The builder (one process per
    node) builds it under a file lock; the others poll for it. No collective, so no timeout however long it takes."""
    path = cache_path(cfg, plan)
    status = ensure_token_cache(plan.dataset, plan.tokenizer, plan.spec, cfg.data.num_proc or os.cpu_count() or 1,
                                path, builder)
    return status, path


def prepare_blocks(cfg: Config, plan: Plan, d: Dist) -> Blocks:
    """Every rank memory-maps the token cache its node's first rank built (or found)."""
    status, path = ensure_blocks(cfg, plan, d.is_local_main)
    if d.is_main:
        log.info("token cache %s: %s", status, path)
        log_cache_meta(path)
    blocks = open_blocks(path)
    global_batch = d.world_size * cfg.train.batch_size * cfg.train.grad_accum
    if len(blocks.train) < global_batch:
        raise UserError(f"the dataset gives {len(blocks.train)} training blocks of {cfg.data.seq_length} tokens, "
                        f"fewer than one global batch ({d.world_size} processes x batch {cfg.train.batch_size} x "
                        f"grad accum {cfg.train.grad_accum} = {global_batch}); use more data or a smaller "
                        "--seq-length, --batch-size or --grad-accum")
    return blocks


def prepare_only(cfg: Config, plan: Plan, launch: Launch) -> int:
    """--prepare-only: the token cache and nothing else (no process group, no GPU)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    builder = launch.local_rank == 0
    status, path = ensure_blocks(cfg, plan, builder)
    meta = json.loads((path / "meta.json").read_text())
    if builder:
        print(f"token cache {status}: {path}: {meta['train_blocks']} training and {meta['val_blocks']} validation "
              f"blocks of {meta['seq_length']} tokens; the same command without --prepare-only trains on it",
              flush=True)
    return 0


def log_cache_meta(path: Path) -> None:
    """What the cache holds: conversations kept, truncated and dropped, and the share of tokens trained."""
    meta = json.loads((path / "meta.json").read_text())
    if "conversations" in meta:
        counts = ", ".join(f"{k} {v}" for k, v in meta["conversations"].items() if v)
        log.info("conversations: %s; %d blocks of them, %d of text", counts, meta["chat_blocks"], meta["text_blocks"])
    if meta.get("flags"):
        total = meta["blocks"] * (meta["seq_length"] - 1)
        log.info("%d of %d tokens (%.1f%%) are targets of the loss", meta["targets"], total,
                 100 * meta["targets"] / max(total, 1))


def build_optimizer(groups: list[dict], cfg: Config) -> torch.optim.Optimizer:
    """AdamW over the strategy's parameter groups (decay on matrices only); fused kernels (CUDA, and CPU: 3x faster
    there than the default loop)."""
    # with CPU offload the shards live on the host: the CPU kernel runs
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.optim.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.optim.warmup_steps, num_training_steps=total_steps)


@dataclass
class StepResult:
    loss: float
    """Mean over every rank's tokens."""
    grad_norm: float
    """Global norm before clipping."""
    applied: bool
    """False when the loss or gradient norm was not finite on some rank: the update was skipped."""
    targets: int
    """Tokens in the loss this step, over every rank."""


@dataclass
class Window:
    """What the steps since the last log line add up to."""

    steps: int = 0
    applied: int = 0
    loss: float = 0.0
    """Sum of the applied steps' losses."""
    grad_norm: float = math.nan
    """The last applied step's."""
    targets: int = 0
    """Tokens in the loss, over every rank."""
    started: float = field(default_factory=time.perf_counter)

    def add(self, result: StepResult) -> None:
        self.steps += 1
        self.targets += result.targets
        if result.applied:
            self.applied += 1
            self.loss += result.loss
            self.grad_norm = result.grad_norm

    def seconds(self) -> float:
        return time.perf_counter() - self.started


def finite_or_text(x: float) -> float | str:
    """x, or "nan"/"inf" as text: JSON has no non-finite numbers."""
    return x if math.isfinite(x) else str(x)


class Interrupted(Exception):
    """SIGTERM/SIGINT: a checkpoint was saved and the run stopped cleanly."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """Set by the signal handler; acted on at the next step boundary, where all ranks agree on it."""

    signum = 0

    @classmethod
    def install(cls) -> None:
        def handler(signum, _frame):
            cls.signum = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)


class Trainer:
    """Owns the model, optimizer, schedule, sampler and counters; its state is what a checkpoint holds."""

    def __init__(self, cfg: Config, d: Dist, plan: Plan):
        self.cfg, self.dist, self.plan = cfg, d, plan
        self.run_dir = cfg.run_dir
        self.dtype = compute_dtype(cfg.model.precision, d.device)
        seed_everything(cfg.run.seed)
        self.blocks = prepare_blocks(cfg, plan, d)
        self.sampler = BlockSampler(len(self.blocks.train), cfg.run.seed, d.world_size, d.rank,
                                    cfg.train.batch_size, cfg.train.grad_accum)
        self.total_steps = cfg.train.max_steps or cfg.train.num_epochs * self.sampler.steps_per_epoch
        self.strategy = make_strategy(cfg.model, d, self.dtype)
        if d.is_main:
            self.log_plan()
        # what the process holds before the model exists: the estimate covers what comes above it
        self.memory_base = memory_in_use(d.device)
        reset_peak_memory(d.device)
        self.model = self.strategy.build(plan.hf_config)
        self.loss = self.strategy.loss()
        self.optimizer = build_optimizer(self.strategy.param_groups(cfg.optim.weight_decay), cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        self.step, self.samples_seen, self.best_val = 0, 0, math.inf
        self.bad_steps, self.skipped_since_save = 0, 0
        self.timer = PhaseTimer(d.device)
        self.flops_per_token = flops_per_token(plan.hf_config, self.strategy.num_matmul_params, cfg.data.seq_length)
        self.peak = peak_flops(d.device)
        async_ckpt = cfg.run.async_ckpt == "on" or (cfg.run.async_ckpt == "auto" and d.device.type == "cuda")
        self.ckpt = Checkpointer(self.run_dir, d, cfg.train.keep_last, async_ckpt, plan.fingerprint)
        self.resumed_from = self.resume()
        log.info("model %s: %s parameters, %s compute, %s %s; %d train / %d val blocks of %d tokens; global batch "
                 "%d blocks; step %d of %d", type(self.strategy.module).__name__, f"{self.strategy.num_params:,}",
                 self.dtype, cfg.model.strategy, cfg.model.sharding, len(self.blocks.train), len(self.blocks.val),
                 cfg.data.seq_length, self.sampler.global_batch, self.step, self.total_steps)

    def log_plan(self) -> None:
        """Rank 0: the strategy (and why, when auto chose it), knobs it ignores, and the memory estimate."""
        mem, cfg = self.plan.memory, self.cfg.model
        if mem.reason:
            log.info("--strategy auto chose %s", mem.reason)
        if ignored := ignored_knobs(cfg):
            log.warning("%s: no effect under --strategy %s", ", ".join(ignored), cfg.strategy)
        log.info("estimated peak memory per rank: %s; budget %.2f GiB", mem.estimate.describe(), mem.budget / GIB)
        if mem.estimate.total > mem.budget:
            log.warning("the estimate is above the budget: if a step runs out of memory, %s",
                        out_of_memory_hints(self.cfg))

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Counters, sampler and schedule (JSON); model and optimizer are saved through DCP beside it."""
        return {"step": self.step, "samples_seen": self.samples_seen, "best_val": self.best_val,
                "sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.best_val = float(state["best_val"])
        self.sampler.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rescale_lr(float(state["scheduler"]["base_lrs"][0]))
        old, new = state["sampler"]["global_batch"], self.sampler.global_batch
        if old != new and self.dist.is_main:
            log.warning("global batch changed from %d to %d blocks: continuing from the next unseen block "
                        "(%d consumed in epoch %d)", old, new, self.sampler.consumed, self.sampler.epoch)

    def rescale_lr(self, saved: float) -> None:
        """--lr changed since the checkpoint (say, lowered after a divergence): the schedule goes on from this step
        with the new peak. Every schedule here is the peak times a factor of the step, so scaling is exact."""
        factor = self.cfg.optim.lr / saved
        if math.isclose(factor, 1.0, rel_tol=1e-9):
            return
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
            group["initial_lr"] *= factor
        if self.dist.is_main:
            log.warning("--lr changed from %g to %g: the schedule continues at step %d with the new peak", saved,
                        self.cfg.optim.lr, self.step)

    def resume(self) -> dict | None:
        """Fill the model: from the newest complete checkpoint (or --resume-from), verified file by file, without
        opening the base model's weights; else from the base model. Collective."""
        if self.dist.is_main:
            for name in self.ckpt.incomplete():
                log.warning("ignoring incomplete checkpoint %s (removed once a newer one is complete)", name)
        path = self.ckpt.choose(self.cfg.run.resume_from)
        started = time.perf_counter()
        if path is None:
            self.strategy.load_weights(self.plan.model_dir)
            log.info("loaded the base weights from %s in %.2f s", self.plan.model_dir, time.perf_counter() - started)
            return None
        self.ckpt.verify(path)
        self.load_state_dict(self.ckpt.load(path, self.strategy, self.optimizer))
        seconds = time.perf_counter() - started
        log.info("resumed from %s at step %d (epoch %d) in %.2f s", path, self.step, self.sampler.epoch, seconds)
        return {"from_step": self.step, "path": str(path), "seconds": round(seconds, 3)}

    def save(self, sync: bool = False) -> bool:
        """Checkpoint this step, unless it is saved already or its update was skipped (non-finite): a checkpoint is
        only ever written from a step that was applied. Returns whether this step is (being) saved."""
        if self.bad_steps:
            if self.dist.is_main:
                log.warning("no checkpoint at step %d: its update was skipped (non-finite loss or gradient norm)",
                            self.step)
            return False
        if self.ckpt.last_step != self.step:
            self.ckpt.save(self.step, self.strategy, self.optimizer, self.state_dict(),
                           {"epoch": self.sampler.epoch, "samples_seen": self.samples_seen,
                            "skipped_steps": self.skipped_since_save}, sync=sync)
            self.skipped_since_save = 0
        return True

    # ------------------------------------------------------------------------------------------------- loop

    def fit(self) -> None:
        if self.step >= self.total_steps and (self.run_dir / "hf").exists():
            log.info("run already complete at step %d: %s", self.step, self.run_dir / "hf")
            return
        telemetry = Telemetry(self.run_dir, self.dist.is_main, self.total_steps, self.step)
        self.ckpt.listener = lambda step, fields: telemetry.event("checkpoint", step, **fields)
        if self.resumed_from:
            telemetry.event("resume", self.step, **self.resumed_from)
        mem = self.plan.memory
        telemetry.event("memory", self.step, strategy=self.cfg.model.strategy, sharding=self.cfg.model.sharding,
                        estimate_gb=mem.estimate.gib(), budget_gb=round(mem.budget / GIB, 3))
        try:
            self.loop(telemetry)
        finally:
            telemetry.close(plot=False)  # a no-op after a clean end; on an error, ends the bar before the message
        log.info("exported the model to %s", self.run_dir / "hf")

    def loop(self, telemetry: Telemetry) -> None:
        window = Window()
        self.model.train()
        while self.step < self.total_steps:
            if self.boundary():
                self.stop(telemetry)
            if not self.sampler.has_next():  # epoch boundary: checkpoint the start of the next epoch
                self.sampler.start_epoch(self.sampler.epoch + 1)
                self.save()
                continue
            result = self.train_step()
            self.step += 1
            self.samples_seen += self.sampler.global_batch
            telemetry.advance()
            window.add(result)
            if result.applied:
                self.bad_steps = 0
            else:
                self.skipped(telemetry, result)
            if self.step % self.cfg.train.log_freq == 0 or self.step == self.total_steps:
                self.log_window(telemetry, window)
                window = Window()
            if self.cfg.train.eval_freq and self.step % self.cfg.train.eval_freq == 0 and self.step < self.total_steps:
                self.evaluate(telemetry)
            if self.cfg.train.ckpt_freq and self.step % self.cfg.train.ckpt_freq == 0:
                self.save()
        self.evaluate(telemetry)
        self.save()
        self.ckpt.wait()
        export_model(self.strategy, self.plan.model_dir, self.run_dir / "hf",
                     export_dtype(self.cfg.run.export_dtype, self.plan.hf_config), self.dist,
                     self.plan.spec.chat_template)
        telemetry.close()

    def boundary(self) -> bool:
        """One small all-reduce per step: did any rank get a signal, and has every rank finished its async save?"""
        flags = torch.tensor([float(StopRequest.signum != 0), float(self.ckpt.in_flight())])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # CPU tensor: gloo, no device sync
        self.ckpt.finish_if_done(all_done=flags[1].item() == 0)
        return bool(flags[0].item())

    def stop(self, telemetry: Telemetry) -> None:
        saved = self.save(sync=True)
        self.ckpt.wait()
        telemetry.close()  # plots what the run has so far
        where = f"checkpoint {self.ckpt.root / step_name(self.step)} saved" if saved else \
            f"the last good checkpoint is {self.last_checkpoint()}"
        log.warning("stopped by signal at step %d; %s; rerun the same command to resume", self.step, where)
        raise Interrupted(StopRequest.signum or signal.SIGTERM)

    def last_checkpoint(self) -> str:
        newest = self.ckpt.newest()
        return str(newest) if newest else "none (a rerun starts from the base model)"

    def skipped(self, telemetry: Telemetry, result: StepResult) -> None:
        """A step whose loss or gradient norm was not finite on some rank: nothing was applied. Logged; after
        --max-bad-steps in a row the run stops (it has diverged, and going on would only burn GPU hours)."""
        self.bad_steps += 1
        self.skipped_since_save += 1
        figures = {"loss": finite_or_text(result.loss), "grad_norm": finite_or_text(result.grad_norm)}
        telemetry.event("skipped", self.step, in_a_row=self.bad_steps, **figures)
        if self.dist.is_main:  # the figures are global: the same on every rank
            log.warning("step %d skipped: loss %s, grad norm %s; weights, optimizer state and LR schedule "
                        "unchanged (%d in a row)", self.step, figures["loss"], figures["grad_norm"], self.bad_steps)
        limit = self.cfg.train.max_bad_steps
        if limit and self.bad_steps >= limit:
            self.ckpt.wait()
            telemetry.close()
            raise UserError(
                f"training diverged: steps {self.step - self.bad_steps + 1}-{self.step} had a non-finite loss or "
                f"gradient norm (last: loss {figures['loss']}, grad norm {figures['grad_norm']}) and were skipped; "
                f"the last good checkpoint is {self.last_checkpoint()}; try a lower --lr (now {self.cfg.optim.lr:g}),"
                f" --precision fp32 or a smaller --max-grad-norm (now {self.cfg.optim.max_grad_norm:g}), then rerun "
                "to resume from it")

    def train_step(self) -> StepResult:
        """One optimizer step over grad_accum micro-batches, applied only when the loss and gradient norm are finite
        on every rank."""
        # the step's targets over every rank and micro-step, from the global permutation: no communication
        targets = self.count_targets(self.sampler.upcoming())
        micro = self.sampler.next_step()
        self.strategy.comm_seconds()  # time_ms.comm counts this step's collectives, not evaluation's or a save's
        total = torch.zeros((), device=self.dist.device)
        with self.timer.phase("total"):
            for i, idx in enumerate(micro):
                with self.timer.phase("data"):
                    batch = self.batch(self.blocks.train, self.blocks.train_flags, idx)
                # reduce gradients only on the last micro-step; earlier ones accumulate locally
                with self.strategy.gradient_sync(i == len(micro) - 1):
                    with self.timer.phase("forward"):
                        # each micro-batch's summed loss over the whole step's targets: their sum is the token mean
                        loss = self.loss(batch, targets)
                    with self.timer.phase("backward"):
                        loss.backward()
                total += loss.detach()
            with self.timer.phase("update"):
                norm = self.strategy.clip_grad_norm(self.cfg.optim.max_grad_norm or math.inf)
                result = self.agree(total, norm, targets)
                if result.applied:
                    self.ckpt.staged()  # an async checkpoint's copy of the weights and states must be complete
                    self.optimizer.step()
                    self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        comm = self.strategy.comm_seconds()
        if comm is not None:
            self.timer.add("comm", comm * 1000)
        self.timer.step_done()
        return result

    def agree(self, loss: torch.Tensor, norm: torch.Tensor, targets: int) -> StepResult:
        """The step's global mean loss and gradient norm, and whether to apply it: one all-reduce (every rank must
        reach it) and one host sync per step, since every rank must take the same decision before stepping. A
        non-finite value on any rank makes the sum non-finite everywhere."""
        figures = torch.stack([loss.float(), norm.float().to(loss.device)])
        summed = figures.clone()
        dist.all_reduce(summed)  # SUM: gloo has no AVG
        mean_loss, total_norm, local_norm = torch.cat([summed, figures[1:]]).tolist()
        applied = math.isfinite(mean_loss) and math.isfinite(total_norm)
        return StepResult(mean_loss / self.dist.world_size, local_norm if applied else total_norm, applied, targets)

    def count_targets(self, idx: np.ndarray) -> int:
        flags = self.blocks.train_flags
        return count_targets(self.blocks.train[idx], None if flags is None else flags[idx])

    def batch(self, blocks: np.ndarray, flags: np.ndarray | None, idx: np.ndarray,
              valid_rows: int | None = None) -> Batch:
        return make_batch(blocks[idx], None if flags is None else flags[idx], self.dist.device, valid_rows)

    def log_window(self, telemetry: Telemetry, window: Window) -> None:
        if not window.applied:  # every step of the window was skipped: logged one by one already
            return
        seconds = window.seconds()
        tokens_per_s = self.sampler.global_batch * self.cfg.data.seq_length * window.steps / seconds
        mfu = (tokens_per_s / self.dist.world_size * self.flops_per_token / self.peak) if self.peak else None
        fields = {"epoch": self.sampler.epoch, "loss": window.loss / window.applied,
                  "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": window.grad_norm,
                  "tokens_per_s": round(tokens_per_s, 1), "trained_tokens_per_s": round(window.targets / seconds, 1),
                  "mfu": None if mfu is None else round(mfu, 4),
                  "time_ms": self.timer.read(), "mem_gb": self.memory()}
        telemetry.event("train", self.step, **fields)
        t = fields["time_ms"]
        telemetry.human({"global_step": self.step, "epoch": fields["epoch"], "loss": round(fields["loss"], 4),
                         "lr": f"{fields['lr']:.3g}", "grad_norm": round(fields["grad_norm"], 4),
                         "tok/s": round(tokens_per_s), "trained_tok/s": round(fields["trained_tokens_per_s"]),
                         "mfu": fields["mfu"], **{f"time/{k}": t[k] for k in t},
                         "mem/peak_alloc_gb": fields["mem_gb"]["peak_alloc"]})

    def memory(self) -> dict:
        """This rank's memory figures, and every rank's peak above what it held before the model was built
        (`peak_by_rank`, what the start-up estimate predicts). An all-gather: every rank calls it."""
        mem = memory_gb(self.dist.device)
        peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(self.dist.world_size)]
        mine = torch.tensor([mem["peak_alloc"] - self.memory_base / GIB], dtype=torch.float64)
        dist.all_gather(peaks, mine)  # CPU tensors: gloo, no device sync
        mem["peak_by_rank"] = [round(p.item(), 3) for p in peaks]
        return mem

    @torch.no_grad()
    def evaluate(self, telemetry: Telemetry) -> float | None:
        """Loss and perplexity over the whole validation split, its blocks dealt round-robin to the ranks."""
        val, val_flags = self.blocks.val, self.blocks.val_flags
        if len(val) == 0:
            return None
        self.model.eval()
        bs, world = self.cfg.train.batch_size, self.dist.world_size
        mine = np.arange(self.dist.rank, len(val), world)
        batches = math.ceil(math.ceil(len(val) / world) / bs)
        sums = torch.zeros(2, dtype=torch.float64, device=self.dist.device)
        for b in range(batches):
            idx = mine[b * bs:(b + 1) * bs]
            # every rank runs the same forwards on the same shapes (collectives inside): a rank short of blocks
            # pads with block 0, whose rows do not count
            valid = len(idx)
            idx = np.concatenate([idx, np.zeros(bs - valid, dtype=idx.dtype)])
            # over num_items = world size, the losses summed over ranks are the global sum (pipeline/model/loss.py)
            loss = self.loss(self.batch(val, val_flags, idx, valid), self.dist.world_size)
            tokens = count_targets(val[idx], None if val_flags is None else val_flags[idx], valid)
            sums += torch.stack([loss.double(), torch.tensor(tokens, dtype=torch.float64, device=self.dist.device)])
        dist.all_reduce(sums)
        self.strategy.release()  # the root stays gathered after a forward without backward
        self.model.train()
        loss = (sums[0] / sums[1].clamp_min(1)).item()
        ppl = math.exp(loss) if loss < 700 else math.inf
        telemetry.event("eval", self.step, loss=loss, ppl=ppl)
        telemetry.human({"global_step": self.step, "eval_loss": round(loss, 5), "eval_ppl": round(ppl, 3)})
        if self.cfg.run.save_best and loss < self.best_val:
            self.best_val = loss
            export_model(self.strategy, self.plan.model_dir, self.run_dir / "best",
                         export_dtype(self.cfg.run.export_dtype, self.plan.hf_config), self.dist,
                         self.plan.spec.chat_template)
            log.info("best validation loss so far (%.5f): exported to %s", loss, self.run_dir / "best")
        return loss


def _new_run_name(cfg: Config, d: Dist) -> Config:
    """--no-resume on an existing run: rank 0 picks NAME-2, NAME-3, ... and tells the others. Collective."""
    box = [cfg.run.experiment_name]
    if d.is_main and cfg.run_dir.exists():
        k = 2
        while (Path(cfg.run.save_dir) / f"{cfg.run.experiment_name}-{k}").exists():
            k += 1
        box[0] = f"{cfg.run.experiment_name}-{k}"
        log.warning("--no-resume: starting a new run %s; %s is kept as it is", box[0], cfg.run_dir)
    dist.broadcast_object_list(box, src=0)
    cfg.run.experiment_name = box[0]
    cfg.run.no_resume = False
    return cfg


def run(cfg: Config, d: Dist, plan: Plan) -> Trainer:
    """Set up the run directory and logs, then train."""
    if cfg.run.no_resume:
        cfg = _new_run_name(cfg, d)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    check_shared_dir(cfg.run_dir, d, "--save-dir")
    setup_logging(cfg.run_dir, d.rank)
    if d.is_main:
        config_mod.save(cfg, cfg.run_dir / "config.yaml")
        if plan.spec.chat_template:  # pipeline.train.export of any of the run's checkpoints carries it too
            write_text_atomic(cfg.run_dir / RUN_TEMPLATE, plan.spec.chat_template)
        log.info("run directory %s (world size %d, device %s)", cfg.run_dir, d.world_size, d.device)
    StopRequest.install()
    trainer = Trainer(cfg, d, plan)
    trainer.fit()
    dist.barrier()  # no rank tears the group down while another still has collectives in flight
    if d.is_main:
        log.info("done: model %s, metrics %s, plot %s, log %s", cfg.run_dir / "hf", cfg.run_dir / "metrics.jsonl",
                 cfg.run_dir / "loss.png", cfg.run_dir / "train.log")
    return trainer


def out_of_memory_hints(cfg: Config) -> str:
    """What to change when a step does not fit."""
    hints = ["a smaller --batch-size (with --grad-accum to keep the global batch)"]
    if not cfg.model.activation_checkpointing:
        hints.append("--activation-checkpointing on")
    m = cfg.model
    if m.strategy == "fsdp2" and m.vocab_parallel == "off" and m.sharding in VOCAB_PARALLEL_SHARDINGS \
            and not m.cpu_offload:
        hints.append("--vocab-parallel auto (no full-width logits)")
    if m.strategy == "ddp":
        hints.append("--strategy fsdp2 (shards the model)")
    elif m.sharding in ("NO_SHARD", "SHARD_GRAD_OP"):
        hints.append("--sharding FULL_SHARD")
    return f"try {', '.join(hints)}"


def out_of_memory_message(cfg: Config, d: Dist) -> str:
    """What to change when a step does not fit (NCCL reports the same failure as an 'unhandled cuda error')."""
    return (f"rank {d.rank} ran out of {d.device.type.upper()} memory at batch {cfg.train.batch_size} x seq "
            f"{cfg.data.seq_length}; {out_of_memory_hints(cfg)}; the last complete checkpoint (if any) resumes with "
            "the same command")


def main(argv: list[str] | None = None) -> int:
    """fsdp1.py: resolve the config, check everything cheap, then join the process group and train."""
    cfg = config_mod.resolve(argv)
    launch = detect_launch()  # a launcher's missing variable is one line before any heavy work
    plan = preflight(cfg)
    if cfg.data.prepare_only:
        return prepare_only(cfg, plan, launch)
    d = init_distributed(timedelta(seconds=cfg.run.collective_timeout_s))
    watch_parent()
    peers = PeerWatch(d, cfg.run.peer_timeout_s).start()
    try:
        code = train_or_stop(cfg, d, plan, peers)
    except BaseException as exc:
        if not is_collective_failure(exc):  # this rank's own failure, not the echo of another's
            peers.stop(failure=(str(exc).strip() or type(exc).__name__).splitlines()[0][:300])
        dist.destroy_process_group()
        raise
    peers.stop()
    dist.barrier()  # every rank's heartbeat has stopped before any rank (one may host the store) exits
    dist.destroy_process_group()
    return code


def train_or_stop(cfg: Config, d: Dist, plan: Plan, peers: PeerWatch) -> int:
    """run(), its clean stop as an exit code, and its failures as one line where we can say what happened."""
    try:
        run(cfg, d, plan)
    except Interrupted as stop:
        return 128 + stop.signum
    except torch.OutOfMemoryError:
        raise UserError(out_of_memory_message(cfg, d)) from None
    except RuntimeError as exc:
        if not is_collective_failure(exc):
            raise
        if "out of memory" in str(exc):  # NCCL's report of a CUDA OOM
            raise UserError(out_of_memory_message(cfg, d)) from None
        # Most often a peer died: the heartbeat names it and ends the process; a launcher that is already
        # stopping us (another worker failed on this node) needs no wait
        peers.wait_for_verdict(give_up=lambda: StopRequest.signum != 0)
        raise
    return 0

