"""Adapters (LoRA, DoRA): the model starts as the base, only adapters train, checkpoints hold them alone and resume
bitwise (also on another world size and strategy), and the exports load in peft and transformers."""

import copy
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ROOT, events, losses, run_script, torchrun
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import ModelConfig
from pipeline.data.batches import make_batch
from pipeline.errors import UserError
from pipeline.model import nf4
from pipeline.model.adapters import is_adapter_key, local
from pipeline.model.registry import transforms_for
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.prep.tiny import FAMILIES
from pipeline.strategies.registry import make_strategy
from pipeline.train.export import adapter_of

TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def built(model_dir: Path, d, adapter: str, strategy: str = "fsdp2"):
    cfg = ModelConfig(model_name=str(model_dir), precision="fp32", strategy=strategy, sharding="auto",
                      vocab_parallel="off", adapter=adapter, lora_rank=4, lora_alpha=8)
    s = make_strategy(cfg, d, torch.float32, transforms_for(cfg, torch.float32))
    s.build(AutoConfig.from_pretrained(model_dir))
    s.load_weights(model_dir)
    return s


@pytest.mark.parametrize("adapter", ["lora", "dora"])
def test_an_adapter_starts_as_the_base_and_merges_and_saves_as_peft_does(group_of_one, tiny_models, tmp_path,
                                                                         adapter):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    model_dir = tiny_models["tied"]
    s = built(model_dir, group_of_one, adapter)  # fsdp2 on one rank: every tensor a DTensor of one shard
    ids = torch.randint(0, 400, (2, 24))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ours, theirs = s.model(input_ids=ids).logits, base(input_ids=ids).logits
    if adapter == "lora":
        assert torch.equal(ours, theirs)  # B = 0: exactly the base
    else:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # magnitude / norm = 1, up to rounding
    trainable = {n for n, p in s.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n) for n in trainable)
    assert {n.split(".")[-4] for n in trainable if ".lora_A." in n} == set(TARGETS)
    # make the adapter do something, then merge it: ours by rows, peft's merge_and_unload on the whole model
    with torch.no_grad():
        for name, p in s.model.named_parameters():
            if ".lora_B." in name or "magnitude" in name:
                p.to_local().add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))).mul(0.05))
    saved = adapter_of(s).adapter_state(s.model, s.module)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                 use_dora=adapter == "dora", task_type="CAUSAL_LM"))
    peft_model.save_pretrained(tmp_path / "peft")  # the names and shapes peft writes
    written = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in written.items()}
    assert all(v.ndim == 2 for k, v in saved.items() if "lora_A" in k or "lora_B" in k)
    result = set_peft_model_state_dict(peft_model, saved)
    assert not result.unexpected_keys
    merged = peft_model.merge_and_unload().state_dict()
    exported = {k: v.full_tensor() for k, v in s.export_state().items()}
    assert set(exported) == set(merged) - {"lm_head.weight"}  # tied: stored once, under the embedding
    for key, value in exported.items():
        torch.testing.assert_close(value, merged[key], rtol=0, atol=2e-6, msg=key)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_every_family_trains_the_loss_peft_gives_with_the_same_adapter(family, strategy, family_models,
                                                                       group_of_one):
    """With a nonzero adapter, the trainer's loss on a batch equals peft's own model (from_pretrained's base with the
    adapter we save loaded into it), for every family; a mixture of experts' router is never adapted, and every
    fused expert weight is (peft's target_parameters), its adapter counted as the experts' trainable parameters."""
    from peft import get_peft_model, set_peft_model_state_dict

    model_dir = family_models[family]
    s = built(model_dir, group_of_one, "lora", strategy)
    adapter = adapter_of(s)
    experts = getattr(s.module.config, "num_local_experts", None) or getattr(s.module.config, "num_experts", None)
    adapted = [m.base_layer for m in s.module.modules() if hasattr(m, "lora_A")]
    assert adapted and not any(experts and m.out_features == experts for m in adapted if isinstance(m, torch.nn.Linear))
    fused = {n for n, p in s.module.named_parameters() if p.ndim == 3 and ".experts." in n}
    assert set(adapter.experts) == fused  # every fused expert weight of every block, none on a dense family
    assert adapter.warnings() == []
    lora_on_experts = sum(p.numel() for n, p in s.module.named_parameters() if ".experts.lora_" in n
                          or ".experts.base_layer.lora_" in n)
    assert s.num_trainable_experts == lora_on_experts and (lora_on_experts > 0) == bool(fused)
    with torch.no_grad():  # seeded by the plain name: the same values under every strategy
        for name, p in s.model.named_parameters():
            if ".lora_B." in name:
                seed = zlib.crc32(name.removeprefix("module.").encode())
                local(p).copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).mul(0.05))
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                               copy.deepcopy(adapter.peft_config))
    assert not set_peft_model_state_dict(reference, adapter.adapter_state(s.model, s.module)).unexpected_keys
    batch = make_batch(np.random.default_rng(1).integers(0, 512, size=(2, 16)), None, group_of_one.device)
    with torch.no_grad():
        ours = CausalLMLoss(s.head())(batch, 2 * 15).item()
        theirs = reference(input_ids=batch.input_ids, labels=batch.labels).loss.item()
        base = reference.get_base_model()
        with reference.disable_adapter():
            plain = base(input_ids=batch.input_ids, labels=batch.labels).loss.item()
    assert ours == pytest.approx(theirs, abs=1e-5)
    assert abs(ours - plain) > 1e-4  # the adapter took part


