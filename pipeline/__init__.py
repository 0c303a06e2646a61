"""Offline Llama fine-tuning pipeline: data organisation, dataset conversion, model import and FSDP training."""
