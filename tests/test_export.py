import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, torchrun
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM


def logits_of(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.arange(64).reshape(2, 32) % model.config.vocab_size
    with torch.no_grad():
        return model, model(input_ids=ids).logits.numpy()


@pytest.mark.parametrize("model", ["local/tiny", "local/tiny-untied"])
def test_exported_model_equals_the_trained_one(train_env, tmp_path, model):
    run = tmp_path / "r"
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "r", "-d", train_env["dataset"], "-m", model, "--save-dir", tmp_path,
                    "--config", ROOT / "configs" / "demo.yaml", "--max-steps", 6, "--ckpt-freq", 3, "--eval-freq", 3,
                    "--save-best", "on", env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = tmp_path / "trained.npy"
    helper = torchrun(2, ROOT / "tests" / "helpers" / "checkpoint_logits.py", run / "checkpoints" / "step-00000006",
                      trained, env=train_env["env"])
    assert helper.returncode == 0, helper.stderr[-3000:]
    exported, logits = logits_of(run / "hf")
    np.testing.assert_allclose(logits, np.load(trained), rtol=0, atol=1e-5)
    tied = model == "local/tiny"
    assert (exported.lm_head.weight is exported.model.embed_tokens.weight) is tied
    # a tied weight is written once, under the embedding's name
    saved = FileSystemReader(str(run / "checkpoints" / "step-00000006")).read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in saved and ("model.lm_head.weight" in saved) is not tied
    assert exported.config.tie_word_embeddings is tied
    assert (run / "hf" / "tokenizer.json").read_bytes() == (
        train_env["root"] / "hf" / "hub" / f"models--local--{model.split('/')[1]}" / "snapshots").glob(
        "*/tokenizer.json").__next__().read_bytes()
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert (run / "best" / "config.json").exists() and [e["step"] for e in evals] == [0, 3, 6]
    # an offline export of an earlier checkpoint, in bf16, under torchrun
    out = tmp_path / "export3"
    exp = torchrun(2, "-m", "pipeline.export", "--checkpoint", run / "checkpoints" / "step-00000003", "--out", out,
                   "--export-dtype", "bf16", env=train_env["env"])
    assert exp.returncode == 0, exp.stderr[-3000:]
    (weights,) = out.glob("*.safetensors")
    with safe_open(str(weights), "pt") as fh:
        assert {fh.get_slice(k).get_dtype() for k in fh.keys()} == {"BF16"}  # noqa: SIM118
        assert ("lm_head.weight" in fh.keys()) is not tied  # noqa: SIM118
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_an_export_never_replaces_a_folder_it_did_not_write(tmp_path):
    """--out must be new, empty or a previous export: a user's files or a run folder are refused in one line, before
    any process group, and left as they were."""
    from pipeline.errors import UserError
    from pipeline.train.export import check_replaceable

    previous = tmp_path / "previous"
    previous.mkdir()
    for name in ("config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "tokenizer.json"):
        (previous / name).write_text("{}")
    check_replaceable(previous, "--out")
    check_replaceable(tmp_path / "new", "--out")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError) as err:
        check_replaceable(run, "--out")
    assert str(err.value) == (f"--out {run} holds what an export does not write (checkpoints/, metrics.jsonl); "
                              "refusing to replace it: choose a new folder, or empty this one")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = subprocess.run([sys.executable, "-m", "pipeline.export", "--checkpoint", tmp_path / "nowhere", "--out",
                           mine], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
        f"error: --out {mine} holds what an export does not write (notes.txt); refusing to replace it: choose a new "
        "folder, or empty this one")
    assert (mine / "notes.txt").read_text() == "keep me" and [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_dcp_consolidation_writes_a_0_dim_tensor_as_zero(tmp_path):
    """Why export.restore_scalars exists: DCP's HF consolidation writes a 0-dim tensor's value as 0.0 (its shape [] is
    taken for an empty tensor), silently. When this fails, torch has fixed it and restore_scalars can go."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    writer = dcp.HuggingFaceStorageWriter(str(tmp_path), fqn_to_index_mapping={"scalar": 1, "vector": 1},
                                          save_distributed=True, enable_consolidation=True)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"scalar": torch.tensor(0.5), "vector": torch.tensor([0.5])}, storage_writer=writer, no_dist=True)
    (consolidated,) = tmp_path.glob("*.safetensors")
    tensors = load_file(consolidated)
    assert tensors["scalar"].shape == () and tensors["scalar"].item() == 0.0 and tensors["vector"].tolist() == [0.5]


@pytest.mark.parametrize("strategy", ["fsdp2", "manual", "ddp"])
def test_a_0_dim_buffer_is_exported_with_its_value(strategy, group_of_one, tmp_path):
    """Apertus' xIELU activation holds two 0-dim persistent buffers (beta, eps): after a step, the export holds them
    as trained, 0-dim, and computes the trained model's loss (they were written as 0.0). Through DCP's writer
    (fsdp2, manual) and rank 0's own files (ddp)."""
    from transformers import ApertusConfig, AutoConfig

    from pipeline.config_merge import from_flat
    from pipeline.data.batches import make_batch
    from pipeline.objectives.causal_lm import CausalLMLoss
    from pipeline.prep.tiny import random_buffers
    from pipeline.strategies.registry import make_strategy, settle
    from pipeline.train.export import export_model

    torch.manual_seed(0)
    config = ApertusConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, dtype="float32")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    random_buffers(model)
    model.save_pretrained(tmp_path / "base")
    scalars = {k: v for k, v in model.state_dict().items() if v.ndim == 0}
    assert sorted(scalars) == [f"model.layers.{i}.mlp.act_fn.{b}" for i in (0, 1) for b in ("beta", "eps")]
    cfg = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": str(tmp_path / "base"),
                            "strategy": strategy, "precision": "fp32"}))
    built = make_strategy(cfg.model, group_of_one, torch.float32)
    built.build(AutoConfig.from_pretrained(tmp_path / "base"))
    built.load_weights(tmp_path / "base")
    batch = make_batch(np.random.default_rng(1).integers(0, 512, size=(2, 16)), None, group_of_one.device)
    optimizer = torch.optim.AdamW([p for g in built.param_groups(0.0) for p in g["params"]], lr=1e-2)
    with built.gradient_sync(True):
        CausalLMLoss(built.head())(batch, 2 * 15).backward()
    optimizer.step()
    with torch.no_grad():
        trained_loss = CausalLMLoss(built.head())(batch, 2 * 15).item()
    export_model(built, tmp_path / "base", tmp_path / "hf", torch.float32, group_of_one)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    state = exported.state_dict()
    for key, value in scalars.items():
        assert state[key].shape == () and torch.equal(state[key], value), key
    with torch.no_grad():
        assert exported(input_ids=batch.input_ids, labels=batch.labels).loss.item() == pytest.approx(trained_loss,
                                                                                                      abs=1e-5)