MOE_FAMILIES = [f for f, (_, extra) in FAMILIES.items() if any("experts" in k for k in extra)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lora_on_fused_experts_merges_and_saves_as_peft_does(family, family_models, group_of_one, tmp_path):
    """Every MoE family: the adapter on the fused expert weights (each expert its own rank-r slices of A and B) merges
    into what peft's merge_and_unload gives, Llama 4's experts x in x out layout included, and saves under peft's
    names and shapes."""
    from peft import get_peft_model, set_peft_model_state_dict

    model_dir = family_models[family]
    s = built(model_dir, group_of_one, "lora")
    with torch.no_grad():
        for name, p in s.model.named_parameters():
            if ".lora_B." in name:
                p.to_local().add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))).mul(0.05))
    adapter = adapter_of(s)
    saved = adapter.adapter_state(s.model, s.module)
    assert any(".experts.lora_A." in k for k in saved) and any(".experts.base_layer.lora_B." in k for k in saved)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                copy.deepcopy(adapter.peft_config))
    assert not set_peft_model_state_dict(peft_model, saved).unexpected_keys
    merged = peft_model.merge_and_unload().state_dict()
    exported = {k: local(v) for k, v in s.export_state().items()}  # one rank: its shard is the whole tensor
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    experts = [k for k in exported if exported[k].ndim == 3 and ".experts." in k]
    assert experts and set(exported) <= set(merged)
    assert all((exported[k] - base[k]).abs().max() > 1e-4 for k in experts)  # every expert weight merged
    for key, value in exported.items():
        torch.testing.assert_close(value, merged[key], rtol=0, atol=2e-6, msg=key)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_an_adapter_folder_on_experts_rebuilds_the_targets_it_was_trained_with(family, family_models, tmp_path):
    """adapter_config.json's target_modules and target_parameters read back as --lora-targets give the same targets,
    where a shared expert's linear layer has a fused weight's name (down_proj) and where peft would move a linear
    name onto the experts (DeepSeek-V3, GLM-4-MoE)."""
    from peft import LoraConfig

    from pipeline.eval.adapter_folder import read_adapter_folder
    from pipeline.model.adapters import chosen_targets
    from pipeline.model.modeling import meta_model

    model = meta_model(AutoConfig.from_pretrained(family_models[family]))
    trained = chosen_targets(model, ModelConfig(model_name="m", adapter="lora"))
    assert trained.parameters == ["down_proj", "gate_up_proj"]
    LoraConfig(r=4, target_modules=trained.modules, target_parameters=trained.parameters).save_pretrained(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    settings = read_adapter_folder(tmp_path).settings
    assert chosen_targets(model, ModelConfig(model_name="m", **settings)) == trained


def test_experts_left_frozen_say_why_and_naming_them_where_peft_cannot_is_one_line(family_models, group_of_one):
    """DoRA and dropout, which peft's LoRA on a fused weight does not take: the default adapts the linear layers
    alone and warns that every routed expert is frozen, naming the flag; naming the experts is one line; a target
    list without them warns too; they can be named alone."""
    model_dir = family_models["qwen3-moe"]

    def make(**flags):
        cfg = ModelConfig(**{"model_name": str(model_dir), "precision": "fp32", "strategy": "fsdp2",
                             "vocab_parallel": "off", "lora_rank": 4, **flags})
        s = make_strategy(cfg, group_of_one, torch.float32, transforms_for(cfg, torch.float32))
        s.build(AutoConfig.from_pretrained(model_dir))
        return s

    dora = make(adapter="dora")
    assert adapter_of(dora).warnings() == ["every routed expert stays frozen (only attention and dense layers "
                                             "train): --adapter dora: peft's LoRA on fused expert weights has no "
                                             "DoRA; use --adapter lora to adapt them"]
    assert dora.num_trainable > 0 and dora.num_trainable_experts == 0 and dora.num_expert_params > 0
    dropout = make(adapter="lora", lora_dropout=0.1)
    (warning,) = adapter_of(dropout).warnings()
    assert "--lora-dropout 0.1: peft's LoRA on fused expert weights takes no dropout; use --lora-dropout 0" in warning
    with pytest.raises(UserError, match=r"^--lora-targets gate_up_proj: --adapter dora: peft's LoRA on fused expert "):
        make(adapter="dora", lora_targets="q_proj,gate_up_proj")
    attention = make(adapter="lora", lora_targets="q_proj,v_proj")
    assert adapter_of(attention).warnings() == [
        "every routed expert stays frozen (only attention and dense layers train): --lora-targets q_proj,v_proj names "
        "none of the fused expert weights (down_proj, gate_up_proj); add them to adapt them"]
    only = make(adapter="lora", lora_targets="down_proj")
    assert adapter_of(only).warnings() == [] and set(adapter_of(only).experts) == {
        f"model.layers.{i}.mlp.experts.base_layer.down_proj" for i in range(2)}
    assert only.num_trainable == only.num_trainable_experts > 0
    with pytest.raises(UserError, match=r"its fused expert weights down_proj, gate_up_proj$"):
        make(adapter="lora", lora_targets="gate_proj_x")
    qlora = make(adapter="qlora", strategy="ddp")  # fsdp2 on one rank cannot rebuild NF4 weights
    assert len(adapter_of(qlora).experts) == 4 and adapter_of(qlora).warnings() == [
        "--adapter qlora: the fused expert weights stay in the compute dtype, not NF4 (NF4 holds the linear layers' "
        "weights); their adapters train as LoRA's"]
    assert adapter_of(qlora).warnings() == []  # said once


# ------------------------------------------------------------------------------------------ real runs, 2 ranks

def args(data: Path, root: Path, *extra: object) -> list[str]:
    return ["-e", "r", "-d", str(data), "-m", "local/tiny", "--save-dir", str(root), "--config",
            str(ROOT / "configs" / "demo.yaml"), "--log-freq", "1", "--eval-freq", "0", "--ckpt-freq", "6",
            "--keep-last", "3", "--lr-schedule", "constant", "--max-steps", "18", "-b", "2", "--lora-rank", "4",
            *map(str, extra)]


def train(env: dict, data: Path, root: Path, *extra: object, nproc: int = 2):
    a = args(data, root, *extra)
    proc = run_script("fsdp1.py", *a, env=env["env"]) if nproc == 1 else \
        torchrun(nproc, ROOT / "fsdp1.py", *a, env=env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def adapter_tensors(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "adapter" / "adapter_model.safetensors")


def model_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_trained_as(chained: Path, reference: Path) -> None:
    """A run resumed across world sizes and strategies against the uninterrupted one: every step's loss and the
    adapter it exported, equal up to the reduction order (resharded between legs)."""
    got, expected = losses(chained), losses(reference)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    want, have = adapter_tensors(reference), adapter_tensors(chained)
    for key in want:
        torch.testing.assert_close(have[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.fixture(scope="module")
def lora_run(train_env, tmp_path_factory) -> Path:
    """18 steps of LoRA (rank 4, every linear layer of the blocks) under fsdp2 on 2 ranks, checkpoints every 6."""
    root = tmp_path_factory.mktemp("lora")
    train(train_env, train_env["dataset"], root, "--adapter", "lora", "--strategy", "fsdp2")
    return root / "r"


def test_lora_checkpoints_hold_the_adapter_alone_and_every_rank_s_rows_resume_bitwise(train_env, lora_run, tmp_path):
    metadata = dcp.FileSystemReader(str(lora_run / "checkpoints" / "step-00000006")).read_metadata()
    model_keys = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
    assert model_keys and all(is_adapter_key(k) for k in model_keys)  # no frozen weight in any checkpoint
    assert len(model_keys) == 2 * 2 * len(TARGETS)  # A and B of 7 layers in each of 2 blocks
    # a rerun from step 6 trains 7..18 again: every rank's rows of every adapter must come back (accelerate#4206
    # lost all but rank 0's), so the losses and the adapter trained are those of the uninterrupted run
    shutil.copytree(lora_run, tmp_path / "r")
    again = train(train_env, train_env["dataset"], tmp_path, "--adapter", "lora", "--strategy", "fsdp2",
                  "--resume-from", "step-00000006")
    assert "resumed from" in again.stdout
    assert losses(tmp_path / "r") == losses(lora_run)
    reference, resumed = adapter_tensors(lora_run), adapter_tensors(tmp_path / "r")
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


def test_lora_resumes_on_another_world_size_and_strategy(train_env, lora_run, tmp_path):
    data = train_env["dataset"]
    train(train_env, data, tmp_path, "--adapter", "lora", "--strategy", "fsdp2", "--max-steps", 6)
    train(train_env, data, tmp_path, "--adapter", "lora", "--max-steps", 12, "-b", 4, nproc=1)  # same global batch
    train(train_env, data, tmp_path, "--adapter", "lora", "--strategy", "ddp")
    assert sorted(losses(tmp_path / "r")) == list(range(1, 19))
    assert_trained_as(tmp_path / "r", lora_run)


def test_lora_exports_a_peft_adapter_and_a_merged_model_that_agree(train_env, tiny_models, lora_run, tmp_path):
    from peft import PeftModel

    config = json.loads((lora_run / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["r"], config["peft_type"]) == ("local/tiny", 4, "LORA")
    assert sorted(config["target_modules"]) == TARGETS
    assert (lora_run / "adapter" / "tokenizer.json").exists()
    base = model_tensors(tiny_models["tied"])
    for key, value in adapter_tensors(lora_run).items():  # whole and 2-D (peft#3251: 1-D or empty breaks vLLM)
        module, part = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        out_features, in_features = base[f"{module}.weight"].shape
        assert value.shape == ((4, in_features) if part == "A.weight" else (out_features, 4)), key
    merged = model_tensors(lora_run / "hf")
    assert set(merged) == set(base)
    for key in base:  # only the adapted layers changed
        assert torch.equal(merged[key], base[key]) == (key.rsplit(".", 2)[-2] not in TARGETS), key
    ids = torch.randint(0, 400, (2, 32))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tiny_models["tied"], dtype=torch.float32)
        with_adapter = PeftModel.from_pretrained(plain, lora_run / "adapter")(input_ids=ids).logits
        exported = AutoModelForCausalLM.from_pretrained(lora_run / "hf", dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(with_adapter, exported, rtol=0, atol=1e-5)
    # pipeline.export of the last checkpoint writes the same two folders
    out = torchrun(2, "-m", "pipeline.export", "--checkpoint", lora_run / "checkpoints" / "step-00000018",
                     "--out", tmp_path / "hf", "--adapter-out", tmp_path / "adapter", env=train_env["env"])
    assert out.returncode == 0, out.stderr[-3000:]
    again = model_tensors(tmp_path / "hf")
    assert all(torch.equal(again[k], merged[k]) for k in merged)
    assert all(torch.equal(v, adapter_tensors(lora_run)[k]) for k, v in adapter_tensors(tmp_path).items())


def test_a_rerun_that_changes_the_adapter_is_refused_and_a_target_that_names_nothing_too(train_env, lora_run,
                                                                                            tmp_path):
    shutil.copytree(lora_run, tmp_path / "r")
    changed = run_script("fsdp1.py", *args(train_env["dataset"], tmp_path, "--adapter", "lora", "--lora-rank", 8),
                         env=train_env["env"])
    assert changed.returncode == 2
    assert (f"refusing to resume {tmp_path / 'r'}: adapter was {{'adapter': 'lora', 'lora_rank': 4, 'lora_alpha': "
            "32.0, 'lora_dropout': 0.0, 'lora_targets': ''} and is now {'adapter': 'lora', 'lora_rank': 8, "
            "'lora_alpha': 32.0, 'lora_dropout': 0.0, 'lora_targets': ''}") in changed.stderr
    nothing = run_script("fsdp1.py", *args(train_env["dataset"], tmp_path / "new", "--adapter", "lora",
                                           "--lora-targets", "q_proj,qkv_proj"), env=train_env["env"])
    assert nothing.returncode == 2
    assert ("--lora-targets qkv_proj: no linear layer of LlamaForCausalLM's decoder blocks is named so; its linear "
            f"layers are {', '.join(TARGETS)}") in nothing.stderr


def test_dora_on_conversations_under_ddp_resumes_bitwise_and_exports(train_env, tiny_models, tmp_path):
    from peft import PeftModel

    chats = train_env["chats"]
    train(train_env, chats, tmp_path / "a", "--adapter", "dora", "--strategy", "ddp", "--max-steps", 12)
    shutil.copytree(tmp_path / "a" / "r", tmp_path / "b" / "r")
    shutil.rmtree(tmp_path / "b" / "r" / "hf")
    train(train_env, chats, tmp_path / "b", "--adapter", "dora", "--strategy", "ddp", "--max-steps", 12,
          "--resume-from", "step-00000006", "--merge-export", "off")
    assert losses(tmp_path / "b" / "r") == losses(tmp_path / "a" / "r")
    assert not (tmp_path / "b" / "r" / "hf").exists()  # --merge-export off: the adapter alone
    assert all(torch.equal(v, adapter_tensors(tmp_path / "b" / "r")[k])
               for k, v in adapter_tensors(tmp_path / "a" / "r").items())
    magnitudes = [k for k in adapter_tensors(tmp_path / "a" / "r") if k.endswith("lora_magnitude_vector")]
    assert len(magnitudes) == 2 * len(TARGETS)
    ids = torch.randint(0, 400, (2, 32))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tiny_models["tied"], dtype=torch.float32)
        with_adapter = PeftModel.from_pretrained(plain, tmp_path / "a" / "r" / "adapter")(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "r" / "hf", dtype=torch.float32)
        exported = merged(input_ids=ids).logits
    torch.testing.assert_close(with_adapter, exported, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ QLoRA (NF4 base)

@pytest.fixture(scope="module")
def qlora_model(train_env) -> Path:
    """A tiny Llama wide enough for NF4 over 2 shards (hidden 256: every weight splits into whole blocks per rank),
    in train_env's hub as local/tiny256."""
    from pipeline.prep.hub import import_local
    from pipeline.prep.tiny import build_tiny

    model_dir = build_tiny(train_env["root"] / "tiny256", hidden=256)
    import_local(model_dir, "local/tiny256", "main", train_env["root"] / "hf" / "hub")
    return model_dir


def nf4_reference(model_dir: Path) -> torch.nn.Module:
    """from_pretrained's model with every adapted weight replaced by torchao's NF4 of the whole weight, dequantized:
    the function QLoRA trains on."""
    return nf4.roundtrip(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), TARGETS)


def test_qlora_holds_the_adapted_weights_in_nf4_and_starts_as_their_dequantized_base(group_of_one, qlora_model):
    s = built(qlora_model, group_of_one, "qlora", "ddp")
    quantized = {n for n, p in s.model.named_parameters() if nf4.is_nf4(p)}
    assert len(quantized) == 2 * len(TARGETS)  # every adapted layer's base weight; embedding, head and norms not
    assert {n.split(".")[-3] for n in quantized} == set(TARGETS) and all(n.endswith(".base_layer.weight")
                                                                         for n in quantized)
    trainable = {n for n, p in s.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n.removeprefix("module.")) for n in trainable)
    ids = torch.randint(0, 400, (2, 24))
    with torch.no_grad():
        assert torch.equal(s.model(input_ids=ids).logits, nf4_reference(qlora_model)(input_ids=ids).logits)
    with pytest.raises(UserError, match=r"^--adapter qlora under --strategy fsdp2 needs its weights sharded over 2 "
                                        r"or more ranks \(FSDP2 with one shard does not rebuild torchao's NF4 "
                                        r"weights\); use --strategy ddp or auto$"):
        built(qlora_model, group_of_one, "qlora", "fsdp2")
    assert nf4.layout_problem(torch.Size([64, 64]), 2) == ("its 64 rows do not split into 2 shards of whole blocks "
                                                           "and scale groups (4,096 elements)")
    assert nf4.layout_problem(torch.Size([680, 256]), 2) == ""  # 2,720 blocks: scales in groups of 170


def test_qlora_shards_under_fsdp2_are_the_whole_weight_s_nf4_on_every_rank(qlora_model, tmp_path):
    """Each rank quantizes only its rows, against the mean of every rank's block maxima: the gathered weight is
    then torchao's NF4 of the whole weight on every rank (a per-rank mean would give every rank another model)."""
    out = tmp_path / "losses.jsonl"
    proc = torchrun(2, ROOT / "tests" / "helpers" / "nf4_loss.py", qlora_model, "fsdp2", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert all(r["ours"] == r["theirs"] for r in rows), rows


@pytest.fixture(scope="module")
def qlora_run(train_env, qlora_model, tmp_path_factory) -> Path:
    """12 steps of QLoRA (rank 4) under fsdp2 on 2 ranks, checkpoints every 6."""
    root = tmp_path_factory.mktemp("qlora")
    train(train_env, train_env["dataset"], root, "--adapter", "qlora", "--strategy", "fsdp2", "-m", "local/tiny256",
          "--max-steps", 12)
    return root / "r"


def test_qlora_trains_resumes_bitwise_and_exports_merged_on_the_dequantized_base(train_env, qlora_model, qlora_run,
                                                                                 tmp_path):
    from peft import PeftModel

    run = losses(qlora_run)
    assert run[12] < run[1] - 0.3  # it trains (bitsandbytes under FSDP2 silently did not: accelerate#3983)
    adapter = adapter_tensors(qlora_run)
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)
    metadata = dcp.FileSystemReader(str(qlora_run / "checkpoints" / "step-00000006")).read_metadata()
    model_keys = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
    assert len(model_keys) == 2 * 2 * len(TARGETS) and all(is_adapter_key(k) for k in model_keys)
    shutil.copytree(qlora_run, tmp_path / "r")
    train(train_env, train_env["dataset"], tmp_path, "--adapter", "qlora", "--strategy", "fsdp2", "-m",
          "local/tiny256", "--max-steps", 12, "--resume-from", "step-00000006")
    assert losses(tmp_path / "r") == run
    assert all(torch.equal(v, adapter_tensors(tmp_path / "r")[k]) for k, v in adapter.items())
    # RUN/hf: the adapter merged into the dequantized base, as peft merges it there
    ids = torch.randint(0, 400, (2, 32))
    with torch.no_grad():
        merged_by_peft = PeftModel.from_pretrained(nf4_reference(qlora_model), qlora_run / "adapter")
        expected = merged_by_peft(input_ids=ids).logits
        exported = AutoModelForCausalLM.from_pretrained(qlora_run / "hf", dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(exported, expected, rtol=0, atol=1e-5)
    # pipeline.export in one process (ddp: fsdp2 cannot hold NF4 on one rank) writes the same
    out = torchrun(1, "-m", "pipeline.export", "--checkpoint", qlora_run / "checkpoints" / "step-00000012", "--out",
                   tmp_path / "hf", "--adapter-out", tmp_path / "adapter", env=train_env["env"])
    assert out.returncode == 0, out.stderr[-3000:]
    merged, again = model_tensors(qlora_run / "hf"), model_tensors(tmp_path / "hf")
    for key in merged:
        torch.testing.assert_close(again[key], merged[key], rtol=0, atol=1e-6, msg=key)


def test_qlora_resumes_on_another_world_size_and_strategy(train_env, qlora_run, tmp_path):
    """2 ranks under fsdp2 -> 1 under ddp -> 2 under ddp, the global batch kept: the checkpoints hold the adapter
    alone, and every layout of the NF4 base is the NF4 of the whole weight, so the losses are the one run's."""
    data, qlora = train_env["dataset"], ("--adapter", "qlora", "-m", "local/tiny256")
    train(train_env, data, tmp_path, *qlora, "--strategy", "fsdp2", "--max-steps", 6)
    train(train_env, data, tmp_path, *qlora, "--strategy", "ddp", "--max-steps", 9, "-b", 4, nproc=1)
    train(train_env, data, tmp_path, *qlora, "--strategy", "ddp", "--max-steps", 12)
    assert [e["from_step"] for e in events(tmp_path / "r", "resume")] == [6, 9]  # each leg resumed, none restarted
    assert sorted(losses(tmp_path / "r")) == list(range(1, 13))
    assert_trained_as(tmp_path / "r", qlora_run)


def test_evaluate_scores_an_adapter_folder_as_its_run_did(train_env, lora_run, tmp_path):
    from test_evaluate import evaluate

    config = ["--config", lora_run / "config.yaml", "--save-dir", lora_run.parent]
    evals = {e["step"]: e["loss"] for e in events(lora_run, "eval")}
    assert sorted(evals) == [0, 18]  # the base at step 0 (B = 0: the adapter starts as the base), then the end
    adapter = evaluate(train_env["env"], lora_run / "adapter", *config)  # its base from adapter_config.json
    base = evaluate(train_env["env"], "local/tiny", *config)
    assert adapter["base_model"] == "local/tiny" and adapter["adapter"] == str(lora_run / "adapter")
    assert adapter["loss"] == pytest.approx(evals[18], abs=1e-5) and base["loss"] == pytest.approx(evals[0], abs=1e-5)
    assert set(adapter["fingerprint"]) - set(base["fingerprint"]) == {"adapter"}


def test_an_adapter_run_and_its_folder_are_bound_to_the_base_they_were_trained_on(train_env, lora_run, tmp_path):
    """local/tiny replaced by another model of the same config and tokenizer: the rerun, pipeline.export, chat and
    evaluate refuse in one line, naming both bases; a base folder that moved away is named as such."""
    import json as json_mod

    from conftest import preflight_errors, run_evaluate, run_module

    from pipeline.ownership import read_mark
    from pipeline.prep.hub import import_local
    from pipeline.prep.tiny import build_tiny

    recorded = read_mark(lora_run / "adapter")
    assert (recorded["kind"], recorded["base_model"], recorded["trained_on"]) == ("export", "local/tiny", "text")
    other = build_tiny(tmp_path / "other", seed=1)  # the same tokenizer and config, other weights
    import_local(other, "local/tiny", "main", tmp_path / "hf" / "hub")
    env = {**train_env["env"], "HF_HOME": str(tmp_path / "hf")}
    shutil.copytree(lora_run, tmp_path / "r")
    (rerun,) = preflight_errors([args(train_env["dataset"], tmp_path, "--adapter", "lora", "--strategy", "fsdp2")],
                                env)
    assert rerun.startswith(f"refusing to resume {tmp_path / 'r'}: its adapters were trained on base model local/tiny "
                            f"with weights {recorded['base_weights'][:16]}..., and the weights there now are ")
    assert rerun.endswith("(another model, or changed ones); restore the base it was trained on, or pass --no-resume "
                          "to train new adapters on this one")
    refusal = f"the weights now at {tmp_path / 'hf' / 'hub'}/models--local--tiny/snapshots/"
    adapter = tmp_path / "r" / "adapter"
    procs = {
        "chat": run_module("pipeline.chat", adapter, "--prompt", "hi", env=env),
        "evaluate": run_evaluate(env, adapter, "-d", train_env["dataset"]),
        "export": run_module("pipeline.export", "--checkpoint", tmp_path / "r" / "checkpoints" / "step-00000018",
                             "--out", tmp_path / "x", env=env),
    }
    who = {"chat": f"the adapter {adapter}", "evaluate": f"the adapter {adapter}",
           "export": f"--checkpoint {tmp_path / 'r' / 'checkpoints' / 'step-00000018'}"}
    for name, proc in procs.items():
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        line = proc.stderr.splitlines()[-1]
        assert line.startswith(f"error: {who[name]} was trained on base model local/tiny with weights "
                               f"{recorded['base_weights'][:16]}..., but {refusal}"), (name, line)
    assert not (tmp_path / "x").exists()
    # another base given by name: the line names the base the adapter was trained on, and the one given
    import_local(other, "local/other", "main", tmp_path / "hf" / "hub")
    given = run_evaluate(env, "local/other", "--adapter", adapter, "-d", train_env["dataset"])
    assert given.returncode == 2, given.stderr[-2000:]
    assert given.stderr.splitlines()[-1].startswith(
        f"error: the adapter {adapter} was trained on base model local/tiny with weights "
        f"{recorded['base_weights'][:16]}..., but local/other's weights, at {tmp_path / 'hf' / 'hub'}/models--local--"
        "other/snapshots/")
    config = json_mod.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json_mod.dumps({**config, "base_model_name_or_path":
                                                                 str(tmp_path / "moved")}))
    moved = run_module("pipeline.chat", adapter, "--prompt", "hi", env=env)
    assert (moved.returncode, moved.stderr.splitlines()[-1]) == (2, (
        f"error: the base model folder {tmp_path / 'moved'} that {adapter / 'adapter_config.json'} names does not "
        "exist (moved or deleted): put it back, or set base_model_name_or_path there to where it is now"))
