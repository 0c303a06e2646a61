"""A mixture of experts' router (pipeline/model/router.py): the auxiliary load-balancing loss as transformers adds it,
the expert load per layer, a collapse warned of, and activation checkpointing giving the same gradients on every MoE
family of pipeline.tiny."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, losses, torchrun
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import ModelConfig
from pipeline.data.batches import make_batch
from pipeline.errors import UserError
from pipeline.model.registry import transforms_for
from pipeline.model.router import RouterBalance, aux_loss_function, router_recorder
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.prep.tiny import FAMILIES
from pipeline.strategies.registry import make_strategy

MOE = [f for f, (_, extra) in FAMILIES.items() if any("experts" in k for k in extra)]


def built(model_dir: Path, d, **flags):
    cfg = ModelConfig(model_name=str(model_dir), precision="fp32", strategy="fsdp2", sharding="auto",
                      vocab_parallel="off", **flags)
    s = make_strategy(cfg, d, torch.float32, transforms_for(cfg, torch.float32))
    s.build(AutoConfig.from_pretrained(model_dir))
    s.load_weights(model_dir)
    return s


def router_of(s) -> RouterBalance:
    return next(t for t in s.transforms if isinstance(t, RouterBalance))


def batch(d, seed: int = 1):
    return make_batch(np.random.default_rng(seed).integers(0, 500, size=(2, 16)), None, d.device)


def test_transformers_still_declares_the_router_it_records_logits_from():
    """router_recorder reads transformers' private _can_record_outputs: the router class and the logits' index."""
    from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM, MixtralTopKRouter

    assert router_recorder(MixtralForCausalLM.__new__(MixtralForCausalLM)) == (MixtralTopKRouter, 0)


@pytest.mark.parametrize("family", MOE)
def test_the_aux_loss_is_transformers_own_and_a_family_without_one_refuses_a_coefficient(family, family_models,
                                                                                         group_of_one):
    """Where the family defines a load-balancing loss, the step's loss with --router-aux-loss-coef is the HF
    forward's own (output_router_logits on), to fp32 rounding; where it does not, the flag is one line."""
    model_dir = family_models[family]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if aux_loss_function(reference) is None or router_recorder(reference) is None:
        with pytest.raises(UserError, match=rf"^--router-aux-loss-coef 0.05: transformers defines no auxiliary "
                                            rf"load-balancing loss for {reference.config.model_type} "):
            built(model_dir, group_of_one, router_aux_loss_coef=0.05)
        return
    s = built(model_dir, group_of_one, router_aux_loss_coef=0.05)
    b = batch(group_of_one)
    with s.recording():
        loss = CausalLMLoss(s.head())(b, 2 * 15)
    total = loss + s.auxiliary_loss()
    reference.router_aux_loss_coef = 0.05  # the causal LM copies the config's at init
    out = reference(input_ids=b.input_ids, labels=b.labels, output_router_logits=True)
    assert total.item() == pytest.approx(out.loss.item(), abs=2e-6)
    metrics = s.transform_metrics()
    assert metrics["aux_loss"] == pytest.approx(out.aux_loss.item(), abs=1e-6)
    moe_layers = {str(i) for i, layer in enumerate(reference.model.layers)
                  if any(".experts." in f".{n}" for n, _ in layer.named_parameters())}
    assert set(metrics["expert_load"]["idle"]) == moe_layers


def test_only_the_training_forward_records_and_the_config_s_coefficient_is_the_default(family_models, group_of_one):
    """Unarmed (validation, generation) and under no_grad (a reference pass) nothing is recorded; the default
    coefficient is the config's where output_router_logits is set, else the loss is only logged."""
    s = built(family_models["qwen3-moe"], group_of_one)
    router = router_of(s)
    assert router.coef == 0.0  # Qwen3MoeConfig's output_router_logits is False
    b = batch(group_of_one)
    CausalLMLoss(s.head())(b, 30)
    with s.recording(), torch.no_grad():
        CausalLMLoss(s.head())(b, 30)
    assert s.auxiliary_loss() is None and s.transform_metrics() == {}
    with s.recording():
        CausalLMLoss(s.head())(b, 30)
    assert s.auxiliary_loss() is None  # logged, not trained: coefficient 0
    assert "aux_loss" in s.transform_metrics()
    config = AutoConfig.from_pretrained(family_models["qwen3-moe"])
    config.output_router_logits, config.router_aux_loss_coef = True, 0.02
    cfg = ModelConfig(model_name="m", strategy="fsdp2")
    router = RouterBalance(cfg)
    with torch.device("meta"):
        router.apply(AutoModelForCausalLM.from_config(config))
    assert router.coef == 0.02
    with pytest.raises(UserError, match=r"^--router-aux-loss-coef 0.1: llama is not a mixture of experts$"):
        RouterBalance(ModelConfig(model_name="m", router_aux_loss_coef=0.1)).apply(
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(family_models["llama"])))


