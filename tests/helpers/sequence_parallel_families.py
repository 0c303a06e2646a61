"""Run under torchrun with 2 ranks: for every family the project builds (and grouped-query variants with fewer KV
heads than ranks), one process's loss and gradients of a packed batch against the same batch split by position over
the two ranks through the sequence-parallel attention; or the family's one-line refusal. Rank 0 writes JSON."""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from pipeline.data.batches import Batch
from pipeline.distributed.runtime import init_distributed
from pipeline.errors import UserError
from pipeline.model.vocab_parallel import IGNORE
from pipeline.prep.tiny import FAMILIES, family_config
from pipeline.strategies.sequence_parallel import SequenceParallel

SEQ = 40
"""Two rows of 40 positions: the first packs documents of 9, 17 and 14 tokens (a boundary inside each rank's slice
and one across the ranks' seam at 20), the second is one document; longer than the tiny families' sliding window (8)."""


def batch(lowest: int = 0) -> Batch:
    """The packed batch, its ids from lowest up (bench/sequence_parallel_families_worker.py keeps clear of the
    registry families' special ids)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(lowest, 512, (2, SEQ), generator=g)
    positions = torch.stack([torch.cat([torch.arange(n) for n in (9, 17, 14)]), torch.arange(SEQ)])
    labels = ids.clone()
    labels[0, [0, 9, 26]] = IGNORE  # each document's first token is no target of the one before
    labels[1, :3] = IGNORE
    return Batch(ids, labels, positions)


def loss_and_grads(model, b: Batch, targets: int) -> tuple[torch.Tensor, dict]:
    extra = {"shift_labels": b.labels} if b.shifted else {}
    loss = model(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids, use_cache=False,
                 num_items_in_batch=targets, **extra).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def check(config, d, kernel: str | None) -> dict:
    torch.manual_seed(0)
    kwargs = {"attn_implementation": kernel} if kernel else {}
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    split = copy.deepcopy(plain)
    sp = SequenceParallel(2, d)
    try:
        sp.install(split)
    except UserError as refused:
        return {"refused": str(refused)}
    full = batch()
    targets = int((full.labels[:, 1:] != IGNORE).sum())
    want, want_grads = loss_and_grads(plain, full, targets)
    mine = sp.split(full)
    got, got_grads = loss_and_grads(split, mine, targets)
    dist.all_reduce(got)
    split.zero_grad()
    sp.layout.__dict__["documents"] = None  # as if the split attention ignored the document boundaries
    sp.layout.masks.clear()
    crossing, _ = loss_and_grads(split, mine, targets)
    dist.all_reduce(crossing)
    worst = 0.0
    for name, grad in got_grads.items():
        dist.all_reduce(grad)
        worst = max(worst, (grad - want_grads[name]).abs().max().item() / (want_grads[name].abs().max().item() + 1e-12))
    return {"loss": want.item(), "split": got.item(), "crossing": crossing.item(), "grad_rel": worst,
            "grads": sorted(got_grads) == sorted(want_grads), "kernel": sp.kernel}


def main() -> None:
    out = Path(sys.argv[1])
    d = init_distributed()
    results = {}
    for family in sorted(FAMILIES):
        results[family] = check(family_config(family, 512, 0, 1), d, None)
    one_kv = family_config("llama", 512, 0, 1)
    one_kv.num_key_value_heads = 1
    results["llama-1kv"] = check(one_kv, d, None)
    results["llama-eager"] = check(family_config("llama", 512, 0, 1), d, "eager")
    chunked = family_config("llama4", 512, 0, 1)  # its chunked layers, without the refused temperature tuning
    chunked.attn_temperature_tuning = False
    results["llama4-chunked"] = check(chunked, d, None)
    if d.rank == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
