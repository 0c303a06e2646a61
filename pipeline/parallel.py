"""Process group, device mesh, FSDP2 wrapping and sharded weight loading.

The model is built on the meta device, wrapped with `fully_shard`, materialised with `to_empty` (each rank
allocates only its shards) and filled from the safetensors files through DCP's HuggingFaceStorageReader, so each
rank reads only its own slices and no rank ever holds the whole model.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.futures import Future

from pipeline.config import VOCAB_PARALLEL_SHARDINGS, ModelConfig
from pipeline.errors import UserError
from pipeline.hub import ST_DTYPES, safetensors_headers
from pipeline.loss import VocabParallelEmbedding

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """The one process that prints, writes metrics and other run-level files."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """One process per node: builds node-local caches."""
        return self.local_rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout: timedelta = timedelta(minutes=60)) -> Dist:
    """Join torchrun's process group (NCCL for CUDA tensors, gloo for CPU ones); plain `python` is a group of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        check_gpus_per_node(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cuda:nccl,cpu:gloo"  # gloo too: small CPU-side collectives (flags, objects) stay off the GPU
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank,
                int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), device)


def check_gpus_per_node(local_world_size: int, gpus: int) -> None:
    """One GPU per process: NCCL refuses two ranks on one device, and set_device fails past the last one."""
    if local_world_size > gpus:
        raise UserError(f"{local_world_size} processes on this node but {gpus} CUDA device(s) visible: one process "
                        f"per GPU, so use --nproc_per_node {gpus} (or CUDA_VISIBLE_DEVICES= to train on the CPU)")


def watch_parent(interval_s: float = 1.0) -> None:
    """Under torchrun, exit when the launcher dies.

    A SIGKILLed torchrun agent cannot forward anything: its workers would sit in a collective until the timeout
    (an hour). A daemon thread notices the re-parenting and ends the process; collectives release the GIL, so it
    runs even while the main thread is blocked in one.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != launcher:
                os.write(2, f"rank {os.environ.get('RANK')}: launcher (pid {launcher}) died; exiting\n".encode())
                os._exit(1)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The forward/backward dtype for --precision on this device; UserError where the device lacks it."""
    if precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise UserError(f"--precision bf16 is not supported by {torch.cuda.get_device_name(device)}; "
                        "use --precision fp16 or fp32")
    if device.type != "cuda" and precision == "fp16":
        raise UserError("--precision fp16 needs a CUDA GPU (loss scaling); use fp32 or bf16 on CPU")
    return DTYPES[precision]


