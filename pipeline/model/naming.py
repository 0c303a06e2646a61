"""Names in a weight folder against names in the model, by transformers' own conversion rules.

A checkpoint may name its tensors differently from the modules that hold them: Mixtral's and Qwen3-MoE's files hold
one tensor per expert (`mlp.experts.3.gate_proj.weight`) where the model holds the experts fused
(`mlp.experts.gate_up_proj`, [experts, 2 x intermediate, hidden]), and Mixtral's `block_sparse_moe` is the model's
`mlp`. transformers keeps these rules per family (`conversion_mapping`, applied by from_pretrained and reverted by
save_pretrained); this module is the one place that reads them, so the loader, MODEL_DOWNLOAD's check and the export
agree with from_pretrained by construction, never by a table of ours.

The rules live in `transformers.conversion_mapping` and `transformers.core_model_loading`: not underscore-private,
but not in transformers' documented API either, so they are imported here only (tests/test_families.py checks they
still exist).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeline.errors import UserError
from pipeline.model.modeling import tied_partners

if TYPE_CHECKING:
    from pipeline.model.weight_files import TensorEntry


def _rules(model: nn.Module) -> tuple[list, list]:
    """(renamings, converters) transformers applies to this model's checkpoints in from_pretrained."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    rules = get_model_conversion_mapping(model)
    return ([r for r in rules if isinstance(r, WeightRenaming)], [r for r in rules if isinstance(r, WeightConverter)])


def _expert_rows(converter) -> bool:
    """Whether the converter stacks a list of tensors on dim 0 first and only concatenates along later dims after:
    then rows [a, b) of the result come from list items a..b-1 alone, so a rank reads only its experts."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    first, *rest = converter.operations
    return (isinstance(first, MergeModulelist) and first.dim == 0
            and all(isinstance(op, Concatenate) and op.dim > 0 for op in rest))


@dataclass
class Source:
    """Where one model tensor comes from: one file tensor, or several joined by a transformers converter."""

    parts: dict[str, list[TensorEntry]] = field(default_factory=dict)
    """The converter's source pattern -> the file tensors it matched, in transformers' order (experts by number);
    a plain tensor: {"": [its entry]}."""
    converter: object | None = None

    @property
    def entry(self) -> TensorEntry:
        """The first file tensor (the only one of a plain tensor)."""
        return next(iter(self.parts.values()))[0]

    @property
    def rows_selectable(self) -> bool:
        return self.converter is None or _expert_rows(self.converter)

    def shape(self, config) -> list[int]:
        """The model tensor's shape, from the headers alone (the converter run on meta tensors)."""
        if self.converter is None:
            return list(self.entry.shape)
        return list(self.assemble(lambda e: torch.empty(e.shape, device="meta"), config).shape)

    def assemble(self, read: Callable[[TensorEntry], torch.Tensor], config,
                 rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The model tensor (or its rows [a, b) on dim 0), each file tensor read with read. Rows of a converted
        tensor read only the file tensors they come from when the converter allows (rows_selectable), else the
        whole tensor is built and sliced."""
        if self.converter is None:
            out = read(self.entry)
            return out if rows is None else out[rows[0]:rows[1]]
        pick = slice(*rows) if rows is not None and self.rows_selectable else slice(None)
        tensors = {pattern: [read(e) for e in entries[pick]] for pattern, entries in self.parts.items()}
        conv = self.converter
        for op in conv.operations:
            tensors = op.convert(tensors, source_patterns=conv.source_patterns, target_patterns=conv.target_patterns,
                                 full_layer_name="", model=None, config=config, missing_keys=None)
        (out,) = tensors.values()
        return out if rows is None or self.rows_selectable else out[rows[0]:rows[1]]


class WeightNames:
    """The naming rules of one model (any wrapper of it keeps the same names): tied weights stored under either
    name, and transformers' renamings and converters."""

    def __init__(self, model: nn.Module, base_name: Callable[[str], str | None] = lambda name: name):
        self.config = model.config
        self.partners = tied_partners(model)
        self.base_name = base_name
        """A tensor's name in the model -> its name in the base model's files, None for one no file holds (an
        adapter's; Strategy.base_name)."""
        self.keys = dict.fromkeys(k for k in map(base_name, model.state_dict()) if k is not None)
        self.prefix = model.base_model_prefix
        self.renamings, self.converters = _rules(model)

    def _model_name(self, file_name: str) -> tuple[str, str | None]:
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(file_name, self.renamings, self.converters, self.prefix, self.keys)
        if renamed not in self.keys and file_name in self.keys:  # transformers' own fallback: the name as it is
            return file_name, None
        return renamed, pattern

    def sources(self, index: dict[str, TensorEntry], wanted: Iterable[str], where: Path) -> dict[str, Source]:
        """Source of every wanted model tensor (a tied weight once, under the first of its names wanted) from a
        folder's tensors (index: file name -> entry). A tensor with no source is one line naming both sides when
        the folder holds tensors under names the model does not use."""
        from transformers.core_model_loading import dot_natural_key

        found: dict[str, Source] = {}
        by_pattern = {p: c for c in self.converters for p in c.source_patterns}
        for file_name in sorted(index, key=dot_natural_key):
            model_name, pattern = self._model_name(file_name)
            src = found.setdefault(model_name, Source())
            src.parts.setdefault(pattern or "", []).append(index[file_name])
            if pattern is not None:
                src.converter = by_pattern[pattern]
        out: dict[str, Source] = {}
        for wanted_key in wanted:
            key = self.base_name(wanted_key)
            if key is None:
                continue
            if key in found:
                out[wanted_key] = found[key]
            elif self.partners.get(key) in found:
                if self.partners[key] not in out:
                    out[wanted_key] = found[self.partners[key]]
            else:
                raise UserError(self._missing(key, found, where))
        return out

    def _missing(self, key: str, found: dict[str, Source], where: Path) -> str:
        unused = sorted(set(found) - set(self.keys) - set(self.partners))
        if not unused:
            return f"tensor {key} is missing from the weights in {where}"
        files = [e.name for name in unused for group in found[name].parts.values() for e in group]
        return (f"tensor {key} of the model is not in the weights in {where}, which hold {len(files)} tensors under "
                f"names the model does not use (e.g. {files[0]}): a naming mismatch that "
                f"transformers' conversion rules for model_type {self.config.model_type} do not cover; convert the "
                "checkpoint with the transformers version that wrote it, or load and save_pretrained it with this one")


def to_file_layout(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict under the model's names, in the layout save_pretrained writes (per-expert tensors, original
    block names): transformers' own reversal of its load rules, so every consumer that reads save_pretrained's
    files (older transformers, vLLM) reads ours. model: as transformers' classes build it (Strategy.as_built)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state_dict)
