"""--tiled-mlp on (ALST's TiledMLP): every family the project builds trains to the same loss and gradients with each
MLP computed over chunks of the sequence, holding less for backward, or is refused in one line (a mixture of
experts); a real two-rank run takes the same steps either way."""

import pytest
import torch
from conftest import ROOT, losses, torchrun
from transformers import AutoModelForCausalLM

from pipeline.errors import UserError
from pipeline.model.tiled_mlp import TiledMLP, chunks_for
from pipeline.prep.tiny import FAMILIES, family_config


def loss_grads_saved(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict, int]:
    """The loss, every parameter's gradient, and the bytes autograd saved for backward outside checkpointed
    regions (what a long sequence's activations cost)."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, saved[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_tiles_to_the_same_loss_and_gradients_holding_less_or_is_refused(family):
    config = family_config(family, 512, 0, 1)
    text = config.get_text_config()
    seq = 3 * text.hidden_size + 5  # four chunks
    ids = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tiled = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tiled.load_state_dict(plain.state_dict())
    transform = TiledMLP()
    try:
        transform.apply(tiled)
    except UserError as refused:
        assert str(refused) == (f"--tiled-mlp on: {type(tiled).__name__}'s MLP is a mixture of experts, whose router "
                                "must see the whole sequence; use --tiled-mlp off"), family
        return
    assert transform.layers == text.num_hidden_layers and chunks_for(seq, text.hidden_size) == 4
    want, want_grads, want_saved = loss_grads_saved(plain, ids)
    got, got_grads, got_saved = loss_grads_saved(tiled, ids)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6), family
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{family} {name}")
    # each layer's MLP intermediates (gate and up projections' outputs at least) are no longer kept
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    assert want_saved - got_saved >= text.num_hidden_layers * 2 * ids.numel() * intermediate * 4 * 0.9, family


def test_a_two_rank_run_takes_the_same_steps_tiled_or_not(tmp_path, train_env):
    """fsdp2 on two ranks with activation checkpointing, blocks of 256 tokens on the tiny model (hidden 64: four
    chunks): the losses of --tiled-mlp on are those of off."""
    runs = {}
    for mode in ("off", "on"):
        proc = torchrun(2, ROOT / "fsdp1.py", "-e", mode, "-d", train_env["dataset"], "-m", "local/tiny",
                        "--save-dir", tmp_path, "--config", ROOT / "configs" / "demo.yaml", "--seq-length", 256,
                        "--max-steps", 3, "--log-freq", 1, "--strategy", "fsdp2", "--precision", "fp32",
                        "--activation-checkpointing", "true", "--tiled-mlp", mode, env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = losses(tmp_path / mode)
    assert sorted(runs["on"]) == [1, 2, 3]
    for step, loss in runs["off"].items():
        assert runs["on"][step] == pytest.approx(loss, rel=1e-6), step


def test_a_mixture_of_experts_is_refused_before_any_worker_starts(tmp_path, train_env, family_models):
    from conftest import preflight_errors

    assert preflight_errors([["-e", "r", "-d", train_env["dataset"], "-m", family_models["qwen3-moe"], "--save-dir",
                              tmp_path, "--config", ROOT / "configs" / "demo.yaml", "--tiled-mlp", "on"]],
                            train_env["env"]) == [
        "--tiled-mlp on: Qwen3MoeForCausalLM's MLP is a mixture of experts, whose router must see the whole sequence; "
        "use --tiled-mlp off"]
