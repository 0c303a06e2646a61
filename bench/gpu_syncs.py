"""Host syncs and GPU idle time in fsdp1.py's training step, from a torch.profiler trace of the real Trainer.

Builds the Trainer exactly as fsdp1.py does (same flags), runs --warmup steps, then profiles --steps steps with
CUDA's sync debug mode on. Prints one JSON line: synchronising CUDA runtime calls per step (cudaStreamSynchronize,
cudaDeviceSynchronize, cudaEventSynchronize; blocking copies are the cudaMemcpy* calls that took the host more
than 1 ms), the sync-debug warnings (ops that waited for the GPU), and the share of the profiled wall time the
GPU spent in kernels. Optionally writes the Chrome trace (gzipped).

    python bench/gpu_syncs.py --trace OUT.json.gz -- -e syncs -d DATASET -m MODEL -b 8 --seq-length 2048 ...
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trace", type=Path, default=None)
    p.add_argument("flags", nargs=argparse.REMAINDER, help="fsdp1.py flags, after --")
    args = p.parse_args()
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pipeline import config_merge as config_mod
    from pipeline.distributed.runtime import init_distributed
    from pipeline.train.preflight import preflight
    from pipeline.train.telemetry import setup_logging
    from pipeline.train.trainer import Trainer

    cfg = config_mod.resolve([f for f in args.flags if f != "--"])
    plan = preflight(cfg)
    cfg = plan.config
    d = init_distributed()
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    cfg.run_dir.mkdir(parents=True)
    setup_logging(cfg.run_dir, d.rank)
    trainer = Trainer(cfg, d, plan)
    for _ in range(args.warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught, profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        warnings.simplefilter("always")
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()  # ours: one, subtracted below
        wall_us = (time.perf_counter() - start) * 1e6
    events = prof.events()
    calls = Counter(e.name for e in events if e.device_type == DeviceType.CPU and "Synchronize" in e.name)
    calls["cudaDeviceSynchronize"] -= 1
    blocking = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name.startswith("cudaMemcpy")
                   and e.cpu_time_total > 1000)
    kernel_us = sum(e.device_time_total for e in events if e.device_type == DeviceType.CUDA)
    callers = Counter(" < ".join(f for f in e.stack if "site-packages/torch/" not in f)[:300] for e in events
                      if e.name in ("aten::is_nonzero", "aten::item", "aten::nonzero") and e.stack)
    sync_warnings = Counter(str(w.message).split("\n")[0][:120] for w in caught
                            if "synchroniz" in str(w.message).lower())
    if args.trace:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        raw = args.trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(args.trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    print(json.dumps({"steps": args.steps,
                      "sync_calls_per_step": {k: v / args.steps for k, v in calls.items() if v > 0},
                      "blocking_copies_per_step": blocking / args.steps,
                      "sync_debug_warnings": dict(sync_warnings), "sync_callers": dict(callers),
                      "gpu_kernel_busy": round(kernel_us / wall_us, 3),
                      "step_ms": round(wall_us / args.steps / 1000, 1)}))
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    from pipeline.errors import run_cli

    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
