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
