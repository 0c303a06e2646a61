"""Per-phase timers, throughput, MFU, memory, and the run's logs: train.log, metrics.jsonl, TensorBoard, loss.png.

Run-level side effects (stdout lines, metrics.jsonl, TensorBoard, the progress bar, the plot) happen on one rank
only: everything is behind `Telemetry.enabled`, which is true on rank 0. train.log is written by every rank,
each line tagged with its rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

from pipeline.errors import UserError, disk_problem, naming
from pipeline.fsutil import write_atomic
from pipeline.model.modeling import layer_configs
from pipeline.signals import Interrupted
from pipeline.strategies.memory import GIB
from pipeline.train.trackers import Trackers

PHASES = ("data", "forward", "backward", "update", "total")
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}
"""Dense bf16 peak by device name (H100/H200 SXM figures)."""

log = logging.getLogger("pipeline")


def setup_logging(run_dir: Path, rank: int) -> None:
    """train.log on every rank (rank-tagged, timestamped); the console for rank 0, warnings only for the others."""
    log.setLevel(logging.INFO)
    log.handlers.clear()
    log.propagate = False
    fmt = logging.Formatter(f"%(asctime)s [rank={rank}] %(levelname)s %(message)s")
    file_handler = logging.FileHandler(run_dir / "train.log")
    file_handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter(f"[rank={rank}] %(message)s"))
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.addHandler(file_handler)
    log.addHandler(console)


class PhaseTimer:
    """Milliseconds per phase, averaged over the steps of a log window.

    On GPU each phase records a pair of CUDA events and nothing waits for them until the window is read: no host
    sync per phase. On CPU the work is synchronous, so the wall clock is exact.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.steps = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.totals[name] += (time.perf_counter() - t0) * 1000

    def step_done(self) -> None:
        self.steps += 1

    def add(self, name: str, ms: float) -> None:
        """Time measured elsewhere (a strategy's wait on collectives), reported beside the phases."""
        self.totals[name] += ms

    def read(self) -> dict[str, float]:
        """Average ms per step for each phase since the last read (a host sync on GPU), then reset."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for name, start, end in self.pending:
                self.totals[name] += start.elapsed_time(end)
        steps = max(self.steps, 1)
        out = {p: round(self.totals.get(p, 0.0) / steps, 2) for p in (*PHASES, *sorted(set(self.totals) - set(PHASES)))}
        self.totals.clear()
        self.pending.clear()
        self.steps = 0
        return out


def memory_gb(device: torch.device) -> dict[str, float]:
    """Allocated/reserved, current and peak since the last call (GPU); on CPU the resident set and its peak since the
    last call (Linux resets the peak through /proc/self/clear_refs; elsewhere it is the lifetime peak)."""
    if device.type == "cuda":
        out = {"alloc": torch.cuda.memory_allocated(device), "peak_alloc": torch.cuda.max_memory_allocated(device),
               "reserved": torch.cuda.memory_reserved(device),
               "peak_reserved": torch.cuda.max_memory_reserved(device)}
    else:
        rss, peak = host_rss()
        out = {"alloc": rss, "peak_alloc": peak, "reserved": rss, "peak_reserved": peak}
    reset_peak_memory(device)
    return {k: round(v / GIB, 3) for k, v in out.items()}


def host_rss() -> tuple[int, int]:
    """This process's resident bytes now and at their peak (VmHWM; the lifetime peak where /proc lacks it)."""
    rss = psutil.Process().memory_info().rss
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return rss, max(rss, hwm)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak from the memory in use now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # 5: reset the peak resident set size (Linux >= 4.0)
    except OSError:
        pass


