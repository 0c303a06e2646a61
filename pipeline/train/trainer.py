"""The Trainer: the run's state (model, optimizer, schedule, sampler, counters), its loop, evaluation and signals.

Order matters: preflight (pipeline/train/preflight.py) runs first, on every rank, before the process group does
anything heavy. Then the token cache is found or built (pipeline/train/blocks.py), the strategy builds and
distributes the model, a checkpoint (or, on a fresh start, the base weights) fills it, and the loop runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import signal
import time
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from pipeline.config import Config
from pipeline.data.sampler import MixtureSampler
from pipeline.distributed.runtime import Dist, compute_dtype
from pipeline.errors import UserError
from pipeline.eval.heldout import held_out_loss
from pipeline.eval.samples import complete, stop_ids
from pipeline.model.registry import transforms_for
from pipeline.objectives.kinds import Inputs, kind_of
from pipeline.objectives.objective import HeldOut, StepSource
from pipeline.objectives.reference import precomputed
from pipeline.signals import Interrupted, Stopped, StopRequest, agreed_stop
from pipeline.strategies.memory import GIB
from pipeline.strategies.registry import make_strategy
from pipeline.train.blocks import check_one_batch, make_sampler, prepare_blocks
from pipeline.train.checkpoint import Checkpointer, rng_state, set_rng_state, state_problem, step_name
from pipeline.train.export import described, export_run, run_exports
from pipeline.train.optim import build_optimizer, build_scheduler, rescale_lr
from pipeline.train.preflight import Plan
from pipeline.train.profiling import StepProfiler, memory_breakdown
from pipeline.train.reference import with_reference
from pipeline.train.reports import data_line, experts_part, log_mixture, log_plan, log_profile, log_samples
from pipeline.train.step import StepResult, Update, Window, train_step
from pipeline.train.telemetry import (
    PhaseTimer,
    Telemetry,
    finite_or_text,
    flops_per_token,
    log,
    memory_gb,
    memory_in_use,
    peak_flops,
    reset_peak_memory,
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Owns the model, optimizer, schedule, sampler and counters; its state is what a checkpoint holds."""

    def __init__(self, cfg: Config, d: Dist, plan: Plan):
        d = dataclasses.replace(d, sequence_parallel=cfg.model.sequence_parallel)  # the data dealt to its groups
        self.cfg, self.dist, self.plan = cfg, d, plan
        self.run_dir = cfg.run_dir
        self.dtype = compute_dtype(cfg.model.precision, d.device)
        seed_everything(cfg.run.seed)
        self.blocks = prepare_blocks(cfg, plan, d)
        check_one_batch(self.blocks, cfg, d)
        self.sampler = make_sampler(self.blocks, cfg, d)
        # an objective may train each draw more than once (GRPO's --num-iterations): an epoch takes that many
        kind = kind_of(cfg)
        self.total_steps = cfg.train.max_steps or cfg.train.num_epochs * self.sampler.steps_per_epoch * \
            kind.iterations(cfg)
        reward = [plan.reward_head] if plan.reward_head else []
        self.strategy = make_strategy(cfg.model, d, self.dtype, [*transforms_for(cfg.model, self.dtype), *reward])
        if d.is_main:
            log_plan(plan, cfg)
            if cfg.model.offload_activations == "on" and d.device.type != "cuda":
                log.warning("--offload-activations on: no effect on the %s (the activations already are in host "
                            "memory)", d.device.type.upper())
        # what the process holds before the model exists: the estimate covers what comes above it
        self.memory_base = memory_in_use(d.device)
        reset_peak_memory(d.device)
        self.model = self.strategy.build(plan.hf_config)
        if plan.reference is not None:  # before the checkpoint or base fills the model: the pass loads the reference
            self.blocks = with_reference(self.blocks, plan.reference, self.strategy, self.dtype, cfg.train.batch_size)
        head = self.strategy.head()
        self.stops = stop_ids(plan.tokenizer, plan.model_dir) if plan.prompts else set()
        self.objective = kind.build(Inputs(cfg, self.strategy, head, self.blocks, self.dtype, plan.tokenizer,
                                           plan.model_dir, plan.hf_config,
                                           reference=plan.reference and precomputed(head),
                                           reward_head=plan.reward_head, rewards=plan.rewards, tools=plan.tools,
                                           max_steps=self.total_steps))
        self.optimizer = build_optimizer(self.strategy.param_groups(cfg.optim.weight_decay), cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        self.step, self.samples_seen, self.best_val = 0, 0, math.inf
        self.base_val: HeldOut | None = None
        """The base model's validation figures (step 0), kept in checkpoints for the run's closing line."""
        self.bad_steps, self.skipped_since_save = 0, 0
        self.pending_eval = False
        """A validation after a step is under way: a stop inside it saves the step with it, and the rerun runs it."""
        self.applied = 0
        """Steps this process applied (every rank counts alike: the decision is agreed)."""
        self.timer = PhaseTimer(d.device)
        self.flops_per_token = flops_per_token(plan.hf_config, self.strategy.num_matmul_params, cfg.data.seq_length,
                                               self.strategy.num_frozen_matmul)
        self.peak = peak_flops(d.device)
        async_ckpt = cfg.run.async_ckpt == "on" or (cfg.run.async_ckpt == "auto" and d.device.type == "cuda")
        self.ckpt = Checkpointer(self.run_dir, d, cfg.train.keep_last, async_ckpt, plan.fingerprint)
        # an async checkpoint's copy of the weights and states must be complete before an update changes them
        # fp16: the loss scaled so small gradients do not flush to zero (the strategy's GradScaler)
        self.scaler = self.strategy.grad_scaler(cfg.train.loss_scale) if self.dtype == torch.float16 else None
        self.overflows = 0
        """fp16: overflowing steps in a row."""
        self.update = Update(self.optimizer, self.scheduler, cfg.optim.max_grad_norm, self.ckpt.staged, self.scaler)
        self.resumed_from = self.resume()
        first = cfg.train.profile_from if d.is_main else 0  # rank 0 alone: the profiler has no collective
        self.profiler = StepProfiler(first, cfg.train.profile_steps, self.run_dir / "profile", d.device,
                                     lambda: memory_breakdown(self.strategy.module, self.optimizer, d.device))
        data = data_line(len(self.blocks.train), len(self.blocks.val), cfg.data.seq_length, self.sampler.global_batch,
                         cfg.rollouts.group if cfg.rollouts else 0)
        split = f", each sequence split over {d.sequence_parallel} ranks" if d.sequence_parallel > 1 else ""
        log.info("model %s: %s parameters (%s trainable%s), %s compute, %s %s%s; %s; step %d of %d",
                 type(self.strategy.module).__name__, f"{self.strategy.num_params:,}",
                 f"{self.strategy.num_trainable:,}", experts_part(self.strategy), self.dtype, cfg.model.strategy,
                 cfg.model.sharding, split, data, self.step, self.total_steps)
        self.say_transform_warnings()

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Counters, sampler and schedule (JSON); model and optimizer are saved through DCP beside it."""
        return {"step": self.step, "samples_seen": self.samples_seen, "best_val": self.best_val,
                "base_val": None if self.base_val is None else dataclasses.asdict(self.base_val),
                "sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict(),
                "pending_eval": self.pending_eval,
                **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.best_val = float(state["best_val"])
        self.base_val = HeldOut(**state["base_val"]) if state.get("base_val") else None  # absent before --eval-base
        self.pending_eval = bool(state.get("pending_eval"))
        self.sampler.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):  # (a run resumed into fp16 starts at --loss-scale)
            self.scaler.load_state_dict(state["scaler"])
        saved = float(state["scheduler"]["base_lrs"][0])
        if rescale_lr(self.scheduler, self.optimizer, saved, self.cfg.optim.lr) and self.dist.is_main:
            log.warning("--lr changed from %g to %g: the schedule continues at step %d with the new peak", saved,
                        self.cfg.optim.lr, self.step)
        old, new = state["sampler"]["global_batch"], self.sampler.global_batch
        if old != new and self.dist.is_main:
            log.warning("global batch changed from %d to %d blocks: continuing from the next unseen block "
                        "(%d consumed in epoch %d)", old, new, self.sampler.consumed, self.sampler.epoch)

    def resume(self) -> dict | None:
        """Fill the model: from the newest complete checkpoint (or --resume-from), verified file by file, without
        opening the base model's weights; else from the base model. Collective."""
        if self.dist.is_main:
            if problem := state_problem(self.run_dir):
                log.warning("%s: rebuilt from the checkpoints that carry a manifest (newest: %s)", problem,
                            self.ckpt.newest())
            for name in self.ckpt.incomplete():
                log.warning("ignoring incomplete checkpoint %s (removed once a newer one is complete)", name)
        path = self.ckpt.choose(self.cfg.run.resume_from)
        started = time.perf_counter()
        if path is None or self.strategy.freezes_base:  # adapters: the checkpoint holds them, not the base
            self.strategy.load_weights(self.plan.model_dir)
            log.info("loaded the base weights from %s in %.2f s", self.plan.model_dir, time.perf_counter() - started)
        if path is None:
            return None
        self.ckpt.verify(path)
        self.load_state_dict(self.ckpt.load(path, self.strategy, self.optimizer))
        self.objective.load_state_dict(self.ckpt.rank_state(path))
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
                            "skipped_steps": self.skipped_since_save}, sync=sync,
                           rank_state=self.objective.state_dict())
            self.skipped_since_save = 0
        return True

    # ------------------------------------------------------------------------------------------------- loop

    def fit(self) -> None:
        final = self.run_dir / next(iter(run_exports(self.cfg)))
        if self.step >= self.total_steps and final.exists():
            log.info("run already complete at step %d: %s", self.step, final)
            return
        # closed (and the losses plotted, unless the run crashed) however the loop ends, before any message
        params = {**self.cfg.flat(), **{f"fingerprint/{k}": v for k, v in self.plan.fingerprint.items()}}
        with Telemetry(self.run_dir, self.dist.is_main, self.total_steps, self.step, self.cfg.run.report_to,
                       params) as telemetry:
            self.ckpt.listener = lambda step, fields: telemetry.event("checkpoint", step, **fields)
            if self.resumed_from:
                telemetry.event("resume", self.step, **self.resumed_from)
            mem = self.plan.memory
            telemetry.event("memory", self.step, strategy=self.cfg.model.strategy, sharding=self.cfg.model.sharding,
                            estimate_gb=mem.estimate and mem.estimate.gib(), budget_gb=round(mem.budget / GIB, 3))
            self.loop(telemetry)
        log.info("exported the %s", described(self.cfg))

    def loop(self, telemetry: Telemetry) -> None:
        self.model.train()
        if self.step == 0 and self.cfg.train.eval_base:
            self.base_val = self.evaluate(telemetry)
        elif self.pending_eval:  # resumed from a stop during this step's validation
            self.validate_after_step(telemetry)
        window = Window()  # after the base's validation: the first window's throughput is of training alone
        while self.step < self.total_steps:
            stop, time_to_save = self.boundary()
            if stop:
                self.stop(telemetry)
            if not self.sampler.has_next():  # epoch boundary
                self.sampler.start_epoch(self.sampler.epoch + 1)
                if not self.cfg.train.ckpt_freq:  # --ckpt-freq 0 checkpoints each epoch's start (a small dataset's
                    self.save()  # hundred epochs under --ckpt-freq N are not a hundred checkpoints)
                continue
            lr = self.optimizer.param_groups[0]["lr"]  # what this step applies: the update advances the schedule
            self.profiler.before(self.step + 1)
            consumed = self.sampler.consumed
            try:
                result = self.train_step()
            except Stopped as stopped:  # in the step's generation or rewards: it has changed nothing yet
                self.stop(telemetry, f"{stopped} ")
            self.step += 1
            if profiled := self.profiler.after(self.step, final=self.step >= self.total_steps):
                log_profile(telemetry, profiled, self.step, self.run_dir)
            # a step drew its global batch, unless GRPO trained on a generation's rollouts again (--num-iterations)
            self.samples_seen += self.sampler.consumed - consumed
            telemetry.advance()
            window.add(result, lr)
            if result.applied:
                self.applied += 1
                self.bad_steps = self.overflows = 0
            elif self.scaler is not None:
                self.overflowed(telemetry, result)
            else:
                self.skipped(telemetry, result)
            if self.step % self.cfg.train.log_freq == 0 or self.step == self.total_steps:
                self.log_window(telemetry, window)
                window = Window()
            if self.cfg.train.eval_freq and self.step % self.cfg.train.eval_freq == 0 and self.step < self.total_steps:
                started = time.perf_counter()
                self.validate_after_step(telemetry)
                window.started += time.perf_counter() - started  # the window's throughput is of training alone
            if (self.cfg.train.ckpt_freq and self.step % self.cfg.train.ckpt_freq == 0) or time_to_save:
                self.save()
        self.refuse_untrained()
        final = self.evaluate(telemetry)
        if final and self.base_val and self.dist.is_main:
            log.info("validation %s, base -> step %d", self.objective.closing(self.base_val, final), self.step)
        if isinstance(self.sampler, MixtureSampler):
            log_mixture(telemetry, self.sampler, self.blocks.sources, self.cfg.data.seq_length, self.step,
                        self.dist.is_main)
        self.save()
        self.ckpt.wait()
        if agreed_stop():  # a signal during the last save: the export (one uninterruptible DCP write) waits for none
            self.stop(telemetry, "before the export ")
        export_run(self.strategy, self.cfg, self.plan.model_dir, self.dist, self.plan.spec.chat_template,
                   self.plan.fingerprint)

    def validate_after_step(self, telemetry: Telemetry) -> None:
        self.pending_eval = True
        self.evaluate(telemetry)
        self.pending_eval = False

    def boundary(self) -> tuple[bool, bool]:
        """One small all-reduce per step: did any rank get a signal, has every rank finished its async save, and is
        a checkpoint due by wall time on any rank (their clocks differ: the first one due decides for all, so every
        rank reaches the save's collectives at the same step)? Returns (stop, save after this step)."""
        minutes = self.cfg.train.ckpt_minutes
        due = bool(minutes) and time.monotonic() - self.ckpt.saved_at >= minutes * 60
        flags = torch.tensor([float(StopRequest.signum != 0), float(self.ckpt.in_flight()), float(due)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # CPU tensor: gloo, no device sync
        self.ckpt.finish_if_done(all_done=flags[1].item() == 0)
        return bool(flags[0].item()), bool(flags[2].item())

    def stop(self, telemetry: Telemetry, during: str = "") -> NoReturn:
        """The stop a signal asked for, agreed by every rank: the step's checkpoint written (synchronously), one line,
        Interrupted. A collective."""
        saved = self.save(sync=True)
        self.ckpt.wait()
        # the bar ends (and the plot is drawn) before the message; the `with` then closes nothing
        telemetry.close(status="KILLED")
        where = f"checkpoint {self.ckpt.root / step_name(self.step)} saved" if saved else \
            f"the last good checkpoint is {self.last_checkpoint()}"
        # said once, by rank 0; the others keep it in train.log (their console shows warnings only)
        (log.warning if self.dist.is_main else log.info)("stopped by signal %sat step %d; %s; rerun the same "
                                                         "command to resume", during, self.step, where)
        raise Interrupted(StopRequest.signum or signal.SIGTERM)

    def refuse_untrained(self) -> None:
        """A run that applied none of its steps (each one non-finite or, under fp16, overflowing, fewer in a row than
        the limits stop at) would export the base as if trained: one line instead, on every rank alike. A resumed
        run applied steps before its checkpoint (a skipped step is never checkpointed)."""
        if self.applied or self.resumed_from or self.step == 0:
            return
        self.ckpt.wait()
        why = ("overflowed in fp16 at every loss scale tried; try --precision bf16" if self.scaler is not None else
               f"had a non-finite loss or gradient norm; try a lower --lr (now {self.cfg.optim.lr:g}) or "
               "--precision fp32")
        raise UserError(f"no step of this run was applied: all {self.step} {why}. Nothing was trained, so nothing "
                        "is exported")

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
            raise UserError(
                f"training diverged: steps {self.step - self.bad_steps + 1}-{self.step} had a non-finite loss or "
                f"gradient norm (last: loss {figures['loss']}, grad norm {figures['grad_norm']}) and were skipped; "
                f"the last good checkpoint is {self.last_checkpoint()}; try a lower --lr (now {self.cfg.optim.lr:g}),"
                f" --precision fp32 or a smaller --max-grad-norm (now {self.cfg.optim.max_grad_norm:g}), then rerun "
                "to resume from it")

    def overflowed(self, telemetry: Telemetry, result: StepResult) -> None:
        """fp16: a step whose gradients overflowed at its loss scale: skipped, the scale halved (the scaler's update),
        and not a sign of divergence, unless it keeps happening: --max-overflow-steps in a row, or a scale fallen
        below 1, stop the run in one line."""
        self.overflows += 1
        scale = self.scaler.get_scale()
        telemetry.event("skipped", self.step, overflow=True, in_a_row=self.overflows, loss_scale=scale,
                        loss=finite_or_text(result.loss), grad_norm=finite_or_text(result.grad_norm))
        if self.dist.is_main:
            log.info("step %d skipped: fp16 gradients overflowed at loss scale %g; the scale is now %g", self.step,
                     result.loss_scale, scale)
        if self.overflows >= self.cfg.train.max_overflow_steps or scale < 1:
            self.ckpt.wait()
            why = (f"{self.overflows} steps in a row overflowed" if scale >= 1 else
                   f"the loss scale fell to {scale:g}: fp16 cannot hold this run's values even unscaled")
            raise UserError(f"training diverged in fp16 at step {self.step}: {why}; the last good checkpoint is "
                            f"{self.last_checkpoint()}; try --precision bf16 where the GPU has it, or fp32, or a lower "
                            f"--lr (now {self.cfg.optim.lr:g}), then rerun to resume from it")

    def train_step(self) -> StepResult:
        """One optimizer step (pipeline/train/step.py) over this rank's share of the sampler's next global batch."""
        train = self.blocks.part("train")
        source = StepSource(train, self.sampler.upcoming, self.sampler.next_step,
                            lambda rows: self.strategy.split(train.batch(rows, self.dist.device)))
        # an objective that generates makes its items now (a collective) from the prompts it draws; a stop inside
        # puts back the sampler and what a reward drew from the global generators, so that the step's checkpoint
        # draws the same prompts again on resume (an offline objective's prepare draws nothing a stop interrupts)
        drawn_from = (self.sampler.state_dict(), rng_state()) if self.objective.generates else None
        try:
            with self.timer.phase(self.objective.phase) if self.objective.phase else contextlib.nullcontext():
                prepared = self.objective.prepare(source, self.step)
        except Stopped:
            if drawn_from is not None:
                self.sampler.load_state_dict(drawn_from[0])
                set_rng_state(drawn_from[1])
            raise
        return train_step(self.strategy, self.objective, prepared.keys, prepared.make, prepared.items, self.update,
                          self.timer)

    def log_window(self, telemetry: Telemetry, window: Window) -> None:
        if not window.applied:  # every step of the window was skipped: logged one by one already
            return
        seconds = window.seconds()
        # blocks of --seq-length tokens; an objective that generates has no such blocks: its own rate says it
        tokens_per_s = None if self.objective.generates else \
            self.sampler.global_batch * self.cfg.data.seq_length * window.steps / seconds
        mfu = (tokens_per_s / self.dist.world_size * self.flops_per_token / self.peak) if self.peak and tokens_per_s \
            else None
        fields = {"epoch": self.sampler.epoch, "loss": window.loss / window.applied,
                  "lr": window.lr, "grad_norm": window.grad_norm,
                  "tokens_per_s": tokens_per_s and round(tokens_per_s, 1),
                  f"{self.objective.counted}_per_s": round(window.targets / seconds, 3),
                  "mfu": None if mfu is None else round(mfu, 4),
                  "time_ms": self.timer.read(), "mem_gb": self.memory(),
                  **({"loss_scale": self.scaler.get_scale()} if self.scaler is not None else {}),
                  # a collective (a preference objective's pairs summed over the ranks): every rank logs the window
                  **self.objective.read_metrics(reduce=True),
                  **self.strategy.transform_metrics()}  # a collective too (a MoE's expert load)
        telemetry.event("train", self.step, **fields)
        self.say_transform_warnings()
        log_samples(telemetry, self.objective.samples(), self.step)
        t = fields["time_ms"]
        tokens = self.objective.counted == "trained_tokens"
        rate = "trained_tok/s" if tokens else f"{self.objective.counted}/s"
        telemetry.human({"global_step": self.step, "epoch": fields["epoch"], "loss": round(fields["loss"], 4),
                         "lr": f"{fields['lr']:.3g}", "grad_norm": round(fields["grad_norm"], 4),
                         **({"tok/s": round(tokens_per_s)} if tokens_per_s else {}),
                         rate: round(fields[f"{self.objective.counted}_per_s"], None if tokens else 2),
                         "mfu": fields["mfu"], **{k: _rounded(fields.get(k)) for k, _ in self.objective.shown},
                         **({"aux_loss": round(fields["aux_loss"], 4)} if "aux_loss" in fields else {}),
                         **{f"time/{k}": t[k] for k in t},
                         "mem/peak_alloc_gb": fields["mem_gb"]["peak_alloc"]})

    def say_transform_warnings(self) -> None:
        """The transforms' warnings, on rank 0 (each rank's transforms see the same, and clear them when asked)."""
        for warning in self.strategy.transform_warnings():
            if self.dist.is_main:
                log.warning("%s", warning)

    def memory(self) -> dict:
        """This rank's memory figures, and every rank's peak above what it held before the model was built
        (`peak_by_rank`, what the start-up estimate predicts). An all-gather: every rank calls it."""
        mem = memory_gb(self.dist.device)
        peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(self.dist.world_size)]
        mine = torch.tensor([mem["peak_alloc"] - self.memory_base / GIB], dtype=torch.float64)
        dist.all_gather(peaks, mine)  # CPU tensors: gloo, no device sync
        mem["peak_by_rank"] = [round(p.item(), 3) for p in peaks]
        return mem

    def evaluate(self, telemetry: Telemetry) -> HeldOut | None:
        """Loss and perplexity over the whole validation split (pipeline/eval/heldout.py); at a step after 0, the
        best so far is exported with --save-best; --sample-prompts completed. A collective."""
        start = time.perf_counter()
        if self.plan.prompts:
            self.sample(telemetry)
        sampled = time.perf_counter()
        names, parts = zip(*self.blocks.val_parts(), strict=True)
        try:
            val = held_out_loss(self.strategy, parts, self.cfg.train.batch_size, self.dist, self.objective,
                                stop=agreed_stop)
        except Stopped as stopped:  # between rounds, or in a round's generation or rewards (GRPO)
            self.stop(telemetry, f"{stopped} ")
        if val is None:
            return None
        by_source = {f"eval/loss/{name}": loss for name, loss in zip(names, val.by_part, strict=True) if name}
        # held_out_loss ends in a host sync (the summed loss read back), so the clock covers the whole pass; to the
        # microsecond, since a tiny model's pass can take under a millisecond
        costs = {"seconds": round(time.perf_counter() - sampled, 6),
                 **({"sample_seconds": round(sampled - start, 6)} if self.plan.prompts else {})}
        telemetry.event("eval", self.step, loss=val.loss, ppl=val.ppl, **val.metrics, **by_source, **costs)
        # a preference objective's mean is over pairs or examples: its exp is no perplexity, its figures say more
        shown = ({f"eval_{name}": _rounded(val.metrics[k]) for k, name in self.objective.shown if k in val.metrics}
                 if self.objective.shown else {"eval_ppl": round(val.ppl, 3)})
        telemetry.human({"global_step": self.step, "eval_loss": round(val.loss, 5), **shown,
                         **{k: None if v is None else round(v, 5) for k, v in by_source.items()}})
        if self.cfg.run.save_best and self.step > 0 and val.loss < self.best_val:  # step 0 is the base, not a result
            self.best_val = val.loss
            export_run(self.strategy, self.cfg, self.plan.model_dir, self.dist, self.plan.spec.chat_template,
                       self.plan.fingerprint, best=True)
            log.info("best validation loss so far (%.5f): exported the %s", val.loss, described(self.cfg, best=True))
        return val

    def sample(self, telemetry: Telemetry) -> None:
        """Every --sample-prompts prompt completed greedily by the model as it is now, logged. A collective."""
        completions = complete(self.strategy, self.plan.prompts, self.cfg.train.sample_max_tokens, self.stops,
                               self.dist)
        for index, (prompt, ids) in enumerate(zip(self.plan.prompts, completions, strict=True)):
            text = self.plan.tokenizer.decode(ids, skip_special_tokens=True)
            telemetry.event("sample", self.step, tracked=False, index=index, prompt=prompt.shown, completion=text)
            telemetry.text(f"sample/{index}", self.step, f"{prompt.shown}\n-> {text}")
            if self.dist.is_main:
                log.info("sample %d at step %d: %r -> %r", index, self.step, prompt.shown, text)


def _rounded(value: float | None) -> float | None:
    """A figure as the console shows it; None where the window had none (every GRPO reward abstained in it)."""
    return None if value is None else round(value, 4)
