"""A tied output layer whose weight gradient the input embedding's is added into in place (pipeline/model/tied_head.py):
every family pipeline.tiny builds, its values and gradients against nn.Linear's, and the [vocab, hidden] sum that
autograd no longer makes."""

import copy

import numpy as np
import pytest
import torch
from conftest import built_strategy
from torch import nn
from torch.profiler import profile
from transformers import AutoModelForCausalLM

from pipeline.model.tied_head import TiedHead, tie_in_place
from pipeline.prep.tiny import FAMILIES, family_config


def _sums_of_weight_shape(model: nn.Module, ids: torch.Tensor,
                          dtype: torch.dtype | None) -> tuple[torch.Tensor, list, int]:
    """(logits, every parameter's gradient, out-of-place adds of a [vocab, hidden] shape in the backward)."""
    weight = model.get_input_embeddings().weight
    with torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(input_ids=ids).logits
    with profile(record_shapes=True) as prof:
        logits.float().logsumexp(-1).sum().backward()
    shape = [list(weight.shape), list(weight.shape), []]
    adds = sum(e.count for e in prof.key_averages(group_by_input_shape=True)
               if e.key == "aten::add" and e.input_shapes == shape)
    return logits.detach(), [p.grad for p in model.parameters()], adds


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tied_family_gets_linears_values_and_gradients_without_a_third_weight_sized_tensor(family):
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(family_config(family, 512, 0, 1), dtype=torch.float32)
    ties = bool(plain.config.get_text_config().tie_word_embeddings)
    tied = copy.deepcopy(plain)
    assert tie_in_place(tied) == ties  # every family whose config ties takes it; no other one
    if not ties:
        assert type(tied.get_output_embeddings()) is nn.Linear
        return
    assert type(tied.get_output_embeddings()) is TiedHead
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert list(dict(tied.named_parameters())) == list(dict(plain.named_parameters()))
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 500, size=(2, 12)))
    # under autocast nn.Linear's weight gradient comes out of the cast back to fp32, contiguous: summed in place too
    for dtype, tol, linear_adds in ((None, 1e-6, 1), (torch.bfloat16, 0.0, 0)):
        for m in (plain, tied):
            m.zero_grad(set_to_none=True)
        want, want_grads, plain_adds = _sums_of_weight_shape(plain, ids, dtype)
        got, got_grads, tied_adds = _sums_of_weight_shape(tied, ids, dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)
        for a, b in zip(got_grads, want_grads, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype
                assert (a - b).abs().max().item() <= tol * max(b.abs().max().item(), 1.0)
        assert (plain_adds, tied_adds) == (linear_adds, 0)  # a third [vocab, hidden] tensor: nn.Linear's sum in fp32


def test_ddp_builds_a_tied_model_with_the_tied_head_and_an_untied_one_as_it_is(tiny_models, group_of_one):
    for name, expected in (("tied", TiedHead), ("untied", nn.Linear)):
        strategy = built_strategy(tiny_models[name], "ddp", group_of_one)
        assert type(strategy.module.get_output_embeddings()) is expected
