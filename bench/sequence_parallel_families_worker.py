"""Run under torchrun with 2 ranks (bench/sequence_parallel_families.py): for each model type named, its tiny config
(bench/all_families.tiny_config), one process's loss and gradients of a packed batch against the same batch split
over the two ranks by the sequence-parallel attention, with the suite's list of families lifted so that only the
rules of pipeline/strategies/sequence_parallel.refusal stand. Rank 0 writes one JSON row per model type."""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from all_families import MAX_PARAMS, first_line, tiny_config
from transformers import AutoModelForCausalLM

from pipeline.distributed.runtime import init_distributed
from pipeline.errors import UserError
from pipeline.model.modeling import cannot_train
from pipeline.model.vocab_parallel import IGNORE
from pipeline.strategies import sequence_parallel
from pipeline.strategies.sequence_parallel import SequenceParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from sequence_parallel_families import batch, loss_and_grads  # noqa: E402 (the suite's batch and step, shared)


def check(model_type: str, d) -> dict:
    """The row of one model type: cannot build, refused (the project's own start-up refusal, or sequence
    parallelism's rules), or the split run's loss and largest relative gradient difference against one process."""
    try:
        config = tiny_config(model_type)
        if why := cannot_train(config):
            return {"verdict": "refused at start", "why": why}
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        if sum(p.numel() for p in meta.parameters()) > MAX_PARAMS:
            return {"verdict": "cannot build", "why": "its tiny config keeps a size we do not shrink"}
        torch.manual_seed(0)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.train()
    except Exception as exc:  # noqa: BLE001 (transformers' own classes failing is this type's row)
        return {"verdict": "cannot build", "why": f"{type(exc).__name__}: {first_line(str(exc))}"}
    split = copy.deepcopy(plain)
    sp = SequenceParallel(2, d)
    try:
        sp.install(split)
    except UserError as refused:
        return {"verdict": "refused", "why": str(refused)}
    full = batch(lowest=3)
    targets = int((full.labels[:, 1:] != IGNORE).sum())
    try:
        want, want_grads = loss_and_grads(plain, full, targets)
    except Exception as exc:  # noqa: BLE001 (its own forward fails on a packed batch: nothing to compare)
        return {"verdict": "cannot build", "why": f"its own forward: {type(exc).__name__}: {first_line(str(exc))}"}
    try:  # the same shapes on both ranks: a failure is the same on both, before or after the same collectives
        got, got_grads = loss_and_grads(split, sp.split(full), targets)
    except Exception as exc:  # noqa: BLE001 (the split attention failing on this family is its row)
        return {"verdict": "crashed", "why": f"{type(exc).__name__}: {first_line(str(exc))}"}
    dist.all_reduce(got)
    worst = 0.0
    for name in sorted(got_grads):
        grad = got_grads[name]
        dist.all_reduce(grad)
        scale = want_grads[name].abs().max().item() + 1e-12
        worst = max(worst, (grad - want_grads[name]).abs().max().item() / scale)
    equal = abs(got.item() - want.item()) <= 1e-5 * abs(want.item()) and worst < 1e-4 and \
        sorted(got_grads) == sorted(want_grads)
    return {"verdict": "equal" if equal else "wrong", "loss": want.item(), "split": got.item(), "grad_rel": worst,
            "why": "" if equal else f"loss {want.item():.6f} -> {got.item():.6f}, gradients {worst:.1e} apart"}


def main() -> None:
    out, types = Path(sys.argv[1]), sys.argv[2:]
    d = init_distributed()
    sequence_parallel.untested_family = lambda config: ""  # the rules alone: the suite's list lifted
    with out.open("w") as f:
        for model_type in types:
            row = {"family": model_type, **check(model_type, d)}
            if d.rank == 0:
                f.write(json.dumps(row) + "\n")
                f.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
