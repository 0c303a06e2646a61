"""Offline Llama fine-tuning pipeline: data organisation, dataset conversion, model import and FSDP training."""

import logging

# torchao (QLoRA's NF4 weights, pipeline/model/nf4.py) is imported in every run, by transformers' quantizers and by
# peft: its wheel ships CUDA kernels that fail to load on a CPU-only torch, and it registers enums the way torch
# deprecates. Each says so as warnings in every process, none of which concerns NF4 (pure PyTorch).
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
