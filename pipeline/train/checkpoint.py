"""Crash-safe sharded checkpoints with DCP, and the resume guard.

Layout of RUN/checkpoints/step-NNNNNNNN/: DCP's files (model and optimizer, every rank its shards, `.metadata`),
trainer.json (counters, sampler, LR schedule, fingerprint), rng-RANK.json (per-rank RNG states), manifest.json
(size and xxh3 checksum of every file). Nothing outside DCP is a pickle.

A checkpoint counts only once RUN/state.json names it. state.json is written last, by rank 0, after every rank has
finished writing and the manifest is on disk (temporary file, fsync, rename, fsync of the directory), so a crash at
any moment leaves the previous checkpoint as the newest complete one. state.json is a pointer: lost, emptied or
unreadable, it is rebuilt from the checkpoints that carry a manifest (read_state). Old checkpoints are deleted only
after a newer one is complete.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from pipeline.distributed.liveness import is_collective_failure
from pipeline.distributed.runtime import Dist, gather_objects
from pipeline.errors import UserError
from pipeline.fsutil import hash_file, write_text_atomic
from pipeline.model.weight_check import check_same_base, unchanged_weights
from pipeline.strategies.base import Strategy
from pipeline.strategies.registry import make_strategy
from pipeline.train.telemetry import log

CHECKPOINTS = "checkpoints"
STATE = "state.json"
MANIFEST = "manifest.json"
RANK_STATE = "objective-"
"""objective-RANK.pt: a rank's own state beside the model's (an objective's, Checkpointer.save's rank_state)."""
TRAINER = "trainer.json"
NEARLY_FULL = 64 * 2**20
"""Free bytes below which a failed save is put down to a full disk."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def write_json_atomic(path: Path, obj: object) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def read_state(run_dir: Path) -> dict | None:
    """RUN/state.json, the pointer to the run's complete checkpoints; rebuilt from the checkpoints themselves when it
    is missing, empty or unreadable (rebuild_state), so a lost pointer never makes complete checkpoints look
    incomplete (to be pruned, or overwritten by a fresh start that skips the resume guard). None: nothing complete."""
    state = _parse_state(run_dir / STATE)
    return state if state is not None else rebuild_state(run_dir)


def state_problem(run_dir: Path) -> str:
    """What is wrong with RUN/state.json while complete checkpoints exist ("" when nothing): for the log."""
    path = run_dir / STATE
    if _parse_state(path) is not None or rebuild_state(run_dir) is None:
        return ""
    return f"{path} is {'missing' if not path.exists() else 'empty or unreadable'}"


def _parse_state(path: Path) -> dict | None:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    keys = ("step", "path", "checkpoints", "fingerprint")
    return state if isinstance(state, dict) and all(k in state for k in keys) else None


def rebuild_state(run_dir: Path) -> dict | None:
    """state.json as the checkpoints on disk say it: complete are those with a manifest.json, which rank 0 writes
    only once every rank's files are on disk (resume still verifies their checksums); the newest one's trainer.json
    gives the step, counters and fingerprint. Which steps were skipped as non-finite is not recoverable."""
    root = run_dir / CHECKPOINTS
    done = sorted(p.name for p in root.glob("step-*") if (p / MANIFEST).is_file() and (p / TRAINER).is_file()) \
        if root.is_dir() else []
    for name in reversed(done):
        try:
            trainer = json.loads((root / name / TRAINER).read_text(encoding="utf-8"))
            return {"step": int(trainer["step"]), "epoch": int(trainer["sampler"]["epoch"]),
                    "samples_seen": int(trainer["samples_seen"]), "path": f"{CHECKPOINTS}/{name}",
                    "checkpoints": done[:done.index(name) + 1], "fingerprint": trainer["fingerprint"],
                    "skipped_steps": {}}
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged trainer.json: the next older checkpoint
    return None


def file_digest(path: Path) -> str:
    return hash_file(path, xxhash.xxh3_64())


# ---------------------------------------------------------------------------------------------- RNG state as JSON


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


# ------------------------------------------------------------------------------------------------ checkpointer