def test_a_config_that_asks_for_the_balancing_loss_gets_it_once(family_models, group_of_one, tmp_path):
    """output_router_logits in the model's config: the transform adds the config's coefficient times the loss, and
    the model's own forward (the HF loss path, labels given) no longer adds it a second time; the exported config
    still asks for it; --router-aux-loss-coef 0 turns it off."""
    import shutil

    model_dir = tmp_path / "moe"
    shutil.copytree(family_models["qwen3-moe"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "output_router_logits": True,
                                                       "router_aux_loss_coef": 0.05}))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    b = batch(group_of_one)
    with torch.no_grad():
        plain = reference(input_ids=b.input_ids, labels=b.labels, output_router_logits=False).loss.item()
        theirs = reference(input_ids=b.input_ids, labels=b.labels).loss.item()
    for coef, expected in ((-1.0, theirs), (0.0, plain)):
        s = built(model_dir, group_of_one, router_aux_loss_coef=coef)
        assert s.module.config.output_router_logits
        with s.recording(), torch.no_grad():
            loss = CausalLMLoss(s.head())(b, 2 * 15)
        with torch.no_grad():  # the trainer's forward with gradients on records; here the term is asked alone
            aux = s.auxiliary_loss()
        assert aux is None  # no_grad: nothing recorded
        with s.recording():
            loss = CausalLMLoss(s.head())(b, 2 * 15)
        aux = s.auxiliary_loss()
        assert loss.item() == pytest.approx(plain, abs=2e-6)
        assert (loss + (aux if aux is not None else 0)).item() == pytest.approx(expected, abs=2e-6)


def test_a_forced_router_collapse_shows_in_the_load_and_is_one_warning(family_models, group_of_one):
    """A router made to send every token to experts 0 and 1 (of 4, 2 per token): each layer's load is twice the
    mean on the busiest expert and 2 experts idle, and one warning names every layer, once."""
    s = built(family_models["qwen3-moe"], group_of_one)
    routers = [m for m in s.module.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    assert len(routers) == 2

    def collapse(module, args, output):
        logits, scores, indices = output
        return logits, scores, torch.tensor([0, 1]).expand_as(indices).contiguous()

    for router in routers:
        router.register_forward_hook(collapse)
    for seed in (1, 2):
        with s.recording():
            CausalLMLoss(s.head())(batch(group_of_one, seed), 30)
        s.auxiliary_loss()
    load = s.transform_metrics()["expert_load"]
    assert load == {"max_over_mean": {"0": 2.0, "1": 2.0}, "idle": {"0": 2, "1": 2}}
    assert s.transform_warnings() == [
        "router: router collapse: layer 0's expert 0 took 100% of the window's tokens; layer 1's expert 0 took 100% of "
        "the window's tokens (expert_load in metrics.jsonl; a higher --router-aux-loss-coef or a lower --lr may help)"]
    with s.recording():
        CausalLMLoss(s.head())(batch(group_of_one), 30)
    s.auxiliary_loss()
    s.transform_metrics()
    assert s.transform_warnings() == []  # said once


@pytest.mark.parametrize("family", MOE)
def test_activation_checkpointing_gives_every_moe_family_the_same_gradients(family, family_models, group_of_one):
    """Whole-layer and selective checkpointing recompute each MoE layer (its routing included) in the backward: the
    loss and every gradient as without, the router's balancing term included where the family has one; the
    recomputation records nothing (the load counts one forward)."""
    model_dir = family_models[family]
    has_aux = aux_loss_function(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))) is not None
    flags = {"router_aux_loss_coef": 0.05} if has_aux else {}
    grads, counts = {}, {}
    for mode in ("none", "activation_checkpointing", "selective_checkpointing"):
        s = built(model_dir, group_of_one, **flags, **({mode: True} if mode != "none" else {}))
        with s.recording():
            loss = CausalLMLoss(s.head())(batch(group_of_one), 30)
        aux = s.auxiliary_loss()
        (loss if aux is None else loss + aux).backward()
        grads[mode] = {n: p.grad.full_tensor().clone() for n, p in s.module.named_parameters() if p.grad is not None}
        counts[mode] = s.transform_metrics().get("expert_load")  # none for Llama 4 (its experts take no routing)
    for mode in ("activation_checkpointing", "selective_checkpointing"):
        assert grads[mode].keys() == grads["none"].keys()
        for name, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=0, atol=1e-7 if family == "qwen3_5_moe" else 0,
                                       msg=f"{mode} {name}")
        assert counts[mode] == counts["none"]


