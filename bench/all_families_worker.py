"""Run under torchrun by bench/all_families.py for one family's tiny model: under fsdp2 and ddp, every parameter and
buffer after our load against from_pretrained's, the trainer's first loss on a fixed batch (the same rows on every
rank, so the global mean is the batch's) against the model's own forward, then one AdamW step and the export
(pipeline/train/export.py) read back by from_pretrained against the trained model, tensor by tensor and by its loss.
Rank 0 writes one verdict per strategy (bench/all_families.py names them).

    torchrun --nproc_per_node 2 bench/all_families_worker.py OUT.json MODEL_DIR SCRATCH_DIR
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config_merge import from_flat
from pipeline.data.batches import make_batch
from pipeline.distributed.runtime import init_distributed
from pipeline.errors import UserError, run_cli
from pipeline.model.modeling import cannot_train, plain_name
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.strategies.registry import make_strategy, settle
from pipeline.train.export import export_model

STRATEGIES = ("fsdp2", "ddp")
LEAK_TOLERANCE = 1e-4
"""later_token_leak above this: not a causal LM as configured."""
LOSS_TOLERANCE = 1e-4
"""fp32, the same rows: summation order only (bench/family_losses.py: 4.8e-7 at most over the named families)."""


def gathered(state: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in state.items()}


def differing(ours: dict, theirs: dict) -> list[str]:
    """Names whose tensors are not equal, or that one side lacks."""
    return sorted(k for k in set(ours) | set(theirs)
                  if k not in ours or k not in theirs or not torch.equal(ours[k].float(), theirs[k].float()))


def check(name: str, folder: Path, reference: torch.nn.Module, expected: dict, batch, items: float, scratch: Path,
          d) -> dict:
    """One strategy's checks on every rank (collectives inside); the verdict is rank 0's."""
    cfg = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": str(folder),
                            "strategy": name, "precision": "fp32"}))
    strategy = make_strategy(cfg.model, d, torch.float32)
    strategy.build(AutoConfig.from_pretrained(folder))
    strategy.load_weights(folder)
    loaded = gathered(strategy.export_state())
    buffers = {plain_name(n): b.detach().cpu() for n, b in strategy.module.named_buffers()}
    after_load = differing({**loaded, **buffers},
                           {k: v for k, v in expected.items()
                            if k not in strategy.tied})
    with torch.no_grad():
        ours = CausalLMLoss(strategy.head())(batch, items).item()
        theirs = reference(input_ids=batch.input_ids, labels=batch.labels).loss.item()
    optimizer = torch.optim.AdamW([p for g in strategy.param_groups(0.0) for p in g["params"]], lr=1e-3)
    with strategy.gradient_sync(True):
        CausalLMLoss(strategy.head())(batch, items).backward()
    optimizer.step()
    trained = gathered(strategy.export_state())
    with torch.no_grad():
        trained_loss = CausalLMLoss(strategy.head())(batch, items).item()
    export_model(strategy, folder, scratch / name, torch.float32, d)
    exported = AutoModelForCausalLM.from_pretrained(scratch / name, dtype=torch.float32).train()
    with torch.no_grad():
        export_loss = exported(input_ids=batch.input_ids, labels=batch.labels).loss.item()
    in_export = {k: v for k, v in exported.state_dict().items() if k not in strategy.tied}
    result = {"loss": ours, "transformers_loss": theirs, "loss_diff": abs(ours - theirs),
              "after_load": after_load, "export_differs": differing(trained, in_export),
              "export_loss_diff": abs(export_loss - trained_loss)}
    problems = [f"first loss {ours:.6f} against transformers' {theirs:.6f}"] if result["loss_diff"] > LOSS_TOLERANCE \
        else []
    problems += [f"after load {len(after_load)} tensors differ from from_pretrained's ({after_load[0]})"] \
        if after_load else []
    problems += [f"{len(result['export_differs'])} exported tensors differ from the trained ones "
                 f"({result['export_differs'][0]})"] if result["export_differs"] else []
    problems += [f"the export's loss is {result['export_loss_diff']:.1e} off"] \
        if result["export_loss_diff"] > 1e-5 else []
    return {**result, "verdict": "wrong" if problems else "right", "why": "; ".join(problems)}


def where(exc: BaseException) -> str:
    """The innermost frame of ours (or else the innermost) an exception came from."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/pipeline/" in f.filename] or frames
    frame = ours[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}"


def later_token_leak(model: torch.nn.Module, batch) -> float:
    """How much the logits before the last position move when only the last token changes, relative to their
    largest magnitude: 0 for a causal LM up to float noise (a mixture of experts' grouped routing: 1e-6), large for
    a model that attends both ways (an encoder as a causal LM without is_decoder) or otherwise leaks the future."""
    changed = batch.input_ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % min(512, model.config.get_text_config().vocab_size)
    with torch.no_grad():
        before = model(input_ids=batch.input_ids).logits[:, :-1]
        after = model(input_ids=changed).logits[:, :-1]
    return ((before - after).abs().max() / before.abs().max().clamp_min(1e-12)).item()


def verdicts(folder: Path, scratch: Path, d) -> list[dict]:
    """Each strategy's verdict; one "cannot build" where transformers' own model cannot load or run what it saved, or
    one "refused" where fsdp1.py's start refuses the family (modeling.cannot_train, at preflight)."""
    config = AutoConfig.from_pretrained(folder)
    vocab = min(512, config.get_text_config().vocab_size)
    rows = np.random.default_rng(1).integers(0, vocab, size=(2, 32))
    batch = make_batch(rows, None, d.device)
    items = d.world_size * rows.shape[0] * (rows.shape[1] - 1)
    try:
        # training mode, as the trainer's forward (dropout and jitter are off in the tiny configs): RWKV rescales its
        # weights in place in eval mode; its loaded state is kept before any forward
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
        loaded = {**reference.state_dict(), **dict(reference.named_buffers())}
        expected = {k: v.detach().clone() for k, v in loaded.items()}
        with torch.no_grad():
            reference(input_ids=batch.input_ids, labels=batch.labels)
    except Exception as exc:  # noqa: BLE001 (transformers' own failure: the family cannot be checked)
        return [{"strategy": "-", "verdict": "cannot build",
                 "why": f"transformers' own model fails on what it saved: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]}"}]
    if why := cannot_train(config):
        return [{"strategy": "-", "verdict": "refused", "why": why}]
    results = []
    # on the family as transformers initialises it, not the saved file: its persistent buffers are randomised to
    # check our loading, and MiniMax's hold its causal decay mask (random, it leaked 7.5e-2; as built, 4e-7)
    torch.manual_seed(0)
    if (leak := later_token_leak(AutoModelForCausalLM.from_config(config).train(), batch)) > LEAK_TOLERANCE:
        results.append({"strategy": "-", "verdict": "wrong", "why": f"attends to later tokens: the logits before the "
                        f"last position move by {leak:.1e} of their size when only the last token changes"})
    for name in STRATEGIES:
        try:
            results.append({"strategy": name, **check(name, folder, reference, expected, batch, items, scratch, d)})
        except UserError as exc:
            results.append({"strategy": name, "verdict": "refused", "why": str(exc)})
        except Exception as exc:  # noqa: BLE001 (the bench reports it as this family's crash)
            results.append({"strategy": name, "verdict": "crashed",
                            "why": f"{type(exc).__name__} at {where(exc)}: {str(exc).splitlines()[0][:200]}"})
    return results


def main() -> None:
    out, folder, scratch = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    d = init_distributed()
    results = verdicts(folder, scratch, d)
    if d.is_main:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
