"""Export a sharded model to a Hugging Face folder (safetensors, config, generation config, tokenizer).

Every rank writes its own shards through DCP's HuggingFaceStorageWriter; rank 0 then consolidates them tensor by
tensor into full safetensors files, so no device ever holds the whole model. The folder is built beside its
destination and renamed into place.

    python -m pipeline.export --checkpoint outputs/RUN/checkpoints/step-00000040 --out exported/ [--export-dtype bf16]

(also under torchrun, to spread a large model over several processes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from pipeline.errors import UserError
from pipeline.fsutil import replace_dir
from pipeline.parallel import DTYPES, Dist, fsdp_root, without_tied_aliases

FILE_BYTES = 5 * 1024**3
"""Target size of one consolidated safetensors file."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


def export_dtype(name: str, hf_config) -> torch.dtype:
    """--export-dtype: auto is the base model's own dtype."""
    if name == "auto":
        base = getattr(hf_config, "dtype", None) or torch.float32
        return base if isinstance(base, torch.dtype) else getattr(torch, str(base))
    return DTYPES[name]


def _file_index(sd: dict, dtype: torch.dtype) -> dict[str, int]:
    size = torch.empty((), dtype=dtype).element_size()
    mapping, index, used = {}, 1, 0
    for key, value in sd.items():
        nbytes = value.numel() * size
        if used and used + nbytes > FILE_BYTES:
            index, used = index + 1, 0
        mapping[key] = index
        used += nbytes
    return mapping


def export_model(model: nn.Module, model_dir: Path, out: Path, dtype: torch.dtype, d: Dist) -> None:
    """Write model (sharded, any world size) to out in Hugging Face format. A collective: every rank calls it."""
    fsdp_root(model).reshard()  # export shards, never a gathered root (left gathered by a forward without backward)
    # a tied weight is stored once, under the embedding; from_pretrained re-ties
    sd = without_tied_aliases(model, get_model_state_dict(model))
    sd = {k: v.detach().to(dtype) for k, v in sd.items()}
    work = out.with_name(f".{out.name}.partial")
    if d.is_main:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    dist.barrier()
    mapping = _file_index(sd, dtype)
    writer = dcp.HuggingFaceStorageWriter(str(work), fqn_to_index_mapping=mapping, save_distributed=True,
                                          enable_consolidation=True)
    dcp.save(sd, storage_writer=writer)
    if d.is_main:
        shutil.rmtree(work / "sharded", ignore_errors=True)
        files = sorted(p.name for p in work.glob("*.safetensors"))
        if len(files) > 1 and not (work / "model.safetensors.index.json").exists():
            names = {i: f for i, f in enumerate(files, 1)}
            index = {"metadata": {}, "weight_map": {k: names[i] for k, i in mapping.items()}}
            (work / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = model.config.__class__.from_dict(model.config.to_dict())
        config.dtype = dtype
        config.save_pretrained(work)
        for name in TOKENIZER_FILES:
            if (model_dir / name).exists():
                shutil.copyfile(model_dir / name, work / name)
        replace_dir(work, out)
    dist.barrier()


def load_checkpoint_model(checkpoint: Path, d: Dist) -> tuple[nn.Module, Path]:
    """The model of a training checkpoint, sharded over this process group (no optimizer). A collective."""
    from transformers import AutoConfig

    from pipeline.config import ModelConfig
    from pipeline.parallel import build_sharded_model, reset_rotary
    from pipeline.trainer import resolve_model_dir

    trainer_json = checkpoint / "trainer.json"
    if not trainer_json.exists() or not (checkpoint / ".metadata").exists():
        raise UserError(f"--checkpoint {checkpoint} is not a complete checkpoint (no trainer.json or .metadata)")
    model_name = json.loads(trainer_json.read_text())["fingerprint"]["model_name"]
    model_dir = resolve_model_dir(model_name)
    cfg = ModelConfig(model_name=model_name, precision="fp32")
    model, _ = build_sharded_model(AutoConfig.from_pretrained(model_dir), cfg, d, torch.float32)
    sd = without_tied_aliases(model, get_model_state_dict(model))
    dcp.load({"model": sd}, checkpoint_id=str(checkpoint))
    set_model_state_dict(model, sd, options=StateDictOptions(strict=False))  # a tied lm_head: via its embedding
    reset_rotary(model, d.device)
    return model, model_dir


def main(argv: list[str] | None = None) -> int:
    from pipeline.parallel import init_distributed

    p = argparse.ArgumentParser(description="Export a training checkpoint to a Hugging Face model folder.")
    p.add_argument("--checkpoint", required=True, type=Path, help="RUN/checkpoints/step-NNNNNNNN")
    p.add_argument("--out", required=True, type=Path, help="output folder (replaced once the export is complete)")
    p.add_argument("--export-dtype", default="auto", choices=("auto", *DTYPES), help="default: the base model's")
    args = p.parse_args(argv)
    d = init_distributed()
    try:
        model, model_dir = load_checkpoint_model(args.checkpoint, d)
        export_model(model, model_dir, args.out, export_dtype(args.export_dtype, model.config), d)
        if d.is_main:
            print(f"exported {args.checkpoint} to {args.out}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ["HF_HUB_OFFLINE"] = "1"  # exports never touch the network
    from pipeline.errors import run_cli

    run_cli(main)
