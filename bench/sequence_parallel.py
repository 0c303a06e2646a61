"""--sequence-parallel 2 against one process: the peak memory one training step of a long sequence adds per rank,
its seconds, and the estimate's activations per rank; with the tiled MLP off and on.

SmolLM2-135M's layer shape (hidden 576, intermediate 1536, 9 heads, 3 KV heads: 9 heads split 2 ways do not divide,
so 8 heads and 2 KV heads here, KV heads repeated as ALST does where fewer than the ranks) with --layers of them and a
1,024-token vocabulary, random weights, fp32 on the CPU, batch 1 x --seq tokens, each decoder layer under activation
checkpointing: one forward and backward per case, in processes of their own (two gloo ranks under torchrun for
--sequence-parallel 2, each with the whole model, as ddp holds it), each rank's peak resident memory above what it
held once the model and the batch were made (VmHWM, every allocation above 64 KiB mapped apart so that a freed block
leaves the resident set), and the step's wall seconds. The losses of the cases agree.

    .venv/bin/python bench/sequence_parallel.py --seq 16384 --layers 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import common

STEP = """
import json, os, sys, time, torch
import torch.distributed as dist
from transformers import LlamaConfig, AutoModelForCausalLM
from pipeline.data.batches import Batch
from pipeline.distributed.runtime import Dist
from pipeline.model.tiled_mlp import TiledMLP
from pipeline.strategies.sequence_parallel import SequenceParallel
seq, layers, tiled, degree, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "on", int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
config = LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=72, max_position_embeddings=seq,
                     attn_implementation="sdpa")
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
if tiled:
    TiledMLP().apply(model)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()
ids = torch.randint(0, 1024, (1, seq))
batch = Batch(ids, ids.clone(), None)
rank = 0
if degree > 1:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sp = SequenceParallel(degree, Dist(rank, degree, rank, degree, torch.device("cpu"), degree))
    sp.install(model)
    batch = sp.split(batch)
extra = {"shift_labels": batch.labels} if batch.shifted else {}
targets = seq - 1
hwm = lambda: int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")))
start = hwm()
t = time.perf_counter()
loss = model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids,
             num_items_in_batch=targets, use_cache=False, **extra).loss
loss.backward()
seconds = time.perf_counter() - t
if degree > 1:
    total = loss.detach().clone()
    dist.all_reduce(total)
    loss = total
with open(f"{out}-{rank}.json", "w") as f:  # the ranks' lines would interleave on torchrun's stdout
    json.dump({"rank": rank, "seconds": seconds, "peak_mb": (hwm() - start) / 1024, "loss": loss.item()}, f)
"""


def run_case(seq: int, layers: int, tiled: str, degree: int) -> list[dict]:
    """Each rank's result of one case."""
    folder = Path(tempfile.mkdtemp())
    args = [str(seq), str(layers), tiled, str(degree), str(folder / "rank")]
    launch = [sys.executable, "-c", STEP] if degree == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(degree),
         "--no-python", sys.executable, "-c", STEP]
    # every allocation above 64 KiB its own mapping, returned at free: glibc's default raises that threshold as large
    # blocks are freed and then serves them from its heap, whose freed pages it keeps, so the resident peak measured
    # the allocation pattern rather than the bytes in use (one process's peak fell from 1,202 to 1,087 MB as its
    # sequence doubled)
    env = common.bench_env(MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([*launch, *args], capture_output=True, text=True, cwd=common.ROOT, env=env)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return [json.loads((folder / f"rank-{rank}.json").read_text()) for rank in range(degree)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    from dataclasses import replace

    from transformers import LlamaConfig

    from pipeline.strategies.memory import Shape, Workload
    from pipeline.strategies.registry import estimate

    shape = Shape.of(LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, head_dim=72,
                                 num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2))
    base = Workload("ddp", "NO_SHARD", 2, 2, 4, 1, args.seq, activation_checkpointing=True, device="cpu")
    rows = []
    for degree in (1, 2):
        for tiled in ("off", "on"):
            ranks = run_case(args.seq, args.layers, tiled, degree)
            work = replace(base, tiled_mlp=tiled == "on", sequence_parallel=degree)
            rows.append({"sequence_parallel": degree, "tiled_mlp": tiled,
                         "peak_mb": round(max(r["peak_mb"] for r in ranks)),
                         "seconds": round(max(r["seconds"] for r in ranks), 1), "loss": round(ranks[0]["loss"], 6),
                         "estimated_activations_mb": round(estimate(shape, work).activations / 2**20)})
            print(rows[-1], flush=True)
    raw = {"machine": common.machine(), "seq": args.seq, "layers": args.layers, "rows": rows}
    out = common.ROOT / "bench" / "data" / "sequence_parallel.json"
    out.write_text(json.dumps(raw, indent=2))
    body = [f"- Machine: {raw['machine']}.",
            f"- Command: `.venv/bin/python bench/sequence_parallel.py --seq {args.seq} --layers {args.layers}`; raw "
            f"results in {out.relative_to(common.ROOT)}.",
            f"- SmolLM2-135M's layer width (8 heads of 72, 2 KV heads) x {args.layers} layers, random weights, fp32 on "
            f"the CPU, batch 1 x {args.seq:,} tokens, activation checkpointing, one forward and backward: each rank's "
            "peak resident memory above what it held before the step (VmHWM, with glibc returning every block above "
            "64 KiB at free; the largest rank's), the step's seconds, and the estimate's activations per rank. Losses: "
            + ", ".join(f"{r['loss']:.6f}" for r in rows) + ".", "",
            common.table(["--sequence-parallel", "--tiled-mlp", "peak MB above start", "seconds",
                          "estimated activations MB"],
                         [[r["sequence_parallel"], r["tiled_mlp"], r["peak_mb"], r["seconds"],
                           r["estimated_activations_mb"]] for r in rows])]
    common.update_section("sequence_parallel", "\n".join(body))
    print("\n".join(body))


if __name__ == "__main__":
    main()