def build_mesh(sharding: str, d: Dist) -> DeviceMesh:
    """1-D mesh for FULL_SHARD/SHARD_GRAD_OP; 2-D (replicate, shard) for NO_SHARD and HYBRID_SHARD."""
    if sharding == "NO_SHARD":
        return init_device_mesh(d.device.type, (d.world_size, 1), mesh_dim_names=("replicate", "shard"))
    if sharding == "HYBRID_SHARD":
        if d.world_size % d.local_world_size:
            raise UserError(f"--sharding HYBRID_SHARD needs the same number of processes on every node; "
                            f"world size {d.world_size} is not a multiple of {d.local_world_size}")
        return init_device_mesh(d.device.type, (d.world_size // d.local_world_size, d.local_world_size),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("shard",))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (the model's own `_no_split_modules` classes), in order."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return layers


def vocab_parallel_enabled(cfg: ModelConfig) -> bool:
    """--vocab-parallel resolved: auto is on wherever the sharding allows it. Measured (BENCHMARKS.md): on CPU it
    halved the step; on one H100 with Llama-3.2-1B at batch 8 x 2048 it runs as fast as the HF Trainer on 30% less
    memory, where the model's own loss ran out of memory."""
    return cfg.vocab_parallel == "on" or (cfg.vocab_parallel == "auto" and cfg.sharding in VOCAB_PARALLEL_SHARDINGS
                                          and not cfg.cpu_offload)


def shard_model(model: nn.Module, cfg: ModelConfig, mesh: DeviceMesh, dtype: torch.dtype, *,
                vocab_parallel: bool = False) -> None:
    """Activation checkpointing and compile per decoder layer, then fully_shard each layer and the root.

    vocab_parallel: the embedding and LM head are sharded by vocabulary rows on the same mesh and left out of
    FSDP (see pipeline/loss.py); the root FSDP module is then the decoder stack (`model.base_model`), whose
    gradients are summed over ranks, not averaged, since the loss is already the mean over every rank's tokens.
    """
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    reshard = cfg.sharding in ("FULL_SHARD", "HYBRID_SHARD")
    for layer in decoder_layers(model):
        if cfg.compile:
            layer.compile()
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    if not vocab_parallel:
        # root: embeddings, final norm and lm_head (one shared parameter when tied). Not resharded after forward:
        # the backward needs the lm_head first, right after the forward ends, so resharding would only all-gather
        # it again
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
        return
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = nn.Parameter(distribute_tensor(embed.weight, mesh, [Shard(0)]))
    if head.weight is embed.weight:
        head.weight = weight
    else:
        head.weight = nn.Parameter(distribute_tensor(head.weight, mesh, [Shard(0)]))
    model.set_input_embeddings(VocabParallelEmbedding(weight, embed.padding_idx, mesh.get_group()))
    fully_shard(model.base_model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload,
                ignored_params={weight, head.weight})
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def fsdp_root(model: nn.Module) -> FSDPModule:
    """The outermost FSDP module: the model itself, or its decoder stack when the head is vocabulary-parallel."""
    return model if isinstance(model, FSDPModule) else model.base_model


def tied_partners(model: nn.Module) -> dict[str, str]:
    """Both directions of the model's tied weights (lm_head <-> embed_tokens), when the config ties them."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return {}
    pairs = dict(getattr(model, "all_tied_weights_keys", None) or {})
    return {**pairs, **{v: k for k, v in pairs.items()}}


def without_tied_aliases(model: nn.Module, model_sd: dict) -> dict:
    """The model state dict without the second name of a tied weight (lm_head.weight when tied to the embedding):
    DCP would otherwise write the same tensor twice (1 GB more per checkpoint for Llama 3.2 1B in fp32)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return model_sd
    aliases = set(getattr(model, "all_tied_weights_keys", None) or {})
    return {k: v for k, v in model_sd.items() if k not in aliases}


def reset_rotary(model: nn.Module, device: torch.device) -> None:
    """Recompute non-persistent buffers (rotary inv_freq): to_empty leaves them uninitialised memory."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__:
            with torch.device(device):
                fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                module.register_buffer(name, buf, persistent=False)


SAFETENSORS_DTYPES = {code: getattr(torch, name) for code, name in ST_DTYPES.items()}
READ_CHUNK_BYTES = 64 * 2**20


def safetensors_header(path: str) -> tuple[dict, int]:
    """The JSON header of a safetensors file (name -> dtype, shape, data_offsets) and where its data begins."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


class RowSliceReader(dcp.HuggingFaceStorageReader):
    """DCP's safetensors reader, reading each rank's rows with plain file reads instead of through a memory map.

    safetensors maps the whole file, and every page a rank touches counts in its RSS until the file is closed,
    after its last tensor: 0.49 GB on top of a 0.35 GB share per rank for the 0.71 GB start-up bench model
    (measured). The rows [a, b) of a row-major tensor are one byte range, read in chunks of at most
    READ_CHUNK_BYTES straight into the rank's shard. Slices that are not whole rows (no such sharding here)
    go through the library's memory-mapped path.
    """

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for path, items in per_file.items():
            header, data_start = safetensors_header(path)
            with open(path, "rb", buffering=0) as f:
                for req in items:
                    entry = header[req.storage_index.fqn]
                    if not self._read_rows(f, path, entry, data_start, req, planner):
                        self._read_mapped(path, req, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    @staticmethod
    def _read_mapped(path: str, req: ReadItem, planner: LoadPlanner) -> None:
        from safetensors import safe_open

        slices = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths, strict=True))
        with safe_open(path, framework="pt") as mapped:
            tensor = mapped.get_slice(req.storage_index.fqn)[slices]
        target = planner.resolve_tensor(req).detach()
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    @staticmethod
    def _read_rows(f, path: str, entry: dict, data_start: int, req: ReadItem, planner: LoadPlanner) -> bool:
        shape, dtype = entry["shape"], SAFETENSORS_DTYPES.get(entry["dtype"])
        whole_rows = all(o == 0 and n == d for o, n, d in zip(req.storage_offsets[1:], req.lengths[1:], shape[1:],
                                                               strict=True))
        if dtype is None or not whole_rows:
            return False
        target = planner.resolve_tensor(req).detach()
        rows = req.lengths[0] if shape else 1
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        first = data_start + entry["data_offsets"][0] + (req.storage_offsets[0] if shape else 0) * row_bytes
        view = target.view(rows, -1) if target.is_contiguous() else target.reshape(rows, -1)
        step = max(1, READ_CHUNK_BYTES // max(row_bytes, 1))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            buf = torch.empty(n * row_bytes, dtype=torch.uint8)
            f.seek(first + r * row_bytes)
            if f.readinto(memoryview(buf.numpy())) != n * row_bytes:
                raise UserError(f"{path} is truncated: tensor {req.storage_index.fqn} ends past the end of the file")
            view[r:r + n].copy_(buf.view(dtype).view(n, -1))
        if not target.is_contiguous():
            target.copy_(view.view(target.shape))
        planner.commit_tensor(req, target)
        return True


def load_weights(model: nn.Module, model_dir: Path, device: torch.device) -> None:
    """Fill the sharded model from safetensors with DCP; every rank reads only the slices it owns."""
    safetensors_headers(model_dir)  # a truncated or corrupt file: one line naming it, not a safetensors traceback
    reader = RowSliceReader(str(model_dir))
    available = set(reader.read_metadata().state_dict_metadata)
    sd = get_model_state_dict(model)
    partners = tied_partners(model)
    wanted = {}
    for key, value in sd.items():
        if key in available:
            wanted[key] = value
        elif partners.get(key) not in available:
            raise UserError(f"tensor {key} is missing from the weights in {model_dir}")
    dcp.load(wanted, storage_reader=reader)
    # strict=False: a tied lm_head is filled through its embedding (one shared parameter)
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    reset_rotary(model, device)


def materialize(model: nn.Module, cfg: ModelConfig, device: torch.device) -> None:
    """Allocate the shards (host memory with CPU offload) before loading into them."""
    model.to_empty(device="cpu" if cfg.cpu_offload else device)


def build_sharded_model(hf_config, cfg: ModelConfig, d: Dist, dtype: torch.dtype, *,
                        vocab_parallel: bool = False) -> tuple[nn.Module, DeviceMesh]:
    """The model of hf_config built on the meta device, sharded (shard_model) and materialised shard by shard;
    its weights are uninitialised memory until loaded (load_weights, or from a checkpoint)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa")
    mesh = build_mesh(cfg.sharding, d)
    shard_model(model, cfg, mesh, dtype, vocab_parallel=vocab_parallel)
    materialize(model, cfg, d.device)
    return model, mesh
