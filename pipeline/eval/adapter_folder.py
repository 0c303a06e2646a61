"""A PEFT adapter folder (RUN/adapter, or one peft's save_pretrained wrote) read back onto a model built with the
same adapter transform: its settings as --adapter flags, its tensors into the (possibly sharded) model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from pipeline.errors import UserError
from pipeline.model.adapters import ADAPTER_FILES, EXPERTS_PREFIX, is_adapter_key, model_key_of
from pipeline.model.weight_check import check_same_base
from pipeline.ownership import read_mark
from pipeline.prep.hub import looks_like_path, resolve_model_dir
from pipeline.strategies.base import Strategy

CONFIG, WEIGHTS = ADAPTER_FILES
UNSUPPORTED = {"use_rslora": False, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
               "alpha_pattern": {}, "bias": "none"}
"""LoraConfig fields whose other values change what the adapter computes in ways this pipeline does not build."""


@dataclass(frozen=True)
class AdapterFolder:
    path: Path
    base_model: str
    """base_model_name_or_path: a hub id in the offline cache or a model folder."""
    settings: dict
    """The ModelConfig fields that rebuild this adapter (adapter, lora_rank, lora_alpha, lora_targets)."""
    base_weights: str = ""
    """The content of the base it was trained on (weight_check.weights_digest), "" where the folder does not say."""


def is_adapter_folder(path: Path) -> bool:
    return (path / CONFIG).is_file()


def read_adapter_folder(path: Path) -> AdapterFolder:
    """The folder's adapter_config.json as the flags that rebuild it; a folder that is not a LoRA or DoRA adapter this
    pipeline can build is one line."""
    try:
        conf = json.loads((path / CONFIG).read_text(encoding="utf-8"))
        if conf.get("task_type") == "SEQ_CLS":  # fsdp1.py --objective reward's, its score beside the adapters
            raise UserError(f"{path} is a reward model's adapter; evaluate its run's merged model (RUN/hf)")
        if conf.get("peft_type") != "LORA":
            raise UserError(f"{path} holds a {conf.get('peft_type')} adapter; only LoRA and DoRA adapters are "
                            "supported")
        settings = {"adapter": "dora" if conf.get("use_dora") else "lora", "lora_rank": int(conf["r"]),
                    "lora_alpha": float(conf["lora_alpha"])}
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as exc:
        raise UserError(f"{path}/{CONFIG} is not a PEFT adapter config ({type(exc).__name__}: {exc})") from None
    odd = [k for k, usual in UNSUPPORTED.items() if conf.get(k, usual) not in (usual, None, {}, [])]
    if odd:
        raise UserError(f"{path}: {CONFIG} sets {', '.join(odd)}, which this pipeline does not build; evaluate it "
                        "with peft directly")
    targets, parameters = conf.get("target_modules") or [], conf.get("target_parameters") or []
    if not isinstance(targets, list) or not isinstance(parameters, list) or not targets + parameters or \
            not all(isinstance(t, str) for t in targets + parameters):
        raise UserError(f"{path}: {CONFIG}'s target_modules must be a list of module names and target_parameters "
                        f"one of fused expert weights, one of them not empty; got {conf.get('target_modules')!r} and "
                        f"{conf.get('target_parameters')!r}")
    if not (path / WEIGHTS).is_file():
        raise UserError(f"{path} has no {WEIGHTS}")
    settings["lora_targets"] = ",".join(sorted(targets) + sorted(EXPERTS_PREFIX + p for p in parameters))
    return AdapterFolder(path, str(conf.get("base_model_name_or_path") or ""), settings, recorded_base(path))


def recorded_base(path: Path) -> str:
    """The base weights an adapter folder records (our exports do, in their mark), or ""."""
    return str(read_mark(path).get("base_weights") or "")


def base_dir(path: Path, base_model: str, model_name: str = "") -> Path:
    """The folder of the base an adapter goes on (model_name, else the one its config names), checked: there, and
    holding the weights it was trained on where the adapter folder records them. One line otherwise."""
    name = model_name or base_model
    if not name:
        raise UserError(f"{path / CONFIG} names no base model; pass the base model and the adapter folder apart")
    if not model_name and looks_like_path(name) and not Path(name).is_dir():
        raise UserError(f"the base model folder {name} that {path / CONFIG} names does not exist (moved or "
                        "deleted): put it back, or set base_model_name_or_path there to where it is now")
    model_dir = resolve_model_dir(name)
    if expected := recorded_base(path):
        check_same_base(model_dir, name, expected, f"the adapter {path}", base_model)
    return model_dir


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors under the model's names; a damaged file, or a tensor that is not LoRA's or DoRA's,
    is one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path / WEIGHTS)
    except (OSError, SafetensorError) as exc:
        raise UserError(f"{path / WEIGHTS} cannot be read, it is damaged ({exc})") from None
    named = {}
    for key, value in tensors.items():
        if (name := model_key_of(key)) is None:
            raise UserError(f"{path / WEIGHTS} holds {key}, not a LoRA or DoRA tensor")
        named[name] = value
    return named


def load_adapter(strategy: Strategy, folder: AdapterFolder) -> None:
    """The folder's tensors into the model the strategy built with this adapter (after its base weights): every rank
    reads the small file whole and keeps its own rows. A collective. A tensor the model lacks, or one of another
    shape, is one line."""
    path = folder.path / WEIGHTS
    tensors = read_tensors(folder.path)
    shapes = {k: v for k, v in strategy.shapes.items() if k in tensors}
    missing = sorted(set(tensors) - set(shapes))
    wrong = [k for k in shapes if tuple(shapes[k]) != tuple(tensors[k].shape)]
    if missing:
        raise UserError(f"{path} does not fit the model: it holds {missing[0]}, which the model lacks")
    if wrong:
        raise UserError(f"{path} does not fit the model: {wrong[0]} is {tuple(tensors[wrong[0]].shape)}, the model's "
                        f"is {tuple(shapes[wrong[0]])}")
    expected = {k for k in strategy.shapes if is_adapter_key(k)}
    if absent := sorted(expected - set(tensors)):
        raise UserError(f"{path} lacks {len(absent)} of the adapter's tensors (first: {absent[0]})")
    with torch.no_grad():
        set_model_state_dict(strategy.model, {k: v.float() for k, v in tensors.items()},
                             options=StateDictOptions(full_state_dict=True, strict=False))
