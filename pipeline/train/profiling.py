"""Where a training step's time and memory go: torch.profiler over a few steps, summarised as a table of the top
kernels and the step split into kinds of work, plus what the device's memory holds at the step's start and at its
peak. The Trainer runs it under --profile-from/--profile-steps; bench/hf_worker.py runs the same profiler around
the Hugging Face Trainer's steps, so the two tables compare like with like.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

KINDS: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|all_?gather|reduce_?scatter|all_?reduce|c10d|gloo|broadcast|fsdp::"),
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention"),
    ("loss", r"cross_?entropy|nll_loss|log_softmax|logsumexp"),
    ("optimizer", r"adam|multi_tensor_apply|foreach|lerp|_amp_"),
    ("matmuls", r"gemm|xmma|cutlass|nvjet|cublas|wgmma|splitk|gemv|aten::mm$|aten::addmm|aten::bmm|aten::_scaled_mm"
                r"|sm\d\d_|ampere_|hopper_|mkldnn|aten::linear_backward|_weight_int4|aten::matmul"),
    ("copies", r"memcpy|memset|^(?!triton).*copy|aten::to$|catarray"),
    ("norms and elementwise", r"triton|elementwise|vectorized|reduce|norm|rsqrt|silu|gelu|unrolled|aten::(mul|add|sub"
                              r"|div|pow|mean|neg|sum|exp|where|fill_|index|gather|embedding|cos|sin|clamp|cat)"),
)
"""A kernel's (or, on the CPU, an operator's) kind, by the first pattern its lower-cased name matches."""
HOST_WAIT = "host waits (device idle)"
TOP = 20


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The time covered by the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(prof: profile, steps: int, wall_s: float) -> dict:
    """The top kernels and the split of a step by kind, per step. On a GPU: device kernels (their self time) and the
    time no kernel ran (host waits: launches, syncs, Python); on the CPU (a rehearsal): operators' self time."""
    rows = prof.key_averages()
    # a record_function's span on the GPU timeline (gpu_user_annotation) covers kernels counted on their own
    device = [r for r in rows if r.device_type == DeviceType.CUDA and r.self_device_time_total > 0
              and not getattr(r, "is_user_annotation", False)]
    on_device = bool(device)
    if on_device:
        timed = [(r.key, r.count, r.self_device_time_total) for r in device]
        covered = busy_us([(e.time_range.start, e.time_range.end) for e in prof.events()
                           if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)])
    else:
        timed = [(r.key, r.count, r.self_cpu_time_total) for r in rows if r.self_cpu_time_total > 0]
        covered = sum(t for _, _, t in timed)
    wall_us = wall_s * 1e6
    per_step = wall_us / steps
    timed.sort(key=lambda r: -r[2])
    kernels = [{"name": name[:160], "kind": kind_of(name), "calls": round(count / steps, 1),
                "ms_per_step": round(us / steps / 1000, 3), "share": round(us / wall_us, 4)}
               for name, count, us in timed[:TOP]]
    kinds: dict[str, float] = {}
    for name, _, us in timed:
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + us
    if on_device:  # kernel time shares the wall with the gaps between kernels; overlapping streams count once
        kinds[HOST_WAIT] = max(wall_us - covered, 0.0)
    split = {k: {"ms_per_step": round(v / steps / 1000, 3), "share": round(v / wall_us, 4)}
             for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    return {"device": "cuda" if on_device else "cpu", "steps": steps, "step_ms": round(per_step / 1000, 3),
            "kernel_ms_per_step": round(sum(t for _, _, t in timed) / steps / 1000, 3), "split": split,
            "top": kernels}


def memory_breakdown(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, float]:
    """GiB of what a step starts with, by part: 4-bit base weights (torchao's NF4, QLoRA), the embedding and output
    layer, the other frozen weights, the trained weights with their gradients and optimizer states; each rank's own
    shard. Storage shared by two names (a tied head) counts once."""
    from pipeline.model.nf4 import nf4_bytes

    seen: set[tuple[int, int]] = set()
    parts = dict.fromkeys(("nf4_base", "embedding_and_head", "frozen_other", "trained_and_states"), 0)
    edges = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
             if m is not None and getattr(m, "weight", None) is not None} if hasattr(model, "get_input_embeddings") \
        else set()

    def add(part: str, t: torch.Tensor) -> None:
        nf4 = nf4_bytes(t)
        local = t.to_local() if hasattr(t, "to_local") and nf4 is None else t
        key = (id(t), -1) if nf4 is not None else (local.untyped_storage().data_ptr(), local.device.index or 0)
        if key in seen or local.device.type != device.type:
            return
        seen.add(key)
        parts[part] += nf4 if nf4 is not None else local.untyped_storage().nbytes()

    for p in model.parameters():
        if p.requires_grad:
            add("trained_and_states", p)
            if p.grad is not None:
                add("trained_and_states", p.grad)
        else:
            nf4 = nf4_bytes(p) is not None
            add("nf4_base" if nf4 else "embedding_and_head" if id(p) in edges else "frozen_other", p)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                add("trained_and_states", value)
    return {k: round(v / 2**30, 6) for k, v in parts.items()}


class StepProfiler:
    """Profiles steps first .. first+count-1 (1-based, as the run counts them): call before() ahead of each step and
    after() once it is queued. The device is synchronised around the profiled steps (a host sync at their start and
    end: their window's throughput is a little lower). Writes DIR/profile.json (summary) and DIR/trace.json.gz
    (Chrome trace, for Perfetto or chrome://tracing); returns the summary once from after()."""

    def __init__(self, first: int, count: int, out: Path, device: torch.device,
                 breakdown: Callable[[], dict] | None = None) -> None:
        self.first, self.last, self.out, self.device = first, first + count - 1, out, device
        self.breakdown = breakdown
        """() -> dict of GiB by part, read just before the first profiled step (the optimizer's states exist)."""
        self.prof: profile | None = None
        self.started = 0.0
        self.at_start: dict = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, step: int) -> None:
        if step != self.first or not self.first:
            return
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.at_start = {"allocated_gib": round(torch.cuda.memory_allocated(self.device) / 2**30, 3)}
        if self.breakdown is not None:
            self.at_start["parts_gib"] = self.breakdown()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof = profile(activities=activities)
        self.prof.start()
        self.started = time.perf_counter()

    def after(self, step: int, final: bool = False) -> dict | None:
        """final: the run's last step, which ends a profile cut short by the run's end."""
        if self.prof is None or (step != self.last and not final):
            return None
        self._sync()
        wall = time.perf_counter() - self.started
        self.prof.stop()
        summary = summarize(self.prof, step - self.first + 1, wall)
        summary["first_step"] = self.first
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            summary["memory"] = {**self.at_start, "peak_allocated_gib": round(peak, 3),
                                 "activations_and_transients_gib": round(peak - self.at_start["allocated_gib"], 3)}
        elif "parts_gib" in self.at_start:
            summary["memory"] = dict(self.at_start)
        self.out.mkdir(parents=True, exist_ok=True)
        raw = self.out / "trace.json"
        self.prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(self.out / "trace.json.gz", "wb", compresslevel=1) as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        (self.out / "profile.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.prof = None
        return summary
