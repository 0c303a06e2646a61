"""MODEL_DOWNLOAD: put a model into the local Hugging Face cache and verify it without allocating its weights.

Two ways in: `huggingface_hub.snapshot_download` (online, resumable), or `--source DIR`, which imports a copy carried
from an online machine into the cache's own layout (blobs/, snapshots/, refs/) so that `from_pretrained("org/name")`
resolves with HF_HUB_OFFLINE=1. Either way only what training needs is taken.
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ArgumentParser, UserError
from pipeline.fsutil import sha256_file, write_text_atomic
from pipeline.model.weight_check import WeightCheck, check_weights, damaged, read_line
from pipeline.strategies.memory import GIB, Estimate, Shape, ShapeUnknown, Workload

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
"""Every file a tokenizer may load (slow and fast, added tokens, the chat template in either of its files): kept by
download and import, part of the tokenizer's fingerprint, copied into every export."""
ALLOW_PATTERNS = [
    "config.json", "generation_config.json", *TOKENIZER_FILES, "*.safetensors", "model.safetensors.index.json",
]
IGNORE_PATTERNS = ["*/*", "*.pth", "*.bin", "*.pt", "*.gguf", "*.msgpack", "*.h5"]
"""Top-level files only: `original/` (Meta's consolidated .pth) and other duplicate formats are never fetched."""


def wanted(rel: str) -> bool:
    """Whether a repository file is one training needs (same rule for download and import)."""
    return any(fnmatch.fnmatch(rel, p) for p in ALLOW_PATTERNS) and not any(fnmatch.fnmatch(rel, p)
                                                                          for p in IGNORE_PATTERNS)


def default_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_folder(cache_dir: Path, model_name: str) -> Path:
    return cache_dir / ("models--" + model_name.replace("/", "--"))


def check_model_name(model_name: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model_name)
    except HFValidationError:
        raise UserError(f"--model-name {model_name!r} is not a hub id like org/name") from None


# -------------------------------------------------------------------------------------------------- download


