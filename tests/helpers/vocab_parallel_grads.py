"""Run under torchrun: the loss and every gradient of one step, through the HF forward on an FSDP root and through
the vocabulary-parallel head; and an evaluation-style loss with padding rows. Rank 0 writes them as JSON."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import ModelConfig
from pipeline.data.batches import count_targets, make_batch
from pipeline.distributed.runtime import init_distributed
from pipeline.errors import run_cli
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.strategies.registry import make_strategy


def build(model_dir: Path, d, vocab_parallel: bool) -> tuple[torch.nn.Module, CausalLMLoss]:
    cfg = ModelConfig(model_name=str(model_dir), precision="fp32", strategy="fsdp2",
                      vocab_parallel="on" if vocab_parallel else "off")
    strategy = make_strategy(cfg, d, torch.float32)
    model = strategy.build(AutoConfig.from_pretrained(model_dir))
    strategy.load_weights(model_dir)
    return model, CausalLMLoss(strategy.head())


def global_mean(x: torch.Tensor, world: int) -> float:
    x = x.detach().clone()
    dist.all_reduce(x)
    return x.item() / world


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    d = init_distributed()
    results = {}
    for vocab_parallel in (False, True):
        model, loss_fn = build(model_dir, d, vocab_parallel)
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(d.rank))
        loss = loss_fn(make_batch(ids.numpy(), None, d.device), d.world_size * count_targets(ids.numpy(), None))
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        with torch.no_grad():  # rank 0 pads its second row: only the others' rows and its first count
            valid = 1 if d.rank == 0 else 2
            tokens = torch.tensor(float(count_targets(ids.numpy(), None, valid)))
            # over num_items = world size, the values summed over ranks are the global sum (pipeline/model/loss.py)
            summed = loss_fn(make_batch(ids.numpy(), None, d.device, valid), d.world_size)
            padded = global_mean(summed, 1) / global_mean(tokens, 1)
        results[vocab_parallel] = {"loss": global_mean(loss, d.world_size), "grads": grads, "eval": padded,
                                   "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight}
    everyone = [torch.empty_like(ids) for _ in range(d.world_size)]
    dist.all_gather(everyone, ids)
    if d.is_main:  # the reference: one unsharded model on the whole global batch
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ref_loss = ref(input_ids=torch.cat(everyone), labels=torch.cat(everyone)).loss
        ref_loss.backward()
        ref_grads = {name: p.grad for name, p in ref.named_parameters()}
        hf, vp = results[False], results[True]
        diffs = {name: [(hf["grads"][name] - g).abs().max().item(), (vp["grads"][name] - g).abs().max().item()]
                 for name, g in ref_grads.items()}
        scale = max(g.abs().max().item() for g in ref_grads.values())
        out.write_text(json.dumps({"ref_loss": ref_loss.item(), "loss": [hf["loss"], vp["loss"]],
                                   "eval": [hf["eval"], vp["eval"]], "grad_max_diff": diffs, "grad_scale": scale,
                                   "tied": [hf["tied"], vp["tied"]], "world": d.world_size}))
    dist.barrier()  # no rank tears the group down while another still has collectives in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
