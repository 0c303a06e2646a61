"""A run's lm-evaluation-harness tasks (--lm-eval-tasks): checked before training, run at its end on the export
(RUN/hf, or the base with RUN/adapter when --merge-export is off) by rank 0 alone, after the process group is gone,
so no other rank waits on it. Results in RUN/lm_eval.json, lm-eval's table in train.log."""

from __future__ import annotations

import json
import traceback

import torch

from pipeline.config import Config
from pipeline.distributed.runtime import Dist, compute_dtype
from pipeline.errors import UserError, first_line
from pipeline.eval.harness import Tasks, run_tasks
from pipeline.fsutil import write_text_atomic
from pipeline.train.export import described, run_exports
from pipeline.train.preflight import Plan
from pipeline.train.telemetry import log

RESULTS = "lm_eval.json"
"""The file of RUN the results go to."""


def run_at_end(cfg: Config, plan: Plan, tasks: Tasks, d: Dist) -> None:
    """The tasks on what the run exported. Training is finished and exported whatever happens here, so a failure
    says so and how to run the tasks again alone."""
    exports = run_exports(cfg)
    model_dir, adapter_dir = (cfg.run_dir / "hf", None) if "hf" in exports else (plan.model_dir,
                                                                                cfg.run_dir / "adapter")
    model = f"{model_dir}" + (f" --adapter {adapter_dir}" if adapter_dir else "")
    log.info("lm-eval: %s on %s", ", ".join(tasks.names), model)
    again = f"python -m pipeline.evaluate {model} {tasks.flags()} --precision {cfg.model.precision}"
    try:
        report = run_tasks(tasks, model_dir, adapter_dir=adapter_dir, device=d.device,
                           dtype=compute_dtype(cfg.model.precision, d.device), batch_size=cfg.train.lm_eval_batch_size)
    except torch.OutOfMemoryError:
        raise UserError(f"training finished ({described(cfg)}), but rank 0 ran out of {d.device.type.upper()} memory "
                        f"running the lm-eval tasks; run them alone with a smaller batch: {again} --lm-eval-batch-size "
                        f"{max(1, cfg.train.lm_eval_batch_size // 2)}") from None
    except Exception as exc:  # a task that passed the dry run but fails on the real model: the run itself is complete
        traceback.print_exc()
        raise UserError(f"training finished ({described(cfg)}), but the lm-eval tasks failed ({first_line(exc)}); "
                        f"fix the task and run them alone: {again}") from None
    path = cfg.run_dir / RESULTS
    write_text_atomic(path, json.dumps({"model": str(model_dir), "adapter": adapter_dir and str(adapter_dir),
                                        "lm_eval": report}, indent=2) + "\n")
    for task, figures in report["results"].items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in figures.items()
                          if isinstance(v, float) and "_stderr" not in k)
        log.info("lm-eval %s: %s", task, shown)
    log.info("lm-eval results: %s", path)
