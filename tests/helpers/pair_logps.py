"""Run under torchrun by tests/test_preferences.py: for each family folder, under fsdp2 (vocabulary-parallel head on)
and ddp, each answer's summed log-probability of packed and unpacked pairs (pipeline/objectives/preference.py's
sequence_logps, as training computes them) against transformers' own forward of each sequence alone. Every rank
passes the same blocks, so every rank's pairs (the vocabulary-parallel path returns them all) must equal the one
expectation. Rank 0 writes [{family, strategy, layout, pairs, worst relative difference}] to OUT.

    torchrun --nproc_per_node 2 tests/helpers/pair_logps.py OUT.json FAMILY=DIR [FAMILY=DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config_merge import from_flat
from pipeline.data.batches import make_batch
from pipeline.data.pair_tokens import TokenPair, pack_pairs
from pipeline.distributed.runtime import init_distributed
from pipeline.objectives.preference import sequence_logps
from pipeline.strategies.registry import make_strategy, settle

LAYOUTS = {"packed": 96, "unpacked": 40}
"""Block lengths: three pairs of the lengths below share a block, or each has one of its own."""


def pairs(vocab: int) -> list[TokenPair]:
    """Pairs of random tokens: a shared prompt, answers of different lengths, the answer tokens trained."""
    rng = np.random.default_rng(0)
    out = []
    for prompt, chosen, rejected in ((6, 9, 5), (4, 7, 11), (8, 6, 6)):
        head = rng.integers(1, vocab, prompt)
        c, r = rng.integers(1, vocab, chosen), rng.integers(1, vocab, rejected)
        out.append(TokenPair(np.r_[head, c].astype(np.uint32), np.r_[np.zeros(prompt, bool), np.ones(chosen, bool)],
                             np.r_[head, r].astype(np.uint32), np.r_[np.zeros(prompt, bool), np.ones(rejected, bool)],
                             prompt))
    return out


def own_forward(model, ids: np.ndarray, trained: np.ndarray) -> float:
    """The answer's log-probability by transformers: log_softmax of its logits, gathered at the trained tokens."""
    x = torch.from_numpy(ids.astype(np.int64))[None]
    with torch.no_grad():
        logps = model(input_ids=x).logits[0, :-1].float().log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
    return float(logps[torch.from_numpy(trained[1:])].sum())


def main() -> None:
    out, folders = Path(sys.argv[1]), [a.split("=", 1) for a in sys.argv[2:]]
    d = init_distributed()
    results = []
    for family, folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        made = pairs(AutoConfig.from_pretrained(folder).vocab_size)
        expected = torch.tensor([[own_forward(model, p.chosen, p.chosen_trained),
                                  own_forward(model, p.rejected, p.rejected_trained)] for p in made])
        for name, vocab_parallel in (("fsdp2", "on"), ("ddp", "off")):
            cfg = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": folder,
                                    "strategy": name, "precision": "fp32", "vocab_parallel": vocab_parallel}))
            strategy = make_strategy(cfg.model, d, torch.float32)
            strategy.build(AutoConfig.from_pretrained(folder))
            strategy.load_weights(Path(folder))
            for layout, capacity in LAYOUTS.items():
                blocks, flags = pack_pairs(made, capacity, 0)
                with torch.no_grad():
                    got = sequence_logps(strategy.head(), make_batch(blocks, flags, d.device))
                ours = torch.stack([got["chosen"], got["rejected"]], 1).cpu()
                # best-fit packing reorders pairs: match each of ours to the expectation by its chosen value
                order = [int((expected[:, 0] - v).abs().argmin()) for v in ours[:, 0]]
                worst = ((ours - expected[order]).abs() / expected[order].abs()).max().item()
                results.append({"family": family, "strategy": name, "layout": layout, "rows": len(blocks),
                                "pairs": len(ours), "matched": sorted(order), "worst": worst,
                                "vocab_parallel": strategy.head().vocab_parallel})
    if d.is_main:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