def test_an_fsdp2_export_keeps_the_names_save_pretrained_writes(group_of_one, tmp_path):
    """fully_shard gives the model a class of its own (FSDPDeepseekV4ForCausalLM), under which transformers' naming
    rules were looked up wrong: DeepSeek-V4's export renamed embed_tokens to `embed` and the hyper-connection head's
    tensors, which from_pretrained then left random (exit 0). The export holds save_pretrained's names and the
    loaded model's every tensor."""
    from safetensors import safe_open
    from transformers import AutoConfig, DeepseekV4Config

    from pipeline.config_merge import from_flat
    from pipeline.strategies.registry import make_strategy, settle
    from pipeline.train.export import export_model

    torch.manual_seed(0)
    config = DeepseekV4Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=16, qk_rope_head_dim=16, q_lora_rank=48, o_lora_rank=32,
                              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, index_head_dim=16,
                              index_n_heads=2, index_topk=8, dtype="float32")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "base")
    cfg = settle(from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": str(tmp_path / "base"),
                            "strategy": "fsdp2", "precision": "fp32"}))
    built = make_strategy(cfg.model, group_of_one, torch.float32)
    built.build(AutoConfig.from_pretrained(tmp_path / "base"))
    built.load_weights(tmp_path / "base")
    export_model(built, tmp_path / "base", tmp_path / "hf", torch.float32, group_of_one)

    def names(folder):
        with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as fh:
            return set(fh.keys())

    assert names(tmp_path / "hf") == names(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).state_dict()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in base.items())
