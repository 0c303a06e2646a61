"""The run's objective from its config: the causal-LM loss (sft), or a preference objective with its reference."""

from __future__ import annotations

import functools

from pipeline.config import ObjectiveConfig
from pipeline.model.adapters import adapters_disabled
from pipeline.model.loss import CausalLMLoss
from pipeline.objectives.preference import PreferenceObjective
from pipeline.objectives.preference_losses import PreferenceSettings
from pipeline.objectives.reference import adapters_off
from pipeline.strategies.base import Strategy

REFERENCE_OBJECTIVES = ("dpo", "ipo")
"""Objectives measured against a reference: the base with the adapters off (preflight refuses them without)."""


def make_objective(o: ObjectiveConfig, strategy: Strategy) -> CausalLMLoss | PreferenceObjective:
    """What the trainer calls on each micro-batch, blind to which: (batch, items of the step) -> loss."""
    if not o.preference:
        return strategy.loss()
    head = strategy.head()
    settings = PreferenceSettings(o.objective, o.pref_beta, o.pref_label_smoothing, o.simpo_gamma, o.orpo_lambda)
    reference = (adapters_off(head, functools.partial(adapters_disabled, strategy.model))
                 if o.objective in REFERENCE_OBJECTIVES else None)
    return PreferenceObjective(head, settings, reference)
