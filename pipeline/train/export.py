"""Export a sharded model to a Hugging Face folder (safetensors, config, generation config, tokenizer).

Every rank writes its own shards through DCP's HuggingFaceStorageWriter; rank 0 then consolidates them tensor by
tensor into full safetensors files, so no device ever holds the whole model. Where every rank holds the whole model
anyway (ddp: Strategy.REPLICATES), rank 0 writes the files from its own tensors. The folder is built beside its
destination and renamed into place.

    python -m pipeline.export --checkpoint outputs/RUN/checkpoints/step-00000040 --out exported/ [--export-dtype bf16]

(also under torchrun, to spread a large model over several processes).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pipeline.config import Config
from pipeline.distributed.runtime import DTYPES, Dist, init_distributed
from pipeline.errors import ArgumentParser, UserError, naming
from pipeline.fsutil import replace_dir
from pipeline.model.adapters import ADAPTER_FILES, PEFT_PREFIX, LowRankAdapter
from pipeline.model.naming import to_file_layout
from pipeline.model.reward_head import HEAD, RewardHead
from pipeline.model.weight_check import FOLDER_RECORD
from pipeline.model.weight_files import INDEX, read_header
from pipeline.ownership import OWNER_FILE, check_not_nested, check_only, describe, kind_of, mark
from pipeline.prep.hub import TOKENIZER_FILES
from pipeline.strategies.base import Strategy
from pipeline.train.checkpoint import load_checkpoint_model

FILE_BYTES = 5 * 1024**3
"""Target size of one consolidated safetensors file."""


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


RUN_TEMPLATE = "chat_template.jinja"
"""A run trained with --chat-template keeps the template in its folder under this name, for every later export."""


EXPORT_FILES = frozenset({INDEX, "config.json", "generation_config.json", *TOKENIZER_FILES, *ADAPTER_FILES,
                          FOLDER_RECORD, OWNER_FILE})
"""What an export writes besides its *.safetensors (and the record its weights' first check leaves in it, when it is
trained or evaluated as a model folder): a folder holding anything else is not ours to replace."""


def _export_file(path: Path) -> bool:
    return path.is_file() and (path.name in EXPORT_FILES or path.name.endswith(".safetensors"))


def check_replaceable(out: Path, flag: str) -> None:
    """Refuse, in one line, an output folder that is not an export or holds anything an export does not write (a
    user's files, a run folder): replacing it would delete them. Absent, empty or a previous export is fine; so is a
    folder inside a run, but not inside a dataset or another kind (pipeline/ownership.py). Reads the folder only, the
    same on every rank, so every rank refuses alike."""
    check_not_nested(out, "export", flag)
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"{flag} {out} is a file, not a folder; choose a new folder for the export")
    if (found := kind_of(out)) not in (None, "export"):
        raise UserError(f"{flag} {out} is {describe(found)}; refusing to replace it: choose a new folder")
    check_only(out, flag, _export_file, "an export", "choose a new folder, or empty this one")


def partial_dir(out: Path) -> Path:
    """Where an export to out is built, beside it, before replace_dir renames it into place."""
    return out.with_name(f".{out.name}.partial")


def fresh_partial(out: Path, record: dict) -> Path:
    """partial_dir(out), emptied of what a killed export left there, and marked as an export with record (run_record:
    what it was trained from and on)."""
    work = partial_dir(out)
    shutil.rmtree(work, ignore_errors=True)
    mark(work, "export", "fsdp1.py", **record)
    return work


def run_record(fingerprint: dict) -> dict:
    """What an export of a run records in its mark, from the run's fingerprint: the base model, its weights' content
    (an adapter run's, which pipeline.chat and pipeline.evaluate check the base they find against) and whether it was
    trained on conversations or on plain text only (pipeline.chat continues the prompt as text for the latter)."""
    record = {"base_model": fingerprint["model_name"],
              "trained_on": "conversations" if "train_on" in fingerprint else "text"}
    if fingerprint.get("base_weights"):
        record["base_weights"] = fingerprint["base_weights"]
    return record


def export_model(strategy: Strategy, model_dir: Path, out: Path, dtype: torch.dtype, d: Dist,
                 chat_template: str = "", record: dict | None = None) -> None:
    """Write the model (distributed, any world size) to out in Hugging Face format, with the base model's tokenizer
    files and, when given, chat_template (instead of the base model's). A collective: every rank calls it. A tied
    weight is stored once, under the embedding; from_pretrained re-ties. A folder at out that is not a previous
    export is refused before anything is written (check_replaceable)."""
    check_replaceable(out, "the export folder")
    sd = {k: v.detach().to(dtype) for k, v in strategy.export_state().items()}
    work = partial_dir(out)
    if d.is_main:
        fresh_partial(out, record or {})
    mapping = _file_index(sd, dtype)
    if not strategy.REPLICATES:
        _write_through_dcp(sd, mapping, work, d)
    elif d.is_main:
        _write_files(sd, mapping, work)
    if d.is_main:
        model = strategy.module
        in_file_layout(work, strategy.as_built)
        write_index(work)
        config = model.config.__class__.from_dict(model.config.to_dict())
        config.dtype = dtype
        config.save_pretrained(work)
        copy_tokenizer(model_dir, work, chat_template)
        replace_dir(work, out)
    dist.barrier()


def copy_tokenizer(model_dir: Path, work: Path, chat_template: str) -> None:
    """The base model's tokenizer and generation files into an export, its chat template replaced by chat_template
    when given."""
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (model_dir / name).exists():
            shutil.copyfile(model_dir / name, work / name)
    if chat_template:
        (work / "chat_template.json").unlink(missing_ok=True)
        (work / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def adapter_of(strategy: Strategy) -> LowRankAdapter | None:
    """The model's adapter transform, if it trains one."""
    return next((t for t in strategy.transforms if isinstance(t, LowRankAdapter)), None)


def export_adapter(strategy: Strategy, model_dir: Path, out: Path, base_model: str, d: Dist,
                   chat_template: str = "", record: dict | None = None) -> None:
    """Write the model's adapter to out in PEFT's format (adapter_config.json naming base_model,
    adapter_model.safetensors with every LoRA tensor whole and 2-D, the tokenizer files): what
    PeftModel.from_pretrained, vLLM and TGI read; its mark holds record (run_record). A collective (the adapter is
    gathered into rank 0's host memory, one tensor at a time); built beside out and renamed into place, and a folder
    at out that is not a previous export is refused (check_replaceable)."""
    from safetensors.torch import save_file

    check_replaceable(out, "the adapter folder")
    adapter = adapter_of(strategy)
    reward = next((t for t in strategy.transforms if isinstance(t, RewardHead)), None)
    tensors = adapter.adapter_state(strategy.model, strategy.module, frozenset({HEAD}) if reward else frozenset())
    config = copy.deepcopy(adapter.peft_config)
    if reward:
        # a reward model's adapter: its score beside the LoRA tensors (peft's modules_to_save), read onto the base
        # loaded with AutoModelForSequenceClassification
        tensors = {PEFT_PREFIX + reward.export_name(k.removeprefix(PEFT_PREFIX)): v for k, v in tensors.items()}
        config.task_type, config.modules_to_save = "SEQ_CLS", [reward.score_name.removesuffix(".weight")]
    if d.is_main:
        work = fresh_partial(out, record or {})
        save_file(tensors, work / "adapter_model.safetensors", metadata={"format": "pt"})
        config.base_model_name_or_path, config.inference_mode = base_model, True
        config.save_pretrained(work)
        copy_tokenizer(model_dir, work, chat_template)
        replace_dir(work, out)
    dist.barrier()


def run_exports(cfg: Config, *, best: bool = False) -> dict[str, str]:
    """The folders of RUN the run's end writes (best: those --save-best writes), each to what it holds: "model" (hf/,
    adapters merged into it) and, for an adapter run, "adapter" (adapter/; alone when --merge-export is off)."""
    adapter = cfg.model.adapter != "none"
    kinds = (["model"] if not adapter or cfg.run.merge_export else []) + (["adapter"] if adapter else [])
    names = {"model": "best" if best else "hf", "adapter": "best-adapter" if best else "adapter"}
    return {names[kind]: kind for kind in kinds}


def described(cfg: Config, *, best: bool = False) -> str:
    """The run's exports for the log: "model RUN/hf and adapter RUN/adapter"."""
    return " and ".join(f"{kind} {cfg.run_dir / name}" for name, kind in run_exports(cfg, best=best).items())


def export_run(strategy: Strategy, cfg: Config, model_dir: Path, d: Dist, chat_template: str, fingerprint: dict, *,
               best: bool = False) -> None:
    """The run's exports (run_exports) from the model as it is now, marked with run_record(fingerprint). A
    collective."""
    record = run_record(fingerprint)
    for name, kind in run_exports(cfg, best=best).items():
        # a full disk in DCP's or transformers' writers names no file: it is the export's
        with naming(partial_dir(cfg.run_dir / name), unnamed_only=True):
            if kind == "adapter":
                export_adapter(strategy, model_dir, cfg.run_dir / name, cfg.model.model_name, d, chat_template,
                               record)
            else:
                export_model(strategy, model_dir, cfg.run_dir / name,
                             export_dtype(cfg.run.export_dtype, strategy.module.config), d, chat_template, record)


def _write_through_dcp(sd: dict, mapping: dict[str, int], work: Path, d: Dist) -> None:
    """Each rank's shards through DCP's HuggingFaceStorageWriter, consolidated by rank 0 into work. A collective."""
    scalars = {k for k, v in sd.items() if v.ndim == 0}
    sd = {k: v.reshape(1) if k in scalars else v for k, v in sd.items()}  # see restore_scalars
    scratch = work / "dcp"  # DCP's writer: per-rank files, then the consolidated ones; only the latter are kept
    if d.is_main:
        scratch.mkdir()
    dist.barrier()
    writer = dcp.HuggingFaceStorageWriter(str(scratch), fqn_to_index_mapping=mapping, save_distributed=True,
                                          enable_consolidation=True)
    dcp.save(sd, storage_writer=writer)
    if d.is_main:
        for f in [*scratch.glob("*.safetensors"), *scratch.glob(INDEX)]:
            os.replace(f, work / f.name)
        shutil.rmtree(scratch)
        restore_scalars(work, scalars)


def _write_files(sd: dict, mapping: dict[str, int], work: Path) -> None:
    """The whole model from this rank's own tensors, file by file as mapping groups them, named as DCP's
    consolidation names its files (0-dim tensors as they are: the DCP bug restore_scalars mends is not on this
    path). safetensors writes each tensor from its memory: DCP's writer held two copies of a rank's bytes at once
    (+0.53 GB for SmolLM2-135M's 0.27 GB in bf16), at the end of a run whose peak was the training's."""
    from safetensors.torch import save_file

    count = max(mapping.values(), default=1)
    for index in range(1, count + 1):
        tensors = {k: v.contiguous() for k, v in sd.items() if mapping[k] == index}
        save_file(tensors, work / f"model-{index:05d}-of-{count:05d}.safetensors", metadata={"format": "pt"})


def restore_scalars(folder: Path, scalars: set[str]) -> None:
    """The 0-dim tensors (Apertus' xIELU beta and eps), exported as shape (1,), back to 0-dim in the consolidated
    files. Why: DCP's HF consolidation (torch 2.11 to 2.13) takes a 0-dim shape for an empty tensor and writes its
    value as 0.0, with no error (tests/test_export.py reproduces it on DCP alone)."""
    from safetensors.torch import load_file, save_file

    for path in sorted(folder.glob("*.safetensors")):
        if scalars & set(read_header(path)):
            tensors = load_file(path)
            save_file({k: v.reshape(()) if k in scalars else v for k, v in tensors.items()}, path,
                      metadata={"format": "pt"})


def in_file_layout(folder: Path, model) -> None:
    """Rewrite, file by file, the consolidated files whose tensors save_pretrained would name or split otherwise
    (fused MoE experts back to one tensor per expert, renamed blocks): the layout from_pretrained, older
    transformers and vLLM read. Decided from the headers; a file that needs it is read whole (at most FILE_BYTES)."""
    from safetensors.torch import load_file, save_file

    for path in sorted(folder.glob("*.safetensors")):
        shapes = {name: torch.empty(e.shape, device="meta") for name, e in read_header(path).items()}
        if set(to_file_layout(model, shapes)) == set(shapes):
            continue
        save_file(to_file_layout(model, load_file(path)), path, metadata={"format": "pt"})


def write_index(folder: Path) -> None:
    """model.safetensors.index.json from the weight files' headers (replacing DCP's): from_pretrained finds files
    named other than model.safetensors only through it."""
    files = sorted(folder.glob("*.safetensors"))
    headers = {path.name: read_header(path) for path in files}
    total = sum(math.prod(e.shape) * e.torch_dtype.itemsize
                for header in headers.values() for e in header.values())
    weight_map = {name: file for file, header in headers.items() for name in sorted(header)}
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description="Export a training checkpoint to a Hugging Face model folder, and an adapter "
                       "checkpoint's adapter to a PEFT adapter folder.")
    p.add_argument("--checkpoint", required=True, type=Path, help="RUN/checkpoints/step-NNNNNNNN")
    p.add_argument("--out", type=Path, help="the model's folder (an adapter run's: the base with the adapter merged "
                   "into it): new, empty or a previous export (replaced once the export is complete); a folder "
                   "holding anything else is refused")
    p.add_argument("--adapter-out", type=Path, help="an adapter run's checkpoint: the adapter's folder in PEFT's "
                   "format (adapter_config.json, adapter_model.safetensors, the tokenizer files)")
    p.add_argument("--export-dtype", default="auto", choices=("auto", *DTYPES), help="default: the base model's")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out is None and args.adapter_out is None:
        raise UserError("nothing to export: give --out (the model) and/or --adapter-out (an adapter run's adapter)")
    # before any process group or model: nothing the user has is touched
    for folder, flag in ((args.out, "--out"), (args.adapter_out, "--adapter-out")):
        if folder is not None:
            check_replaceable(folder, flag)
    d = init_distributed()
    strategy, model_dir, fingerprint = load_checkpoint_model(args.checkpoint, d)
    if args.adapter_out is not None and adapter_of(strategy) is None:
        raise UserError(f"--adapter-out: {args.checkpoint} is a full fine-tuning checkpoint, with no adapter; export "
                        "it with --out")
    run_template = args.checkpoint.resolve().parents[1] / RUN_TEMPLATE
    template = run_template.read_text(encoding="utf-8") if run_template.exists() else ""
    record = run_record(fingerprint)
    if args.out is not None:
        export_model(strategy, model_dir, args.out, export_dtype(args.export_dtype, strategy.module.config), d,
                     template, record)
    if args.adapter_out is not None:
        export_adapter(strategy, model_dir, args.adapter_out, fingerprint["model_name"], d, template, record)
    if d.is_main:
        print(f"exported {args.checkpoint} to {' and '.join(str(f) for f in (args.out, args.adapter_out) if f)}")
    # on success only: after a failure another rank may still be in a collective (pipeline.export leaves without
    # finalization either way, errors.leave)
    dist.destroy_process_group()
    return 0