def test_two_ranks_train_the_same_balancing_term_whether_gradients_are_averaged_or_summed(train_env, tmp_path):
    """fsdp2 averages the gradients of the model's own loss and sums those of the vocabulary-parallel one (already
    the mean over every rank's tokens): the router's term, each rank's own, must weigh the same under both, so the
    two runs train the same losses."""
    from pipeline.prep.hub import import_local
    from pipeline.prep.tiny import build_family

    hf = tmp_path / "hf"
    import_local(build_family(tmp_path / "qwen3-moe", "qwen3-moe"), "local/qwen3-moe", "main", hf / "hub")
    for name, vocab in (("summed", "on"), ("averaged", "off")):
        args = ["-d", train_env["dataset"], "-m", "local/qwen3-moe", "--save-dir", tmp_path, "-e", name, "--config",
                ROOT / "configs" / "demo.yaml", "--log-freq", "1", "--eval-freq", "0", "--ckpt-freq", "0",
                "--max-steps", "3", "--strategy", "fsdp2", "--router-aux-loss-coef", "0.5", "-b", "2",
                "--vocab-parallel", vocab, "--precision", "fp32"]
        proc = torchrun(2, ROOT / "fsdp1.py", *args, env={**train_env["env"], "HF_HOME": str(hf)})
        assert proc.returncode == 0, proc.stderr[-3000:]
    got, expected = (losses(tmp_path / name) for name in ("summed", "averaged"))
    assert sorted(got) == [1, 2, 3] and got == pytest.approx(expected, rel=1e-5)


def test_two_ranks_log_the_aux_loss_and_every_layer_s_load(train_env, tmp_path):
    """A qwen3-moe run on 2 ranks with --router-aux-loss-coef: every train event of metrics.jsonl holds aux_loss and
    each layer's expert load, summed over both ranks' tokens; the human line shows aux_loss."""
    from pipeline.prep.hub import import_local
    from pipeline.prep.tiny import build_family

    model = build_family(tmp_path / "qwen3-moe", "qwen3-moe")
    hf = tmp_path / "hf"
    import_local(model, "local/qwen3-moe", "main", hf / "hub")
    args = ["-d", train_env["dataset"], "-m", "local/qwen3-moe", "--save-dir", tmp_path, "-e", "r", "--config",
            ROOT / "configs" / "demo.yaml", "--log-freq", "1", "--eval-freq", "0", "--ckpt-freq", "0",
            "--max-steps", "2", "--strategy", "fsdp2", "--router-aux-loss-coef", "0.01", "-b", "2"]
    proc = torchrun(2, ROOT / "fsdp1.py", *args, env={**train_env["env"], "HF_HOME": str(hf)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e.get("event") == "train"]
    assert [e["step"] for e in train] == [1, 2]
    for event in train:
        assert 1.0 <= event["aux_loss"] <= 8.0  # E x sum(f x P): k (2) when balanced, E x k at most
        assert set(event["expert_load"]["idle"]) == {"0", "1"}
        assert all(v >= 1.0 for v in event["expert_load"]["max_over_mean"].values())
    assert "'aux_loss': " in proc.stdout + proc.stderr
    # --expert-parallel auto, the default: the 4 experts split over the 2 ranks, the load still every rank's tokens
    assert "expert parallelism: 4 experts per layer over 2 ranks (2 each)" in proc.stdout + proc.stderr


def test_the_coefficient_is_a_finite_number_in_its_range():
    from pipeline.config_merge import from_flat

    def coef(value: str) -> float:
        return from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": "m",
                          "router_aux_loss_coef": value}).model.router_aux_loss_coef

    for bad, message in (("inf", "must be a finite number, got inf"), ("nan", "must be a finite number, got nan"),
                         ("1e308", r"must be in \[0, 100\] \(or -1: the model config's\), got 1e\+308"),
                         ("-0.5", r"must be in \[0, 100\] \(or -1: the model config's\), got -0.5")):
        with pytest.raises(UserError, match=rf"^--router-aux-loss-coef {message}$"):
            coef(bad)
    assert (coef("-1"), coef("0"), coef("1e-320"), coef("100")) == (-1.0, 0.0, 1e-320, 100.0)