def to_prune(complete: list[str], keep: int, skipped_steps: dict[str, int]) -> list[str]:
    """Which complete checkpoints (oldest first) keep-k pruning deletes: all but the newest keep, except the last
    one written before skipped (non-finite) steps while a checkpoint written after them is kept. Training may have
    been going bad since those steps; the checkpoint before them is the one to go back to."""
    kept = complete[-keep:]
    first_after_skips = next((c for c in kept if skipped_steps.get(c)), None)
    before = [c for c in complete if first_after_skips is not None and c < first_after_skips]
    protected = before[-1:]
    return [c for c in complete[:-keep] if c not in protected]


@dataclass
class Pending:
    future: Future
    step: int
    info: dict
    started: float
    """perf_counter() when the save began."""
    stall: float
    """Seconds the training loop was blocked by it (so far: see Checkpointer.staged)."""
    staging: Future | None = None
    """Done once the state has been copied aside; until then nothing may change the model or optimizer."""


class Checkpointer:
    """Saves, finalises (manifest, state.json, pruning) and loads checkpoints of one run."""

    def __init__(self, run_dir: Path, d: Dist, keep_last: int, async_save: bool, fingerprint: dict):
        self.run_dir, self.dist, self.keep_last = run_dir, d, keep_last
        self.root = run_dir / CHECKPOINTS
        self.fingerprint = fingerprint
        # async writes run collectives from a background thread: give them a group of their own so they never
        # interleave with the training loop's collectives (a collective every rank must create: new_group)
        self.pg = dist.new_group(backend="gloo") if async_save else None
        self.pending: Pending | None = None
        self.last_step: int | None = None
        """The step of the newest checkpoint saved, being saved, or loaded."""
        self.saved_at = time.monotonic()
        """When the last save began (or the run started): --ckpt-minutes counts from it."""
        self.listener: Callable[[int, dict], None] | None = None
        """Told (step, {path, seconds, stall_seconds, bytes}) when a checkpoint is complete (rank 0 writes it out)."""

    # ---- save

    def save(self, step: int, strategy: Strategy, optimizer, trainer_state: dict, info: dict, *,
             sync: bool = False, rank_state: dict | None = None) -> None:
        """Write a checkpoint of the current state; asynchronous unless sync or async is off. rank_state: this
        rank's own state beside it (GRPO's rollouts between generations), None for none."""
        self.wait()
        started = time.perf_counter()
        self.last_step = step  # saved or being saved: the trainer does not ask for the same step twice
        self.saved_at = time.monotonic()
        path = self.root / step_name(step)
        if self.dist.is_main:
            self._forget(step)
            path.mkdir(parents=True, exist_ok=True)
            for stale in (path / ".metadata", path / MANIFEST):
                stale.unlink(missing_ok=True)  # a leftover of a crash must not look complete
        dist.barrier()
        state = strategy.state_dict(optimizer)
        (path / f"rng-{self.dist.rank}.json").write_text(json.dumps(rng_state()))
        if rank_state is not None:
            torch.save(rank_state, path / f"{RANK_STATE}{self.dist.rank}.pt")
        if self.dist.is_main:
            (path / TRAINER).write_text(json.dumps({**trainer_state, "fingerprint": self.fingerprint}, indent=2))
        try:
            if self.pg is not None and not sync:
                # the copy aside runs on a thread too (training goes on until the next optimizer step, see
                # staged()); a stager per save, closed when the write ends, so its copies are freed, not cached
                cuda = self.dist.device.type == "cuda"
                stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                      use_async_staging=True, use_non_blocking_copy=cuda))
                response = dcp.async_save(state, checkpoint_id=str(path), process_group=self.pg,
                                          async_stager=stager)
                response.upload_completion.add_done_callback(lambda _: stager.close())
                self.pending = Pending(response.upload_completion, step, info, started,
                                       time.perf_counter() - started, response.staging_completion)
                return
            dcp.save(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as exc:  # DCP re-raises any rank's failed write on every rank
            self._failed(step, exc)
        self._finalize(step, info, started, time.perf_counter() - started)

    def staged(self) -> None:
        """Block until the save in flight has copied the state aside: call before anything changes the model or
        optimizer (the optimizer step). The wait counts as training stall."""
        pending = self.pending
        if pending is None or pending.staging is None:
            return
        waited = time.perf_counter()
        # a failed copy fails the write as well: wait() reports it, with the checkpoint's name
        with contextlib.suppress(Exception):
            pending.staging.result()
        pending.staging = None
        pending.stall += time.perf_counter() - waited

    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending.future.done()

    def finish_if_done(self, all_done: bool) -> None:
        """Finalise the pending async save once every rank agrees it has finished (see Trainer.boundary)."""
        if self.pending is not None and all_done:
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) has been written, then finalise it."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            pending.future.result()
        except (Exception, CheckpointException) as exc:
            self._failed(pending.step, exc)
        self._finalize(pending.step, pending.info, pending.started, pending.stall)

    def _failed(self, step: int, exc: BaseException) -> None:
        state = read_state(self.run_dir)
        previous = (f"the previous checkpoint {Path(state['path']).name} is intact: rerun the same command to "
                    "resume from it") if state else "no earlier checkpoint exists"
        causes = exc.failures.items() if isinstance(exc, CheckpointException) else [(self.dist.rank, (exc, None))]
        lost_peer = next((e for _, (e, _) in causes if is_collective_failure(e)), None)
        if lost_peer is not None:  # not this checkpoint's fault: another rank is gone, which the heartbeat names
            raise lost_peer
        first = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in causes)
        full = self._no_space(state, [e for _, (e, _) in causes])
        raise UserError(f"checkpoint {step_name(step)} could not be written{full} ({first}); nothing was marked "
                        f"complete and {previous}") from exc

    def _no_space(self, state: dict | None, causes: list[BaseException]) -> str:
        """": no space left ..." when the disk is why a save failed. torch's writer reports a full disk as a
        RuntimeError of its zip container ("unexpected pos"), so an almost empty disk counts as full too."""
        free = shutil.disk_usage(self.root).free
        previous = self.run_dir / state["path"] if state else None
        need = sum(f.stat().st_size for f in previous.iterdir() if f.is_file()) if previous and previous.is_dir() else 0
        said = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in causes)
        if not said and free >= max(need, NEARLY_FULL):
            return ""
        return (f": no space left on device in {self.root} ({free / 2**20:,.1f} MB free"
                + (f", and the previous checkpoint took {need / 2**20:,.1f} MB)" if need else ")")
                + "; free space there (or move --save-dir) first")

    def _finalize(self, step: int, info: dict, started: float, stall: float) -> None:
        """Manifest of what every rank wrote, then state.json (rank 0, last), then pruning. A collective."""
        path = self.root / step_name(step)
        prefixes = (f"__{self.dist.rank}_", f"rng-{self.dist.rank}.", f"{RANK_STATE}{self.dist.rank}.")
        mine = sorted(p for p in path.iterdir() if p.name.startswith(prefixes))
        if self.dist.is_main:
            mine += [path / ".metadata", path / TRAINER]
        local = {p.name: {"bytes": p.stat().st_size, "xxh3": file_digest(p)} for p in mine}
        gathered = gather_objects(local)
        if self.dist.is_main:
            files = {k: v for part in gathered for k, v in part.items()}
            write_json_atomic(path / MANIFEST, {"step": step, "files": dict(sorted(files.items()))})
            self._publish(step, info)
            self._prune(step)
        dist.barrier()
        seconds = time.perf_counter() - started
        size = sum(entry["bytes"] for part in gathered for entry in part.values())
        log.info("checkpoint %s complete (%.2f s, %.1f MB, training blocked %.2f s)", path, seconds, size / 1e6, stall)
        if self.listener is not None:
            self.listener(step, {"path": str(path), "seconds": round(seconds, 3), "stall_seconds": round(stall, 3),
                                 "bytes": size})

    def _publish(self, step: int, info: dict) -> None:
        state = read_state(self.run_dir) or {"checkpoints": []}
        done = sorted(set(state["checkpoints"]) | {step_name(step)})
        skipped = {k: v for k, v in state.get("skipped_steps", {}).items() if k in done}
        if info.get("skipped_steps"):
            skipped[step_name(step)] = info["skipped_steps"]
        write_json_atomic(self.run_dir / STATE, {
            "step": step, "epoch": info["epoch"], "samples_seen": info["samples_seen"],
            "path": f"{CHECKPOINTS}/{step_name(step)}", "checkpoints": done, "fingerprint": self.fingerprint,
            "skipped_steps": skipped})

    def _forget(self, step: int) -> None:
        """Before rewriting step-N (a rerun from an older checkpoint), stop naming it complete."""
        state = read_state(self.run_dir)
        if state and step_name(step) in state["checkpoints"]:
            state["checkpoints"].remove(step_name(step))
            if Path(state["path"]).name == step_name(step):
                if not state["checkpoints"]:
                    (self.run_dir / STATE).unlink(missing_ok=True)  # a rebuilt state may have no file
                    return
                state["path"] = f"{CHECKPOINTS}/{state['checkpoints'][-1]}"
            write_json_atomic(self.run_dir / STATE, state)

    def _prune(self, newest: int) -> None:
        """Keep the newest keep_last complete checkpoints (and see to_prune); drop incomplete ones older than the
        newest."""
        state = read_state(self.run_dir)
        complete = state["checkpoints"]
        doomed = to_prune(complete, self.keep_last, state.get("skipped_steps", {}))
        state["checkpoints"] = [c for c in complete if c not in doomed]
        state["skipped_steps"] = {k: v for k, v in state.get("skipped_steps", {}).items() if k not in doomed}
        write_json_atomic(self.run_dir / STATE, state)  # first: a crash mid-deletion never names a deleted one
        for old in doomed:
            shutil.rmtree(self.root / old, ignore_errors=True)
        for entry in self.root.iterdir():
            if entry.name.startswith("step-") and entry.name not in complete and entry.name < step_name(newest):
                shutil.rmtree(entry, ignore_errors=True)
                log.info("removed incomplete checkpoint %s (a newer one is complete)", entry)

    # ---- resume

    def incomplete(self) -> list[str]:
        state = read_state(self.run_dir)
        done = set(state["checkpoints"]) if state else set()
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.name.startswith("step-") and p.name not in done)

    def newest(self) -> Path | None:
        """The newest complete checkpoint, as state.json names it (relative: a run folder can be moved)."""
        state = read_state(self.run_dir)
        return self.run_dir / state["path"] if state else None

    def choose(self, resume_from: str) -> Path | None:
        """The checkpoint to resume from: --resume-from, else the newest complete one, else None. A collective, so
        that every rank refuses alike or resumes from the same checkpoint: a rank refusing alone, or loading another
        checkpoint (or none), would leave the others waiting in a collective it never joins."""
        problem, path = "", None
        if resume_from:
            path = self.root / resume_from
            if not (path / MANIFEST).exists() or not (path / ".metadata").exists():
                problem = f"--resume-from {resume_from}: {path} is not a complete checkpoint"
        else:
            path = self.newest()
        views = gather_objects((problem, path.name if path else ""))
        if problems := [p for p, _ in views if p]:
            raise UserError(problems[0])
        if len({name for _, name in views}) > 1:
            seen = ", ".join(f"rank {r}: {name or 'none'}" for r, (_, name) in enumerate(views))
            raise UserError(f"the ranks do not see the same newest checkpoint in {self.root} ({seen}); every rank "
                            "must see the same --save-dir (a file system shared by every node, not a copy)")
        return path

    def verify(self, path: Path) -> None:
        """Sizes and checksums of every file in the manifest; the files are split across ranks. A collective: every
        rank raises the same refusal."""
        try:
            bad = self._check_files(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # raised here alone, the others would wait
            bad = [f"{path / MANIFEST} or a file it names cannot be read ({type(exc).__name__}: {exc})"]
        if problems := sorted(p for part in gather_objects(bad) for p in part):
            older = [c for c in (read_state(self.run_dir) or {}).get("checkpoints", []) if c < path.name]
            hint = (f"resume from the previous one with --resume-from {older[-1]}" if older else
                    "no older checkpoint exists; pass --no-resume to start a new run")
            raise UserError(f"checkpoint {path.name} is damaged: {problems[0]}; {hint}")

    def _check_files(self, path: Path) -> list[str]:
        """What is wrong with this rank's part of the manifest's files."""
        if not (path / MANIFEST).exists():
            return [f"{path / MANIFEST} is missing: it was not completed"]
        files = json.loads((path / MANIFEST).read_text())["files"]
        bad = []
        for name in sorted(files)[self.dist.rank::self.dist.world_size]:
            f, want = path / name, files[name]
            if not f.exists():
                bad.append(f"{f} is missing")
            elif f.stat().st_size != want["bytes"]:
                bad.append(f"{f} is truncated ({f.stat().st_size} of {want['bytes']} bytes)")
            elif file_digest(f) != want["xxh3"]:
                bad.append(f"{f} is corrupt (checksum mismatch)")
        return bad

    def load(self, path: Path, strategy: Strategy, optimizer) -> dict:
        """Model and optimizer through DCP (resharding to this world size), RNG of this rank; returns trainer.json."""
        state = strategy.state_dict(optimizer)
        dcp.load(state, checkpoint_id=str(path))
        strategy.load_state_dict(state, optimizer)
        rng = path / f"rng-{self.dist.rank}.json"
        if rng.exists():  # a rank that did not exist when it was saved keeps its seeded state
            set_rng_state(json.loads(rng.read_text()))
        self.last_step = int(path.name.removeprefix("step-"))
        return json.loads((path / TRAINER).read_text())

    def rank_state(self, path: Path) -> dict | None:
        """This rank's own state saved beside the checkpoint (Checkpointer.save's rank_state), None where there is
        none (or this rank did not exist when it was saved). Verified with the checkpoint's other files."""
        file = path / f"{RANK_STATE}{self.dist.rank}.pt"
        return torch.load(file, map_location=self.dist.device, weights_only=True) if file.exists() else None


def load_checkpoint_model(checkpoint: Path, d: Dist) -> tuple[Strategy, Path, dict]:
    """The model of a training checkpoint, distributed over this process group (no optimizer), the base model's
    folder (config and tokenizer; its weights are read only under an adapter checkpoint) and the run's fingerprint.
    A collective."""
    from pipeline.prep.hub import resolve_model_dir

    if not (checkpoint / TRAINER).exists() or not (checkpoint / ".metadata").exists():
        raise UserError(f"--checkpoint {checkpoint} is not a complete checkpoint (no {TRAINER} or .metadata)")
    fingerprint = json.loads((checkpoint / TRAINER).read_text())["fingerprint"]
    model_dir = resolve_model_dir(fingerprint["model_name"])
    if fingerprint.get("base_weights"):  # the adapters were trained on this base: another would merge wrong
        check_same_base(model_dir, fingerprint["model_name"], fingerprint["base_weights"], f"--checkpoint {checkpoint}")
    elif fingerprint.get("adapter"):  # a run from before base_weights: at least sound weights
        unchanged_weights(model_dir, fingerprint["model_name"])
    reward = fingerprint.get("objective", {}).get("objective") == "reward"
    return (checkpoint_model(checkpoint, model_dir, d, fingerprint.get("adapter", {}), reward), model_dir,
            fingerprint)


def checkpoint_model(checkpoint: Path, model_dir: Path, d: Dist, adapter: dict | None = None,
                     reward: bool = False) -> Strategy:
    """The model of a complete training checkpoint of the model in model_dir (its config), in fp32 under fsdp2
    FULL_SHARD (ddp for QLoRA on one rank), no optimizer. adapter: the run's adapter settings
    (preflight.adapter_settings) when it trained adapters, which the checkpoint holds alone: the base weights are
    then read from model_dir. reward: a reward model's checkpoint (its score head in place of the output layer). A
    collective."""
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.config import ModelConfig
    from pipeline.model.registry import transforms_for
    from pipeline.model.reward_head import RewardHead, pad_id, reward_head_layout

    # fsdp2 on one rank cannot rebuild QLoRA's NF4 weights (FSDP2._check_nf4): ddp there, which holds them whole
    one_rank_nf4 = (adapter or {}).get("adapter") == "qlora" and d.world_size == 1
    config = ModelConfig(model_name=str(model_dir), precision="fp32", strategy="ddp" if one_rank_nf4 else "fsdp2",
                         sharding="NO_SHARD" if one_rank_nf4 else "FULL_SHARD", vocab_parallel="off",
                         **(adapter or {}))
    hf_config = AutoConfig.from_pretrained(model_dir)
    heads = [RewardHead(reward_head_layout(hf_config), pad_id(AutoTokenizer.from_pretrained(model_dir)))] if reward \
        else []
    strategy = make_strategy(config, d, torch.float32, [*transforms_for(config, torch.float32), *heads])
    strategy.build(hf_config)
    if strategy.freezes_base:
        strategy.load_weights(model_dir)
    state = strategy.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint))
    strategy.load_state_dict(state)
    return strategy
