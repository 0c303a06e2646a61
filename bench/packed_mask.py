"""What keeping packed sequences apart costs: a decoder stack's forward and backward with position ids that restart
(transformers then builds a block-diagonal causal mask for SDPA) against plain causal attention (SDPA's is_causal).

One process, one thread; a 4-layer stack of a real small model's width (hidden 576, 9 query / 3 KV heads,
intermediate 1536), random weights, batch 2, six sequences per row; median of --repeats timed passes after one
warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine, table, update_section
from transformers import LlamaConfig, LlamaModel


def seconds(model: LlamaModel, ids: torch.Tensor, positions: torch.Tensor | None, repeats: int) -> float:
    def one() -> float:
        start = time.perf_counter()
        model(input_ids=ids, position_ids=positions).last_hidden_state.sum().backward()
        return time.perf_counter() - start

    one()
    return statistics.median(one() for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096)
    model = LlamaModel(cfg)
    rows = []
    for length in map(int, args.lengths.split(",")):
        ids = torch.randint(0, cfg.vocab_size, (2, length))
        packed = torch.cat([torch.arange(length // 6 + (i < length % 6)) for i in range(6)]).expand(2, length)
        causal, masked = seconds(model, ids, None, args.repeats), seconds(model, ids, packed, args.repeats)
        rows.append([length, f"{causal:.3f}", f"{masked:.3f}", f"{100 * (masked / causal - 1):+.1f}%"])
    body = "\n".join([
        f"- Machine: {machine()}.",
        f"- Command: `.venv/bin/python bench/packed_mask.py --repeats {args.repeats}`.",
        "- Decoder stack: 4 layers, hidden 576, 9 query / 3 KV heads, intermediate 1536, random weights; batch 2, six "
        "sequences per row; forward + backward, 1 thread, median.",
        "",
        table(["tokens per row", "causal (is_causal), s", "packed (block-diagonal mask), s", "cost"], rows),
    ])
    update_section("packed_mask_cpu", body)
    print(body)


if __name__ == "__main__":
    main()
