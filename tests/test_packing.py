"""GRPO's packed rows (pipeline/rl/packing.py): each prompt once with its group's completions after it gives every
completion token the log-probability, entropy and gradient of plain rows, on every family the pipeline builds that
packing_refusal lets pack, and the refusals name why."""

import pytest
import torch


def plain_logps(model, prompt_ids, prompt_mask, completion_ids):
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, torch.ones_like(completion_ids)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    width = completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                   logits_to_keep=width + 1).logits[:, :-1].float()
    return torch.gather(logits, -1, completion_ids[..., None]).squeeze(-1) - logits.logsumexp(-1), logits


def rows(vocab: int, group: int, width: int):
    torch.manual_seed(1)
    prompts = torch.randint(3, vocab, (2, 3))
    mask = torch.ones_like(prompts)
    prompts[0, 0], mask[0, 0] = 0, 0  # a left-padded prompt
    return (prompts.repeat_interleave(group, 0), mask.repeat_interleave(group, 0),
            torch.randint(3, vocab, (2 * group, width)))


@pytest.mark.parametrize("kernel", ["auto", "eager"])
def test_packed_rows_score_every_family_as_plain_rows_do(kernel):
    """Each family with the kernel transformers picks for it (what --attn-implementation auto gives: sdpa, or eager
    where the family has no sdpa) and with eager."""
    from transformers import AutoModelForCausalLM

    from pipeline.model.packed_rows import packing_refusal
    from pipeline.prep.tiny import FAMILIES, family_config
    from pipeline.rl.packing import model_config, pack, row_entropy, token_logps

    group, width = 3, 4
    refused = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(family, 512, 0, 1), dtype=torch.float32,
                                                 **({} if kernel == "auto" else {"attn_implementation": kernel}))
        config = model_config(model)
        prompt_ids, prompt_mask, completion_ids = rows(512, group, width)
        if why := packing_refusal(config, prompt_ids.shape[1] + width):
            refused[family] = why
            continue
        want, logits = plain_logps(model, prompt_ids, prompt_mask, completion_ids)
        packed = pack(prompt_ids, prompt_mask, completion_ids, group, torch.float32)
        kept = model(input_ids=packed.input_ids, attention_mask=packed.mask, position_ids=packed.positions,
                     use_cache=False, logits_to_keep=packed.keep).logits.float()
        got, entropy = token_logps(kept, completion_ids, packed, entropy=True, reuse=True)  # as GRPO scores
        assert torch.allclose(got, want, atol=2e-5), (family, (got - want).abs().max())
        assert torch.allclose(entropy, row_entropy(logits), atol=2e-5), family
        # the gradient too: the prompt's activations feed G completions in one row instead of G rows
        grads = [torch.autograd.grad(x.sum(), [p for p in model.parameters() if p.requires_grad], allow_unused=True)
                 for x in (want, got)]
        for a, b in zip(*grads, strict=True):
            assert (a is None) == (b is None), family
            assert a is None or (a - b).abs().max() <= 1e-4 * a.abs().max(), (family, (a - b).abs().max())
    assert refused == {"qwen3_5": "its layers include linear_attention, which read the sequence in order",
                       "qwen3_5_moe": "its layers include linear_attention, which read the sequence in order"}
    config = family_config("mistral", 512, 0, 1)
    config._attn_implementation = "sdpa"
    assert packing_refusal(config, 9) == "its sliding window (8) is shorter than a prompt and its completion (9)"
    config._attn_implementation = "flash_attention_2"
    assert packing_refusal(config, 4) == "its attention kernel flash_attention_2 takes no 4D mask"


def test_packed_rows_are_chosen_where_they_cost_less():
    """One dense row of a prompt and its group against the group's causal rows: short completions after a prompt
    pack (SmolLM2-135M's shape, the GRPO bench's lengths), many long ones do not (Llama-3.1-8B's, 16 x 2048 after 1024:
    the row's attention over 33,792 positions costs more than the prompt saved)."""
    from transformers import LlamaConfig

    from pipeline.model.packed_rows import Costs

    small = Costs.of(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3))
    assert small.packing_pays(17, 32, 8) and small.packing_pays(512, 256, 8)
    large = Costs.of(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8))
    assert large.packing_pays(1024, 256, 8) and not large.packing_pays(1024, 2048, 16)


def test_target_logps_equals_autograds_composition_with_rows_read_twice():
    """The one-buffer backward (pipeline/rl/target_logps.py) gives log_softmax's values and gradients, where a row is
    read by several pairs (a packed prompt's last position), by none, and across chunks of its log-sum-exp, with the
    gradient in a buffer of its own or over the logits (reuse); and torch's gradcheck passes in float64."""
    from pipeline.rl import target_logps as module

    torch.manual_seed(0)
    logits = torch.randn(600, 50, dtype=torch.float64) * 4
    rows = torch.cat([torch.zeros(5, dtype=torch.long), torch.arange(2, 600, 3), torch.tensor([599, 599])])
    targets = torch.randint(0, 50, rows.shape)
    upstream = torch.randn(rows.shape, dtype=torch.float64)
    a = logits.clone().requires_grad_()
    want = a.log_softmax(-1)[rows, targets]
    (want * upstream).sum().backward()
    b = logits.clone().requires_grad_()
    got = module.target_logps(b, rows, targets)
    (got * upstream).sum().backward()
    assert logits.shape[0] > module.ROWS_PER_CHUNK  # the log-sum-exp in more than one chunk
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(b.grad, a.grad, atol=1e-12)
    assert b.grad[1].abs().max() == 0  # a row no pair reads
    # reuse: the gradient is written over logits an op made (the same values, in their own buffer); a leaf's are kept
    c = logits.clone().requires_grad_()
    made = c * 1
    (module.target_logps(made, rows, targets, reuse=True) * upstream).sum().backward()
    assert torch.equal(c.grad, b.grad) and torch.equal(made.detach(), b.grad)
    d = logits.clone().requires_grad_()
    (module.target_logps(d, rows, targets, reuse=True) * upstream).sum().backward()
    assert torch.equal(d.grad, b.grad) and torch.equal(d.detach(), logits)
    small = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    pairs = (torch.tensor([0, 0, 2, 3]), torch.tensor([1, 5, 0, 0]))
    assert torch.autograd.gradcheck(module.target_logps, (small, *pairs))