def memory_in_use(device: torch.device) -> int:
    """Bytes this rank holds now: allocated by the CUDA caching allocator, or resident on CPU."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else host_rss()[0]


def flops_per_token(config, num_matmul_params: int, seq_length: int, frozen_matmul_params: int = 0) -> float:
    """Training FLOPs per token (forward and backward), as torchtitan and PaLM count them: 6 x the parameters of
    the matrix products (the LM head included; of a mixture of experts, the experts a token is routed to:
    modeling.param_counts) + 12 x heads x head_dim x seq_length per layer for attention. Of those parameters, the
    frozen_matmul_params of a frozen base (adapters) count 4: forward and the gradient of their input, no gradient of
    their own (DoRA's weight norms, r x (in + out) per layer and step rather than per token, are left out)."""
    attention = 12 * seq_length * sum(c.num_attention_heads * (getattr(c, "head_dim", None) or
                                                                c.hidden_size // c.num_attention_heads)
                                      for c in layer_configs(config))  # layer by layer: their heads may differ
    return 6 * (num_matmul_params - frozen_matmul_params) + 4 * frozen_matmul_params + attention


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def finite_or_text(x: float) -> float | str:
    """x, or "nan"/"inf" as text: JSON has no non-finite numbers."""
    return x if math.isfinite(x) else str(x)


def numbers(fields: dict, prefix: str) -> dict[str, float]:
    """The finite numbers among fields, each named prefix/key; a dict's own under prefix/key/its key."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            out.update(numbers(value, f"{prefix}/{key}"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{prefix}/{key}"] = value
    return out


class Telemetry:
    """Writes the run's events; only the enabled (rank 0) instance touches stdout, files and TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, start_step: int,
                 report_to: str = "tensorboard", params: dict | None = None):
        """report_to: --report-to, the trackers the events' numbers and texts also go to; params: what they record
        of the run (its config and fingerprint)."""
        self.run_dir, self.enabled = run_dir, enabled
        self.metrics = _open_events(run_dir / "metrics.jsonl") if enabled else None
        self.trackers: Trackers | None = None
        self.bar = None
        self._console = contextlib.nullcontext()
        if enabled:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.trackers = Trackers(run_dir, report_to, params or {})
            # a bar on a terminal only (redirected, it is noise in the file); log lines go through tqdm.write
            # meanwhile, which lifts the bar, prints the line and puts the bar back under it
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr,
                            disable=not sys.stderr.isatty())
            self._console = logging_redirect_tqdm(loggers=[log])
            self._console.__enter__()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # a clean end, a stop by signal or a refusal (divergence) plots what the run has; a crash only ends the bar
        # and the files, before its message
        status = "FINISHED" if exc_type is None else "KILLED" if issubclass(exc_type, Interrupted) else "FAILED"
        self.close(plot=exc_type is None or issubclass(exc_type, (UserError, Interrupted)), status=status)

    def event(self, kind: str, step: int, tracked: bool = True, **fields) -> None:
        """One line of metrics.jsonl; when tracked, its finite numbers to the trackers too (TensorBoard's
        scalars), named EVENT/FIELD (EVENT/FIELD/KEY inside a field that is a dict: time_ms, mem_gb)."""
        if not self.enabled:
            return
        record = {"event": kind, "step": step, "time": round(time.time(), 3), **fields}
        with naming(self.run_dir / "metrics.jsonl"):
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if tracked:
            self.trackers.scalars(step, numbers(fields, kind))

    def text(self, tag: str, step: int, text: str) -> None:
        """Text for the trackers that show text (TensorBoard's text tab, MLflow's artifacts, W&B)."""
        if self.enabled:
            self.trackers.text(tag, step, text)

    def human(self, line: dict) -> None:
        """The seed-style `[rank=0] {...}` line, on the console (above the bar) and in train.log."""
        if self.enabled:
            log.info("%s", line)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self, plot: bool = True, status: str = "FINISHED") -> None:
        """End the bar and flush the files; plot the losses unless the run is failing; end the trackers' runs with
        status (FINISHED, KILLED: stopped by a signal, FAILED). Once."""
        if not self.enabled or self.metrics.closed:
            return
        draw = [lambda: plot_losses(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")] if plot else []
        for closing in [self.bar.close, lambda: self._console.__exit__(None, None, None),
                        lambda: self.trackers.close(status), self.metrics.close, *draw]:
            try:  # what is left of the logs must not hide why the run ends (a full disk fails every write here)
                closing()
            except OSError as exc:
                log.warning("%s", disk_problem(exc) or f"{type(exc).__name__}: {exc}")


def _open_events(path: Path):
    """metrics.jsonl for appending. A line a killed run left unended is ended first, so this run's first event is a
    line of its own instead of the tail of a line no reader can parse."""
    unended = False
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            unended = fh.read(1) != b"\n"
    events = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the whole run)
    if unended:
        events.write("\n")
    return events


def read_metrics(path: Path) -> list[dict]:
    """A run's metrics.jsonl events. A line cut short by a kill, or anything else that is not an event (bytes that
    are not UTF-8, a JSON value that is not an object with a kind and a step), is left out rather than failing the
    reader."""
    events = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str) and isinstance(event.get("step"), int):
            events.append(event)
    return events


def plot_losses(metrics: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, tuple[list[int], list[float]]] = {"train": ([], []), "eval": ([], [])}
    for event in read_metrics(metrics):
        if event["event"] in series and isinstance(event.get("loss"), (int, float)):
            series[event["event"]][0].append(event["step"])
            series[event["event"]][1].append(event["loss"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*series["train"], label="train")
    if series["eval"][0]:
        ax.plot(*series["eval"], "o-", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(metrics.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_atomic(out, lambda fh: fig.savefig(fh, format="png", dpi=100))
    plt.close(fig)
