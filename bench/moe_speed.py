"""Expert parallelism against fsdp2 alone on a Qwen3-30B-A3B-shaped slice: hidden 2048, 32 query heads of 128 and 4
KV heads, 128 experts of width 768 of which 8 per token, as many layers as 2 ranks hold in this machine's memory, a
1,024-token vocabulary (the bench tokenizer's).

Each system trains --steps steps on 2 CPU ranks (fp32, batch 1 x --seq per rank): tokens/s from the median step
interval after --discard, each rank's peak memory (the trainer's own figure, above what it held before the model was
built), and the bytes one rank sends per step, measured on the loopback interface every gloo collective goes through
(/proc/net/dev's `lo` transmit counter, sampled every 20 ms and read at each step's end; both ranks' sends, halved),
beside the estimate's (pipeline/strategies/traffic.py) and its memory figure. The HF Trainer is not run: a DDP
replica of this slice needs about 20 bytes per parameter on each rank (the text says how much), beyond this machine.
Rewrites the moe_speed table of BENCHMARKS.md; raw results in bench/data/moe_speed.json.

    .venv/bin/python bench/moe_speed.py [--layers 1 --seq 512 --steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from common import ROOT, demo_dataset, fsdp1, intervals, machine, memory_plan, table, update_section

RAW = ROOT / "bench" / "data" / "moe_speed.json"
SLICE = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
             num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, norm_topk_prob=True,
             decoder_sparse_step=1, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
             tie_word_embeddings=False, dtype="float32")
"""Qwen/Qwen3-30B-A3B's config.json but its layer count and vocabulary."""
SYSTEMS = {"fsdp2": ("--expert-parallel", "1"), "fsdp2 + expert parallelism": ("--expert-parallel", "2")}


def build(out: Path, layers: int, device: str = "cpu", **overrides: object) -> Path:
    """OUT: the slice with `layers` layers (and SLICE's fields overridden), random weights, built once."""
    from transformers import Qwen3MoeConfig

    from pipeline.prep.tiny import DEFAULT_CORPUS, corpus_texts, save_random, train_tokenizer

    if (out / "config.json").exists():
        return out
    tokenizer = train_tokenizer(corpus_texts(DEFAULT_CORPUS), 1024)
    config = Qwen3MoeConfig(**{**SLICE, **overrides}, num_hidden_layers=layers, vocab_size=len(tokenizer),
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return save_random(out, config, tokenizer, 0, device)


class Loopback:
    """(epoch seconds, bytes sent on lo so far), every 20 ms, while running."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def sent() -> int:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
        raise RuntimeError("no loopback interface in /proc/net/dev")

    def _run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.time(), self.sent()))
            self.stop.wait(0.02)

    def __enter__(self) -> Loopback:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def at(self, t: float) -> int:
        """The counter at the last sample before t."""
        return max((b for s, b in self.samples if s <= t), default=self.samples[0][1])


def run(runs: Path, name: str, model: Path, data: Path, flags: tuple, args: argparse.Namespace) -> dict:
    with Loopback() as lo:
        _, events = fsdp1(runs, name.replace(" ", "_").replace("+", "ep"), model, data, "--strategy", "fsdp2",
                          "--seq-length", args.seq, "-b", 1, "--max-steps", args.steps, "--log-freq", 1,
                          "--ckpt-freq", 0, *flags)
    train = [e for e in events if e["event"] == "train"]
    ends = [e["time"] for e in train]
    sent = [(lo.at(b) - lo.at(a)) / 2 for a, b in zip(ends[args.discard - 1:-1], ends[args.discard:], strict=True)]
    step = statistics.median(intervals(ends, args.discard))
    return {"step_s": step, "tokens_per_s": 2 * args.seq / step, "sent_gb": statistics.median(sent) / 1e9,
            "peak_gb": max(max(e["mem_gb"]["peak_by_rank"]) for e in train[1:]),
            "load": train[-1].get("expert_load"), "losses": [e["loss"] for e in train]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "moe")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--discard", type=int, default=2)
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = build(args.workdir / f"qwen3-30b-a3b-slice-{args.layers}", args.layers)
    data = demo_dataset(args.workdir / "dataset")
    results = {}
    for name, flags in SYSTEMS.items():
        cfg, plan = memory_plan(model, 2, "--strategy", "fsdp2", "--precision", "fp32", "--seq-length", args.seq,
                                "-b", 1, *flags)
        from pipeline.strategies.memory import Shape
        from pipeline.strategies.registry import traffic_bytes, workload

        shape = Shape.of(plan_config(model))
        results[name] = {**run(args.workdir / "runs", name, model, data, flags, args),
                         "estimate_gb": plan.estimate.total / 2**30,
                         "estimate_sent_gb": traffic_bytes(shape, workload(cfg, "cpu", 2, 2)) / 1e9,
                         "params": shape.num_params}
        print(name, json.dumps(results[name]), flush=True)
    RAW.parent.mkdir(parents=True, exist_ok=True)
    RAW.write_text(json.dumps({"machine": machine(), "args": vars(args) | {"workdir": str(args.workdir)},
                               "results": results}, indent=1))
    base, ep = results["fsdp2"], results["fsdp2 + expert parallelism"]
    rows = [[name, f"{r['tokens_per_s']:.1f}", f"{r['step_s']:.2f}", f"{r['peak_gb']:.2f} ({r['estimate_gb']:.2f})",
             f"{r['sent_gb']:.3f} ({r['estimate_sent_gb']:.3f})", f"{r['losses'][-1]:.4f}"]
            for name, r in results.items()]
    update_section("moe_speed", "\n".join([
        f"Machine: {machine()}. Command: `.venv/bin/python bench/moe_speed.py --layers {args.layers} --seq {args.seq} "
        f"--steps {args.steps}`. Qwen3-30B-A3B's shape ({args.layers} layer(s), {base['params'] / 1e6:.0f}M "
        f"parameters: hidden 2048, 128 experts of 768, 8 per token, a 1,024-token vocabulary), 2 ranks, fp32, batch "
        f"1 x {args.seq} per rank; the median step after {args.discard}. Memory: the largest rank's peak above what "
        "it held before the model was built (estimate in brackets); sent: bytes one rank sends per step, measured on "
        "the loopback interface (estimate in brackets).",
        "",
        table(["system", "tokens/s", "step (s)", "peak GiB/rank (est.)", "sent GB/step/rank (est.)", "last loss"],
              rows),
        "",
        f"Expert parallelism: {ep['tokens_per_s'] / base['tokens_per_s']:.2f}x the tokens/s of fsdp2 alone, "
        f"{ep['sent_gb'] / base['sent_gb']:.3f}x the bytes sent, {ep['peak_gb'] / base['peak_gb']:.2f}x the peak "
        f"memory. The sent figures run above the estimate by gloo's reduce-scatter, which moves an all-reduce's bytes "
        "(twice a reduce-scatter's: the estimate counts NCCL's); the difference is that half of every reduced "
        "gradient. The HF Trainer (DDP) would hold on each rank a whole replica, its gradients, DDP's gradient "
        f"buckets and AdamW's moments, 20 bytes per parameter: {20 * base['params'] / 1e9:.1f} GB per rank, "
        f"{40 * base['params'] / 1e9:.1f} GB for the two, more than this machine's 24 GiB: not run.",
    ]))


def plan_config(model: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model)


if __name__ == "__main__":
    main()
