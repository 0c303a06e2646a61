"""What `python -m pipeline.experiments analyze` reports: each experiment's steady-state speed, memory, exposed
communication and losses from its metrics.jsonl, against a baseline; written as summary.md, summary.csv and
summary.png in the experiment folder."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import UserError
from pipeline.fsutil import write_text_atomic
from pipeline.train.telemetry import read_metrics


@dataclass(frozen=True)
class Summary:
    name: str
    status: str
    """done, failed (see error), or not run."""
    error: str = ""
    steps: int = 0
    """The last step logged."""
    step_s: float | None = None
    """Median seconds per step over the steady state (log windows after the skipped first steps)."""
    step_s_stdev: float | None = None
    tokens_per_s: float | None = None
    """Median over the steady state's log windows, all ranks together."""
    peak_gb_by_rank: tuple[float, ...] = ()
    """Each rank's largest peak (GiB above what it held before the model was built)."""
    comm_ms: float | None = None
    """Median exposed communication per step (absent where the strategy cannot time it)."""
    train_loss: float | None = None
    eval_loss: float | None = None
    speedup: float | None = None
    """Baseline's s/step over this one's."""
    loss_delta: float | None = None
    """This final train loss minus the baseline's."""


def summarise(name: str, status: str, error: str, events: list[dict], skip_steps: int) -> Summary:
    """One experiment's figures. Steady state: the log windows that start after step skip_steps; a window's seconds
    per step is its wall time over its steps; a window across a restart (a resume event inside it) is left out, and a
    step logged twice, before a kill and after the resume, counts once: the later one."""
    train = {e["step"]: e for e in events if e["event"] == "train"}
    evals = [e for e in events if e["event"] == "eval"]
    if not train:
        return Summary(name, status, error)
    ordered = [train[s] for s in sorted(train)]
    restarts = [e["time"] for e in events if e["event"] == "resume"]
    per_step = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(ordered, ordered[1:], strict=False)
                if a["step"] >= skip_steps and not any(a["time"] < t <= b["time"] for t in restarts)]
    steady = [e for e in ordered if e["step"] > skip_steps]
    comm = [e["time_ms"]["comm"] for e in steady if "comm" in e.get("time_ms", {})]
    ranks = [e["mem_gb"]["peak_by_rank"] for e in ordered if "peak_by_rank" in e.get("mem_gb", {})]
    return Summary(
        name, status, error, steps=ordered[-1]["step"],
        step_s=statistics.median(per_step) if per_step else None,
        step_s_stdev=statistics.stdev(per_step) if len(per_step) > 1 else None,
        tokens_per_s=statistics.median(rates) if (rates := [e["tokens_per_s"] for e in steady
                                                            if e.get("tokens_per_s") is not None]) else None,
        peak_gb_by_rank=tuple(max(r[i] for r in ranks) for i in range(len(ranks[0]))) if ranks else (),
        comm_ms=statistics.median(comm) if comm and len(comm) == len(steady) else None,
        train_loss=ordered[-1]["loss"], eval_loss=evals[-1]["loss"] if evals else None)


def against(s: Summary, base: Summary) -> Summary:
    speedup = base.step_s / s.step_s if s.step_s and base.step_s else None
    delta = s.train_loss - base.train_loss if s.train_loss is not None and base.train_loss is not None else None
    return Summary(**{**asdict(s), "speedup": speedup, "loss_delta": delta})


def collect(folder: Path, skip_steps: int) -> list[Summary]:
    """Every experiment of the folder, in spec order, whether it ran or not."""
    manifest = folder / "experiments.json"
    if not manifest.is_file():
        raise UserError(f"--experiment-dir {folder} has no experiments.json: write it with `python -m "
                        "pipeline.tools.experiments run --spec FILE --output-dir DIR`")
    out = []
    for name in json.loads(manifest.read_text())["experiments"]:
        path = folder / "status" / f"{name}.json"
        record = json.loads(path.read_text()) if path.is_file() else {"status": "not run"}
        metrics = folder / name / "metrics.jsonl"
        events = read_metrics(metrics) if metrics.is_file() else []
        out.append(summarise(name, record["status"], record.get("error", ""), events, skip_steps))
    return out


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


COLUMNS = ("experiment", "status", "steps", "s/step (± stdev)", "tokens/s", "peak GiB by rank", "comm ms/step",
           "train loss", "eval loss", "speedup", "loss vs baseline")


def row(s: Summary) -> list[str]:
    step = "—" if s.step_s is None else f"{s.step_s:.3f}" + (
        f" ± {s.step_s_stdev:.3f}" if s.step_s_stdev is not None else "")
    status = s.status if not s.error else f"{s.status}: {s.error}"
    return [s.name, status, str(s.steps), step, _num(s.tokens_per_s, ".0f"),
            " / ".join(f"{p:.2f}" for p in s.peak_gb_by_rank) or "—", _num(s.comm_ms, ".1f"),
            _num(s.train_loss, ".4f"), _num(s.eval_loss, ".4f"), _num(s.speedup, ".2f") + ("x" if s.speedup else ""),
            _num(s.loss_delta, "+.4f")]


def csv_cell(value: object) -> object:
    if value is None:
        return ""
    return " ".join(map(str, value)) if isinstance(value, tuple) else value


def markdown(rows: list[list[str]], baseline: str, skip_steps: int) -> str:
    lines = [f"Baseline: {baseline}. Steady state: steps after {skip_steps}. Speedup: the baseline's s/step over the "
             "experiment's; loss vs baseline: final train loss difference.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def chart(summaries: list[Summary], path: Path, baseline: str) -> None:
    """Seconds per step (with the spread) per experiment that has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [s for s in summaries if s.step_s is not None]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(timed) + 1.5))
    ax.barh([s.name for s in timed], [s.step_s for s in timed], xerr=[s.step_s_stdev or 0 for s in timed],
            color=["tab:gray" if s.name == baseline else "tab:blue" for s in timed])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (steady state; lower is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def analyze(folder: Path, baseline: str, skip_steps: int) -> int:
    summaries = collect(folder, skip_steps)
    base = next((s for s in summaries if s.name == baseline), None)
    if base is None:
        names = ", ".join(s.name for s in summaries)
        raise UserError(f"--baseline {baseline} is not an experiment of {folder}; its experiments: {names}")
    if base.step_s is None:
        raise UserError(f"baseline {baseline} has no steady-state steps to compare with ({base.status}"
                        f"{': ' + base.error if base.error else ''}); run it, or pick another --baseline")
    summaries = [against(s, base) for s in summaries]
    rows = [row(s) for s in summaries]
    text = markdown(rows, baseline, skip_steps)
    write_text_atomic(folder / "summary.md", text)
    with (folder / "summary.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow([f for f in Summary.__dataclass_fields__])
        writer.writerows([[csv_cell(v) for v in asdict(s).values()] for s in summaries])
    chart(summaries, folder / "summary.png", baseline)
    print(text, end="")
    print(f"wrote {folder / 'summary.md'}, summary.csv and summary.png")
    return 0
