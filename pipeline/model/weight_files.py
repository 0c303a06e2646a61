"""Safetensors weight files: the one header reader, and the tensors of a model folder.

MODEL_DOWNLOAD's check, the trainer's load and the export read headers here and nowhere else, so a truncated or
corrupt file is reported the same way (one line naming it) wherever it is met.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import UserError

INDEX = "model.safetensors.index.json"
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
             "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file."""

    path: Path
    dtype: str
    """safetensors' code: F32, BF16, ..."""
    shape: list[int]
    start: int
    """Byte offset of its data from the start of the file."""
    name: str = ""
    """Its name in the file."""

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return ST_DTYPES.get(self.dtype)


def corrupt(path: Path, why: str) -> UserError:
    return UserError(f"weight file {path} is truncated or corrupt ({why}); download or import the model again")


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, from its header; checks the header is whole and the data ends exactly at
    the end of the file (as safetensors itself requires)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise corrupt(path, f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        entries = {name: TensorEntry(path, e["dtype"], list(e["shape"]), 8 + n + e["data_offsets"][0], name)
                   for name, e in header.items()}
        end = 8 + n + max((e["data_offsets"][1] for e in header.values()), default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise corrupt(path, f"{type(exc).__name__}: {exc}") from None
    if end != size:
        raise corrupt(path, f"its tensors end at byte {end}, the file has {size}")
    return entries


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder: those its index names, else every *.safetensors in it."""
    index = model_dir / INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in names if not (model_dir / f).exists()]
        if missing:
            raise UserError(f"shard {missing[0]} is named in {INDEX} but missing from {model_dir}")
    else:
        names = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not names:
        raise UserError(f"{model_dir} holds no *.safetensors weights")
    return [model_dir / name for name in names]


def read_index(model_dir: Path) -> dict[str, TensorEntry]:
    """Every tensor of a model folder, from the headers only."""
    return {name: entry for path in weight_files(model_dir) for name, entry in read_header(path).items()}
