"""The reference log-probabilities of a DPO or IPO run that has no adapters to switch off (or names
--reference-model), as the ranks meet them: found beside the token cache or computed, before the model is filled for
training."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal

import torch
import torch.distributed as dist

from pipeline.data.pair_tokens import count_pairs
from pipeline.data.token_cache import Blocks
from pipeline.model.adapters import adapters_disabled
from pipeline.objectives.plans import ReferencePlan
from pipeline.objectives.reference_pass import ensure_reference, reference_folder
from pipeline.signals import Interrupted, StopRequest, agreed_stop
from pipeline.strategies.base import Strategy
from pipeline.train.telemetry import log


def stop_in_pass(saved: int, chunks: int) -> None:
    """A signal on any rank stops the pass before its next round of forwards (a pass over many pairs takes minutes:
    a scheduler's grace period would kill it first); the chunks saved are kept. One small all-reduce per round:
    every rank calls it."""
    if agreed_stop():
        # said once, by rank 0; the others keep it in their log (their console shows warnings only)
        (log.warning if dist.get_rank() == 0 else log.info)(
            "stopped by signal during the reference pass, with %d of %d chunks saved (kept); rerun the same command "
            "to resume", saved, chunks)
        raise Interrupted(StopRequest.signum or signal.SIGTERM)


def with_reference(blocks: Blocks, ref: ReferencePlan, strategy: Strategy, dtype: torch.dtype,
                   batch_size: int) -> Blocks:
    """The blocks with the reference's log-probabilities of their pairs: found beside the token cache, or computed
    by the model with the reference's weights loaded into it (an adapter run's with its adapters off). The model's
    weights are then the reference's: the checkpoint or the base must fill it after. A collective."""
    folder = reference_folder(blocks.path, ref.weights, dtype)
    splits = {name: blocks.part(name) for name in ("train", "val")}
    off = functools.partial(adapters_disabled, strategy.model) if strategy.freezes_base else contextlib.nullcontext
    # whole sequences on each rank, dealt over every rank (a pass without gradients keeps no activations: under
    # --sequence-parallel it is not split)
    whole = dataclasses.replace(strategy.head(), sequence_group=None)
    with strategy.whole_sequences():
        found, how = ensure_reference(whole, blocks.path, folder, splits, batch_size, strategy.dist,
                                      lambda: strategy.load_weights(ref.model_dir), off, stop_in_pass)
    strategy.release()  # the root stays gathered after forwards without backward
    if strategy.dist.is_main:
        pairs = sum(count_pairs(part.flags) for part in splits.values())
        log.info("reference log-probabilities of %d pairs under %s: %s (%s)", pairs, ref.name, how, folder)
    return dataclasses.replace(blocks, train_ref=found["train"], val_ref=found["val"])
