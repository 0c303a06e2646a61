"""The CPU's ceiling for a model shape: how fast any trainer could go, with no framework at all.

Three measurements, each in fresh processes of one thread (as a torchrun rank on this machine):
- the single-thread fp32 matrix-product rate at the shape's own products (forward, input- and weight-gradient
  orientation), one process alone and two at once;
- the model's bare forward and backward (the Hugging Face Llama, the trainers' model code) in one process alone and
  in two processes at once: the second is what two ranks sharing the machine can reach before any communication,
  optimizer or loop;
- the same forward and backward on a slice of the model (--slice-layers) in fp32, bf16 autocast and pure bf16:
  whether bf16 is worth choosing on this CPU.
Writes the cpu_ceiling_{preset} section of BENCHMARKS.md.

    .venv/bin/python bench/cpu_ceiling.py --preset smollm2-135m --seq 256 --batch 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from common import ROOT, bench_env, machine, table, update_section


def worker(args: argparse.Namespace) -> None:
    """One measurement in this process (one thread); prints its JSON result."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.prep.tiny import PRESETS

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = PRESETS[args.preset]
    if args.worker == "mm":
        h, i, v, t = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], args.batch * args.seq
        cases = {"up (t x h x i)": (t, h, i), "down (t x i x h)": (t, i, h), "weight grad (i x t x h)": (i, t, h),
                 "head (t x h x vocab)": (t, h, v)}
        out = {}
        for name, (m, k, n) in cases.items():
            a, b = torch.randn(m, k), torch.randn(k, n)
            a @ b
            start = time.perf_counter()
            for _ in range(5):
                a @ b
            out[name] = 2 * m * k * n * 5 / (time.perf_counter() - start) / 1e9
        print(json.dumps(out))
        return
    layers = args.slice_layers if args.worker != "fp32" else shape["num_hidden_layers"]
    model = LlamaForCausalLM(LlamaConfig(**{**shape, "num_hidden_layers": layers}))
    if args.worker == "bf16-pure":
        model = model.to(torch.bfloat16)
    x = torch.randint(0, shape["vocab_size"], (args.batch, args.seq))
    fwd, bwd = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=args.worker == "bf16-autocast"):
            loss = model(input_ids=x, labels=x).loss
        mid = time.perf_counter()
        loss.backward()
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
    print(json.dumps({"layers": layers, "fwd": statistics.median(fwd[1:]), "bwd": statistics.median(bwd[1:])}))


def measure(args: argparse.Namespace, kind: str, concurrent: int = 1, **overrides) -> list[dict]:
    """Run `concurrent` workers of one kind at the same time; their JSON results."""
    flags = {**vars(args), **overrides, "worker": kind}
    cmd = [sys.executable, __file__] + [f"--{k.replace('_', '-')}={v}" for k, v in flags.items() if v is not None]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=bench_env(), stdout=subprocess.PIPE, text=True)
             for _ in range(concurrent)]
    results = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"worker {kind} failed")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="forward+backward repeats (the first is left out)")
    p.add_argument("--slice-layers", type=int, default=4, help="layers of the fp32-against-bf16 slice")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    mm_alone, mm_pair = measure(args, "mm")[0], measure(args, "mm", 2)
    mm_rows = [[name, f"{rate:.1f}", " / ".join(f"{r[name]:.1f}" for r in mm_pair)] for name, rate in mm_alone.items()]
    def row(label: str, r: dict) -> list[str]:
        return [label, f"{r['fwd']:.2f}", f"{r['bwd']:.2f}", f"{r['fwd'] + r['bwd']:.2f}"]

    body_rows = [row("one process alone", measure(args, "fp32")[0])]
    body_rows += [row(f"two at once, process {k}", r) for k, r in enumerate(measure(args, "fp32", 2))]
    dtype_rows = [row(kind, measure(args, kind)[0]) for kind in ("fp32-slice", "bf16-autocast", "bf16-pure")]
    update_section(f"cpu_ceiling_{args.preset}", "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/cpu_ceiling.py --preset {args.preset} --seq {args.seq} --batch "
        f"{args.batch} --steps {args.steps} --slice-layers {args.slice_layers}`.",
        f"- Shape: `pipeline.tiny` preset {args.preset}, batch {args.batch} x seq {args.seq}, one thread per process, "
        f"median of {args.steps - 1} repeats after one left out.",
        "",
        table(["fp32 matrix product (this shape)", "GFLOP/s, one process", "GFLOP/s, two at once"], mm_rows),
        "",
        table(["bare forward+backward, fp32, whole model", "forward s", "backward s", "total s"], body_rows),
        "",
        table([f"{args.slice_layers}-layer slice", "forward s", "backward s", "total s"], dtype_rows),
    ]))


if __name__ == "__main__":
    main()
