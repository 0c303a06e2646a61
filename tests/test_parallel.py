import json
import shutil
from pathlib import Path

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


def load_sharded(model_dir: Path, d) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoConfig

    from pipeline.config import ModelConfig
    from pipeline.strategies.registry import make_strategy

    strategy = make_strategy(ModelConfig(model_name=str(model_dir), precision="fp32", strategy="fsdp2",
                                         vocab_parallel="off"), d, torch.float32)
    model = strategy.build(AutoConfig.from_pretrained(model_dir))
    strategy.load_weights(model_dir)
    return {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}


def bf16_copy(src: Path, dst: Path) -> Path:
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dst / name)
    return dst


def test_row_reader_converts_bf16_files_reading_in_small_pieces(tmp_path, tiny_models, group_of_one, monkeypatch):
    from safetensors.torch import load_file

    from pipeline.model import weights

    model_dir = bf16_copy(tiny_models["untied"], tmp_path / "bf16")
    monkeypatch.setattr(weights, "READ_CHUNK_BYTES", 1000)  # every matrix takes many reads
    got = load_sharded(model_dir, group_of_one)
    expected = load_file(model_dir / "model.safetensors")
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert tensor.dtype == torch.bfloat16 and got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor.float()), name


def test_truncated_weights_stop_the_load_with_the_file_named(tmp_path, tiny_models, group_of_one):
    from pipeline.errors import UserError

    model_dir = bf16_copy(tiny_models["untied"], tmp_path / "bf16")
    weights = model_dir / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 2)
    with pytest.raises(UserError) as info:
        load_sharded(model_dir, group_of_one)
    assert str(info.value).startswith(f"weight file {weights} is truncated or corrupt (")
    assert str(info.value).endswith("); download or import the model again")


def test_vocab_parallel_auto_is_on_where_the_sharding_allows_it():
    from pipeline.config_merge import from_flat
    from pipeline.strategies.registry import settle, uses_vocab_parallel

    def on(**kw) -> bool:
        return uses_vocab_parallel(settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": "m",
                                                     "strategy": "fsdp2", **kw})).model)

    assert on() and on(sharding="SHARD_GRAD_OP") and on(vocab_parallel="on")
    assert not on(sharding="HYBRID_SHARD")
    assert not on(sharding="NO_SHARD")
    assert not on(cpu_offload=True)
    assert not on(vocab_parallel="off")
    assert not on(strategy="fsdp1")
    assert not on(strategy="auto")  # decided once preflight has chosen the strategy
