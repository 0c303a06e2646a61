"""The one build path every strategy takes (meta model, model transforms, checkpointing and compile, the wrap) and the
one step function: run for real in this process as a gloo group of one, and on two ranks for the step's decision."""

import json

import numpy as np
import pytest
import torch
from conftest import ROOT, torchrun
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from pipeline.config_merge import from_flat
from pipeline.data.batches import make_batch
from pipeline.model.transforms import ModelTransform
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.prep.tiny import FAMILIES
from pipeline.strategies.registry import STRATEGIES, make_strategy, settle
from pipeline.train.optim import build_optimizer, build_scheduler
from pipeline.train.step import Update, train_step
from pipeline.train.telemetry import PhaseTimer


class Probe(ModelTransform):
    """Records what the build hands a transform, freezes the final norm, and counts the after-step calls."""

    name = "probe"

    def __init__(self) -> None:
        self.seen: dict = {}
        self.steps = 0

    def apply(self, model: nn.Module) -> None:
        self.seen = {"plain": isinstance(model, PreTrainedModel) and type(model).__module__.startswith("transformers"),
                     "devices": {p.device.type for p in model.parameters()},
                     "checkpointing": model.is_gradient_checkpointing, "model": model}
        model.model.norm.weight.requires_grad_(False)

    def after_optimizer_step(self, model: nn.Module) -> None:
        assert model is self.seen["model"]
        self.steps += 1


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_applies_the_transforms_to_the_plain_meta_model_before_checkpointing_and_its_wrap(
        name, tiny_models, group_of_one):
    model_dir = tiny_models["untied"]
    checkpointing = name != "manual"  # manual refuses activation checkpointing
    cfg = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": str(model_dir),
                            "strategy": name, "precision": "fp32", "vocab_parallel": "off",
                            "activation_checkpointing": checkpointing, "lr_schedule": "constant"}))
    probe = Probe()
    strategy = make_strategy(cfg.model, group_of_one, torch.float32, [probe])
    strategy.build(AutoConfig.from_pretrained(model_dir))
    assert probe.seen["plain"] and probe.seen["devices"] == {"meta"} and not probe.seen["checkpointing"]
    assert strategy.module is probe.seen["model"]
    assert strategy.module.is_gradient_checkpointing == checkpointing  # applied after the transform
    strategy.load_weights(model_dir)
    optimizer = build_optimizer(strategy.param_groups(0.0), cfg)
    update = Update(optimizer, build_scheduler(optimizer, cfg, 2), 1.0)
    rows = np.random.default_rng(0).integers(0, 500, size=(2, 16))
    norm_before = strategy.module.model.norm.weight
    for _ in range(2):
        result = train_step(strategy, CausalLMLoss(strategy.head()), [rows],
                            lambda r: make_batch(r, None, group_of_one.device), 2 * 15, update,
                            PhaseTimer(group_of_one.device))
        assert result.applied
    assert probe.steps == 2
    if name in ("fsdp2", "ddp"):  # the frozen norm kept out of the update where the parameter stays itself
        assert not norm_before.requires_grad and strategy.module.model.norm.weight.grad is None


def test_a_skipped_step_reports_the_global_norm_and_every_rank_skips_it(tmp_path):
    """Rank 0's loss is not finite, rank 1's is; the norm (global already) is 3 on both. Every rank must skip, and
    the logged norm is 3, not the world size times 3."""
    out = tmp_path / "agree.json"
    proc = torchrun(2, ROOT / "tests" / "helpers" / "agree_figures.py", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["skipped"] == [{"applied": False, "grad_norm": 3.0}] * 2
    assert got["finite"] == [{"applied": True, "grad_norm": 3.0, "loss": 1.5}] * 2


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_trains_and_exports_the_model_from_pretrained_gives(family, name, family_models,
                                                                          group_of_one, tmp_path):
    """Every buffer (persistent or not) equals from_pretrained's after the meta build and load, and the first loss
    is the model's own on the same batch, under every strategy (fsdp2 with its default --vocab-parallel auto). After
    a training step, the export holds the trained model tensor by tensor, persistent buffers included: every tensor
    from_pretrained reads from it equals the strategy's (gathered), and its loss is the strategy's."""
    from transformers import AutoModelForCausalLM

    from pipeline.model.modeling import plain_name
    from pipeline.train.export import export_model

    model_dir = family_models[family]
    cfg = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": str(model_dir),
                            "strategy": name, "precision": "fp32"}))
    strategy = make_strategy(cfg.model, group_of_one, torch.float32)
    strategy.build(AutoConfig.from_pretrained(model_dir))
    strategy.load_weights(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = dict(reference.named_buffers())
    got = {plain_name(n): b for n, b in strategy.module.named_buffers()}
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key].cpu(), value), key
    rows = np.random.default_rng(1).integers(0, 512, size=(2, 16))
    batch = make_batch(rows, None, group_of_one.device)
    with torch.no_grad():
        ours = CausalLMLoss(strategy.head())(batch, 2 * 15).item()
        theirs = reference(input_ids=batch.input_ids, labels=batch.labels).loss.item()
    assert ours == pytest.approx(theirs, abs=1e-5)
    optimizer = torch.optim.AdamW([p for g in strategy.param_groups(0.0) for p in g["params"]], lr=1e-2)
    with strategy.gradient_sync(True):
        CausalLMLoss(strategy.head())(batch, 2 * 15).backward()
    optimizer.step()
    trained = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in strategy.export_state().items()}
    export_model(strategy, model_dir, tmp_path / "hf", torch.float32, group_of_one)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    state = exported.state_dict()
    assert set(trained) <= set(state) and set(state) - set(trained) <= set(strategy.tied)
    for key, value in trained.items():
        assert torch.equal(state[key], value.cpu()), key
    with torch.no_grad():
        assert exported(input_ids=batch.input_ids, labels=batch.labels).loss.item() == pytest.approx(
            CausalLMLoss(strategy.head())(batch, 2 * 15).item(), abs=1e-5)
