"""The run's objective from its config: the causal-LM loss (sft), or a preference objective with its reference."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from pipeline.config import ObjectiveConfig
from pipeline.model.adapters import adapters_disabled
from pipeline.model.head import Head
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.objectives.objective import Objective
from pipeline.objectives.preference import PreferenceObjective
from pipeline.objectives.preference_losses import PreferenceSettings
from pipeline.objectives.reference import adapters_off, precomputed

REFERENCE_OBJECTIVES = ("dpo", "ipo")
"""Objectives measured against a reference: the base with the adapters off, or log-probabilities computed before
training (full fine-tuning, --reference-model)."""


def make_objective(o: ObjectiveConfig, head: Head, computed_reference: bool = False) -> Objective:
    """What the trainer calls on each micro-batch, blind to which: (batch, items of the step) -> loss.
    computed_reference: the batches carry the reference's log-probabilities (Batch.ref)."""
    if not o.preference:
        return CausalLMLoss(head)
    settings = PreferenceSettings(o.objective, o.pref_beta, o.pref_label_smoothing, o.simpo_gamma, o.orpo_lambda)
    off: Callable[[], contextlib.AbstractContextManager] = functools.partial(adapters_disabled, head.model)
    reference = None
    if o.objective in REFERENCE_OBJECTIVES:
        reference = precomputed(head) if computed_reference else adapters_off(head, off)
    return PreferenceObjective(head, settings, reference)