def _remote_bytes_needed(model_name: str, revision: str, cache_dir: Path) -> int | None:
    """Bytes still to fetch, from the hub's file sizes; None when the hub cannot tell (offline, no sizes)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(model_name, revision=revision, files_metadata=True)
    except Exception:  # offline, unreachable, not found, gated: the download itself reports which, in one line
        return None
    folder = repo_folder(cache_dir, model_name) / "blobs"
    need = 0
    for sib in info.siblings or []:
        if not wanted(sib.rfilename) or sib.size is None:
            continue
        blob = (sib.lfs.sha256 if sib.lfs else sib.blob_id) or ""
        if not (folder / blob).exists():
            need += sib.size
    return need


def check_disk(path: Path, need: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK):  # a read-only mount reports 0 bytes free: say what it is instead
        raise OSError(errno.EROFS if os.statvfs(path).f_flag & os.ST_RDONLY else errno.EACCES, "not writable",
                      str(path))
    free = shutil.disk_usage(path).free
    if need > free:
        raise UserError(f"not enough disk space in {path}: the model needs {need / GIB:.2f} GiB more, "
                        f"{free / GIB:.2f} GiB free; free some space or pass --cache-dir on a larger disk")


def download(model_name: str, revision: str, cache_dir: Path) -> Path:
    """snapshot_download of the training files only; a rerun completes a partial download. Returns the snapshot."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    need = _remote_bytes_needed(model_name, revision, cache_dir)
    if need is not None:
        check_disk(cache_dir, need)
    fix_offline = (f"on an air-gapped machine import a copy: python MODEL_DOWNLOAD.py --model-name {model_name} "
                   "--source DIR")
    try:
        path = snapshot_download(model_name, revision=revision, cache_dir=str(cache_dir),
                                 allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    except GatedRepoError:
        raise UserError(f"{model_name} is gated: accept its licence on the hub, then set HF_TOKEN or run "
                        "`hf auth login`") from None
    except RepositoryNotFoundError:
        raise UserError(f"{model_name} was not found on the hub (or is private: set HF_TOKEN or run "
                        "`hf auth login`)") from None
    except RevisionNotFoundError:
        raise UserError(f"revision {revision!r} of {model_name} was not found on the hub") from None
    except LocalEntryNotFoundError:
        raise UserError(f"{model_name} (revision {revision}) is not in the cache at {cache_dir} and the hub "
                        f"cannot be reached; {fix_offline}") from None
    except (HfHubHTTPError, OSError) as exc:
        raise UserError(f"download of {model_name} failed ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                        f"rerun to resume, or {fix_offline}") from None
    return Path(path)


# ------------------------------------------------------------------------------------------------ resolution


def looks_like_path(name: str) -> bool:
    """Whether a model name can only be a folder: absolute, relative from . or ~, or deeper than a hub's ORG/NAME."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


DATASET_FILES = ("dataset_info.json", "dataset_dict.json", "state.json")
"""What a folder `datasets`' save_to_disk (DATA-HF) wrote holds, and no model folder does."""


def resolve_model_dir(model_name: str, flag: str = "--model-name") -> Path:
    """A local model directory, or a hub id from the offline cache (never the network): how the trainer and the
    exporter find the model MODEL_DOWNLOAD put there. flag: the option that named it, for the one-line errors."""
    local = Path(model_name)
    if local.is_dir():
        if not (local / "config.json").exists():
            if any((local / name).exists() for name in DATASET_FILES):
                raise UserError(f"{flag} {model_name} is a dataset (as DATA-HF writes one), not a model: a dataset "
                                "goes to --dataset-name")
            raise UserError(f"{flag} {model_name} is a directory without config.json")
        return local
    if looks_like_path(model_name):
        raise UserError(f"model folder {model_name} does not exist (a hub id is ORG/NAME)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_name, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        raise UserError(f"model {model_name} is not in the offline cache at {default_cache_dir()} (HF_HOME or "
                        "HF_HUB_CACHE choose it; set them as when the model was put there); on this machine run: "
                        f"python MODEL_DOWNLOAD.py --model-name {model_name} (add --source DIR if offline)") from None


# ---------------------------------------------------------------------------------------------------- import


def source_files(source: Path) -> tuple[list[str], list[str]]:
    """(files to import, files left out) of a local model directory; UserError when it is not a model."""
    if not source.is_dir():
        raise UserError(f"--source {source} does not exist or is not a directory")
    every = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
    take = [f for f in every if wanted(f)]
    if "config.json" not in take or not any(f.endswith(".safetensors") for f in take):
        raise UserError(f"--source {source} is not a model directory: it needs config.json and *.safetensors "
                        "weights (as saved by save_pretrained or downloaded from the hub)")
    return take, [f for f in every if f not in take]


def import_local(source: Path, model_name: str, revision: str, cache_dir: Path) -> Path:
    """Copy a local model into the hub cache layout; idempotent. Returns the snapshot directory.

    The snapshot id is a hash of the file names and contents, so the same source always maps to the same
    snapshot and a rerun copies nothing. refs/REVISION is written last, atomically: a crash midway never makes a
    half-imported snapshot the one that from_pretrained resolves. A blob is copied only where it is missing (main
    removes a damaged one first); it keeps its source's modification time, so its first check can vouch for it.
    """
    take, _ = source_files(source)
    check_disk(cache_dir, sum((source / f).stat().st_size for f in take))
    repo = repo_folder(cache_dir, model_name)
    hashes = {f: sha256_file(source / f) for f in take}
    commit = hashlib.sha1(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for rel, digest in hashes.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            tmp = blob.with_name(f"{digest}.incomplete-{os.getpid()}")
            shutil.copyfile(source / rel, tmp)
            st = (source / rel).stat()
            os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
            os.replace(tmp, blob)
        link = snapshot / rel
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    ref = repo / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.exists() or ref.read_text() != commit:
        write_text_atomic(ref, commit)
    return snapshot


# ------------------------------------------------------------------------------------------------ verification


@dataclass
class ModelReport:
    model_class: str
    num_params: int
    dtype: str
    disk_bytes: int
    config: object
    unexpected: list[str]


def verify(model_dir: Path) -> ModelReport:
    """Build the model on the meta device and check every parameter and persistent buffer against the headers."""
    import torch
    from transformers import AutoConfig

    from pipeline.model.modeling import meta_model
    from pipeline.model.naming import WeightNames
    from pipeline.model.reward_head import RewardHead, is_reward_model, reward_head_layout
    from pipeline.model.weight_files import read_index

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise UserError(f"{model_dir}/config.json cannot be read as a model config ({exc})") from None
    index = read_index(model_dir)
    disk = sum(path.stat().st_size for path in {e.path for e in index.values()})
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype or "float32")
    model = meta_model(config, dtype)
    head = None
    if is_reward_model(config):  # a reward model (fsdp1.py --objective reward's export): its score beside the body
        head = RewardHead(reward_head_layout(config), config.pad_token_id, trained=True)
        head.apply(model)
    # tied weights stored once under either name; per-expert tensors joined; a reward model's score under its name
    names = WeightNames(model, head.base_name) if head else WeightNames(model)
    expected = model.state_dict()
    sources = names.sources(index, expected, model_dir)
    for name, src in sources.items():
        tensor, shape = expected[name], src.shape(config)
        if shape != list(tensor.shape):
            raise UserError(f"tensor {name} has shape {shape} in the weights but the config implies "
                            f"{list(tensor.shape)}")
        st_dtype = str(src.entry.torch_dtype or src.entry.dtype).removeprefix("torch.")
        if st_dtype != str(tensor.dtype).removeprefix("torch."):
            raise UserError(f"tensor {name} is {st_dtype} in the weights but the config says "
                            f"{str(tensor.dtype).removeprefix('torch.')}")
    used = {e.name for src in sources.values() for group in src.parts.values() for e in group}
    used |= {n for n in index if names.partners.get(n) in sources}
    return ModelReport(head.architecture if head else type(model).__name__, sum(p.numel() for p in model.parameters()),
                       str(dtype).removeprefix("torch."), disk, config, sorted(set(index) - used))


# ------------------------------------------------------------------------------------------------ memory estimate


TABLE_SEQ = 2048


def table_seq(config) -> int:
    """The table's sequence length: 2048, or the model's limit when shorter."""
    return min(TABLE_SEQ, getattr(config, "max_position_embeddings", None) or TABLE_SEQ)


def memory_rows(config, gpus: tuple[int, ...] = (1, 2, 4, 8)) -> list[tuple[str, Estimate]]:
    """pipeline.strategies.memory's estimate per GPU for what MODEL_DOWNLOAD.py's table shows: fsdp2 (FULL_SHARD, the
    vocabulary-parallel head) on each number of GPUs, then ddp (the same on any number), at bf16 compute, batch 1 x
    seq 2048 (or the model's limit), activation checkpointing on."""
    from pipeline.strategies.registry import estimate  # the strategies' terms: loads the wrappers, only for the table

    shape, seq = Shape.of(config), table_seq(config)
    rows = [(f"fsdp2, {n} GPU{'s' if n > 1 else ''}", estimate(shape, Workload(
        "fsdp2", "FULL_SHARD", n, n, 2, 1, seq, activation_checkpointing=True, vocab_parallel=True)))
        for n in gpus]
    rows.append(("ddp, any number", estimate(shape, Workload("ddp", "NO_SHARD", max(gpus), max(gpus), 2, 1, seq,
                                                                activation_checkpointing=True))))
    # --adapter lora (rank 16 on every linear layer of the blocks): a frozen bf16 base, fp32 adapters
    lora = {"activation_checkpointing": True, "adapter": "lora"}
    rows += [(f"LoRA r16, fsdp2, {n} GPU{'s' if n > 1 else ''}", estimate(shape, Workload(
        "fsdp2", "FULL_SHARD", n, n, 2, 1, seq, vocab_parallel=True, **lora))) for n in (gpus[0], gpus[-1])]
    rows.append(("LoRA r16, ddp, any number", estimate(shape, Workload("ddp", "NO_SHARD", max(gpus), max(gpus), 2, 1,
                                                                        seq, **lora))))
    # --adapter qlora: the adapted weights in NF4 (fsdp2 needs 2 or more shards for them)
    qlora = {**lora, "adapter": "qlora"}
    rows.append((f"QLoRA r16, fsdp2, {gpus[-1]} GPUs", estimate(shape, Workload(
        "fsdp2", "FULL_SHARD", gpus[-1], gpus[-1], 2, 1, seq, vocab_parallel=True, **qlora))))
    rows.append(("QLoRA r16, ddp, any number", estimate(shape, Workload("ddp", "NO_SHARD", max(gpus), max(gpus), 2,
                                                                         1, seq, **qlora))))
    return rows


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} GiB"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def family_lines(config) -> list[str]:
    """What the report says of the model's family: a mixture of experts' routing, an untested family."""
    from pipeline.model.modeling import cannot_train, moe_shape, untested_family

    lines = []
    text = config.get_text_config()
    experts, top_k = moe_shape(config)
    if experts:
        lines.append(f"mixture of experts: {experts} experts, {top_k} per token (every expert is held; activations, "
                     "and MFU in training, count those a token is routed to)")
    if getattr(text, "is_heterogeneous", False):
        lines.append(f"layers differ in {', '.join(sorted(text.per_layer_attributes or ()))}: every figure is "
                     "counted layer by layer")
    if why := cannot_train(config):
        lines.append(f"warning: fsdp1.py refuses it: {why}")
    elif why := untested_family(config):
        lines.append(f"warning: {why}; fsdp1.py attempts it")
    return lines


def format_report(rep: ModelReport, where: Path, skipped: list[str]) -> str:
    lines = [
        f"model:       {rep.model_class} at {where}",
        f"parameters:  {rep.num_params:,} ({rep.dtype}); {human_bytes(rep.disk_bytes)} on disk",
        f"tied embeddings: {bool(getattr(rep.config, 'tie_word_embeddings', False))}; "
        f"max positions: {getattr(rep.config, 'max_position_embeddings', 'n/a')}",
    ]
    templates = [f for f in ("chat_template.jinja", "chat_template.json") if (where / f).exists()]
    if not templates and "chat_template" in _read_json(where / "tokenizer_config.json"):
        templates = ["tokenizer_config.json"]
    lines.append(f"chat template: {', '.join(templates)}" if templates else
                 "chat template: none (conversations need fsdp1.py --chat-template FILE.jinja)")
    if skipped:
        lines.append(f"left out (not needed for training): {', '.join(skipped)}")
    if rep.unexpected:
        lines.append(f"ignored tensors not used by {rep.model_class}: {', '.join(rep.unexpected[:5])}")
    lines.extend(family_lines(rep.config))
    try:
        rows = memory_rows(rep.config)
    except ShapeUnknown as why:
        lines.append(f"estimated peak memory per GPU: not available for this model ({why}); training still works")
        return "\n".join(lines)
    seq = table_seq(rep.config)
    lines.append(f"estimated peak memory per GPU with fsdp1.py (bf16 compute; full fine-tuning: fp32 master weights, "
                 f"gradients and AdamW states; LoRA: a frozen bf16 base, fp32 adapters; QLoRA: the adapted weights in "
                 f"NF4; batch 1 x seq {seq}, "
                 "--activation-checkpointing on; plus about 1 GiB of CUDA context):")
    lines.append(f"  {'strategy, GPUs':<26} {'weights+AdamW':>13} {'gradients':>9} {'bf16 copies':>11} "
                 f"{'activations':>11} {'logits':>7} {'AdamW step':>10} {'peak':>9}")
    for label, e in rows:
        g = e.gib()
        lines.append(f"  {label:<26} {g['weights']:>13.2f} {g['gradients']:>9.2f} {g['copies']:>11.2f} "
                     f"{g['activations']:>11.2f} {g['logits']:>7.2f} {g['update']:>10.2f} {g['total']:>5.2f} GiB")
    lines.append("  (GiB; the peak is the larger of the end of the forward, the first five columns together, and the "
                 "AdamW step)")
    lines.append("  (--strategy auto picks between ddp and fsdp2 among the rows that fit the GPU: the one that moves "
                 "fewer bytes per step)")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description="Download (or import) a model into the local Hugging Face cache and "
                                            "verify it on the meta device and by content.")
    p.add_argument("--model-name", required=True, help="hub id, e.g. meta-llama/Llama-3.2-1B; or a model folder, "
                   "checked in place (its hashes are recorded, and later changes refused by fsdp1.py)")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    p.add_argument("--source", type=Path, default=None, help="import this local copy instead of downloading")
    p.add_argument("--cache-dir", type=Path, default=None, help="hub cache (default: $HF_HOME/hub)")
    p.add_argument("--verify", action="store_true", help="hash every weight file again, even those whose size and "
                   "time are unchanged since their last check (a damaged one is fetched or imported again)")
    return p


def fetch(args: argparse.Namespace, cache_dir: Path) -> Path:
    """The model's snapshot in the cache: imported from --source, else downloaded (a complete one is found)."""
    if args.source is not None:
        return import_local(args.source, args.model_name, args.revision, cache_dir)
    return download(args.model_name, args.revision, cache_dir)


def checked_snapshot(args: argparse.Namespace, cache_dir: Path) -> tuple[Path, WeightCheck, int]:
    """fetch, then every weight blob checked against its name; a damaged blob is removed and fetched again (a blob
    that exists is never copied or downloaded over). Returns the snapshot, the check and the blobs repaired."""
    snapshot = fetch(args, cache_dir)
    check = check_weights(snapshot, again=args.verify)
    if not check.damaged:
        return snapshot, check, 0
    for damage in check.damaged:
        damage.file.resolve().unlink(missing_ok=True)
    try:
        snapshot = fetch(args, cache_dir)
    except UserError as exc:
        raise UserError(f"{damaged(check.damaged[0])}; it was removed, but fetching it again failed: {exc}") from None
    if not all(damage.file.exists() for damage in check.damaged):  # offline, the hub's cached snapshot is returned
        raise UserError(f"{damaged(check.damaged[0])}; it is not in the cache now, and the hub cannot be reached to "
                        f"fetch it: import a copy with python MODEL_DOWNLOAD.py --model-name {args.model_name} "
                        "--source DIR")
    again = check_weights(snapshot)
    if again.damaged:  # the source itself (or what the hub served) does not match the hub's hash
        raise UserError(f"{damaged(again.damaged[0])}, even as fetched again: check the source (--source) or the "
                        "network, and rerun")
    return snapshot, check, len(check.damaged)


def check_folder(folder: Path, again: bool) -> int:
    """A model folder outside the cache, checked in place: its current content becomes the reference."""
    report = verify(folder)
    check = check_weights(folder, again=again, accept=True)
    print(format_report(report, folder, []))
    for changed in check.changed:
        print(f"{changed} changed since its last check: its new content is now the reference")
    print(read_line(check))
    print(f"{folder} is a model folder, checked in place (nothing copied to the cache); train from it with "
          f"fsdp1.py --model-name {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if Path(args.model_name).is_dir() and args.source is None:
        return check_folder(Path(args.model_name), args.verify)
    check_model_name(args.model_name)
    cache_dir = args.cache_dir or default_cache_dir()
    skipped: list[str] = []
    if args.source is not None:
        _, skipped = source_files(args.source)
        verify(args.source)  # a broken copy never lands in the cache
    snapshot, check, repaired = checked_snapshot(args, cache_dir)
    how = f"imported from {args.source}" if args.source is not None else "downloaded (or found complete in the cache)"
    report = verify(snapshot)
    print(format_report(report, snapshot, skipped))
    print(read_line(check))
    if repaired:
        print(f"repaired {repaired} damaged weight file(s): removed and {'imported' if args.source else 'downloaded'} "
              "again")
    print(f"{args.model_name} {how}; it resolves offline (HF_HUB_OFFLINE=1) from the cache at {cache_dir}")
    return 0
