import json

import numpy as np
import pytest
import torch
from conftest import ROOT, torchrun
from transformers import AutoModelForCausalLM


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_two_rank_sharded_load_matches_from_pretrained(tmp_path, tiny_models, kind):
    out = tmp_path / "logits.npy"
    proc = torchrun(2, ROOT / "tests" / "helpers" / "sharded_logits.py", tiny_models[kind], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = AutoModelForCausalLM.from_pretrained(tiny_models[kind], dtype=torch.float32)
    ids = torch.arange(64).reshape(2, 32) % ref.config.vocab_size
    with torch.no_grad():
        expected = ref(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(np.load(out), expected, rtol=0, atol=1e-5)
    tied, local, full = out.with_suffix(".txt").read_text().split()
    assert tied == str(kind == "tied")
    rows = int(full) // ref.config.hidden_size
    # rank 0 holds ceil(rows / 2) rows of the embedding (dim-0 sharding), never the whole table
    assert int(local) == -(-rows // 2) * ref.config.hidden_size < int(full)


@pytest.mark.parametrize(("kind", "world"), [("tied", 2), ("untied", 2), ("tied", 3)])
def test_vocab_parallel_head_matches_the_hf_loss_and_gradients(tmp_path, tiny_models, kind, world):
    # 2 ranks split the tiny model's 681-row vocabulary unevenly (341 and 340 rows); 3 ranks combine 3 shares
    out = tmp_path / "grads.json"
    proc = torchrun(world, ROOT / "tests" / "helpers" / "vocab_parallel_grads.py", tiny_models[kind], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    hf_loss, vp_loss = r["loss"]
    assert abs(hf_loss - r["ref_loss"]) < 1e-5 and abs(vp_loss - r["ref_loss"]) < 1e-5
    assert r["ref_loss"] > 6.0  # random weights over 681 tokens: about ln(681) = 6.5, not a trivial zero
    hf_eval, vp_eval = r["eval"]
    assert abs(hf_eval - vp_eval) < 1e-5
    assert abs(hf_eval - r["ref_loss"]) > 1e-4  # rank 0's padding row was left out, in both paths alike
    assert r["tied"] == [kind == "tied"] * 2
    assert len(r["grad_max_diff"]) == 2 * 9 + 2 + (kind == "untied")  # every parameter compared
    worst = max(max(pair) for pair in r["grad_max_diff"].values())
    assert worst < 1e-5 * max(1.0, r["grad_scale"]), r["grad_max_diff"]
