"""--tiled-mlp on against off: the peak memory one training step of a long sequence adds, and its seconds.

SmolLM2-135M's layer shape (hidden 576, intermediate 1536, 9 heads, 3 KV heads) with --layers of them and a
1,024-token vocabulary (the logits would otherwise dwarf what is measured), random
weights, fp32 on the CPU, batch 1 x --seq tokens, each decoder layer under activation checkpointing (as a long
sequence is trained): one forward and backward in a process of its own per case, its peak resident memory above what
it held once the model and the batch were made (VmHWM, which starts anew at exec), and the step's wall seconds; the
estimate's activations for the same shape (pipeline/strategies/memory.py).

    .venv/bin/python bench/tiled_mlp.py --seq 16384 --layers 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import common

STEP = """
import json, sys, time, torch
from transformers import LlamaConfig, AutoModelForCausalLM
from pipeline.model.tiled_mlp import TiledMLP
seq, layers, tiled = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "on"
torch.manual_seed(0)
config = LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=seq,
                     attn_implementation="sdpa")
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
if tiled:
    TiledMLP().apply(model)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()
ids = torch.randint(0, 1024, (1, seq))
hwm = lambda: int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")))
start = hwm()
t = time.perf_counter()
loss = model(input_ids=ids, labels=ids, logits_to_keep=0).loss
loss.backward()
print("RESULT", json.dumps({"seconds": time.perf_counter() - t, "peak_mb": (hwm() - start) / 1024,
                            "loss": loss.item()}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    from dataclasses import replace

    from transformers import LlamaConfig

    from pipeline.strategies.memory import Shape, Workload
    from pipeline.strategies.registry import estimate

    shape = Shape.of(LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536,
                                 num_hidden_layers=args.layers, num_attention_heads=9, num_key_value_heads=3))
    work = Workload("ddp", "NO_SHARD", 1, 1, 4, 1, args.seq, activation_checkpointing=True, device="cpu")
    cases = {}
    for mode in ("off", "on"):
        proc = subprocess.run([sys.executable, "-c", STEP, str(args.seq), str(args.layers), mode], cwd=common.ROOT,
                              capture_output=True, text=True, env=common.bench_env())
        result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[7:])
        result["estimate_mb"] = estimate(shape, replace(work, tiled_mlp=mode == "on")).activations / 2**20
        cases[mode] = result
        print(mode, result, flush=True)
    raw = {"machine": common.machine(), "seq": args.seq, "layers": args.layers, "cases": cases}
    out = common.ROOT / "bench" / "data" / "tiled_mlp.json"
    out.write_text(json.dumps(raw, indent=2))
    body = [f"- Machine: {raw['machine']}.",
            f"- Command: `.venv/bin/python bench/tiled_mlp.py --seq {args.seq} --layers {args.layers}`; raw results "
            f"in {out.relative_to(common.ROOT)}.",
            f"- SmolLM2-135M's layer shape x {args.layers} layers, random weights, fp32 on the CPU, batch 1 x "
            f"{args.seq:,} tokens, activation checkpointing, one forward and backward per process: the peak "
            "resident memory it added (VmHWM), its seconds, and the estimate's activations (the losses are equal: "
            f"{cases['off']['loss']:.6f} and {cases['on']['loss']:.6f}).", "",
            common.table(["--tiled-mlp", "peak MB above start", "seconds", "estimated activations MB"],
                         [[k, round(v["peak_mb"]), round(v["seconds"], 1), round(v["estimate_mb"])]
                          for k, v in cases.items()])]
    common.update_section("tiled_mlp", "\n".join(body))
    print("\n".join(body))


if __name__ == "__main__":
    main()
