"""Model families: tiny models of each family the README lists (pipeline/prep/tiny.FAMILIES), saved as save_pretrained
saves them, through import, training on two ranks, resume, and export; the naming rules, attention kernels and
parameter counts they need. (tests/test_build.py compares every family's buffers and first loss with transformers'
own under every strategy.)"""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, events, losses, run_script, torchrun
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config import ModelConfig
from pipeline.errors import UserError
from pipeline.model.modeling import TESTED_MODEL_TYPES, meta_model, param_counts, untested_family
from pipeline.model.naming import WeightNames
from pipeline.model.weight_files import read_header, read_index
from pipeline.model.weights import read_tensor
from pipeline.objectives.causal_lm import CausalLMLoss
from pipeline.prep.hub import import_local, verify
from pipeline.prep.tiny import FAMILIES, build_family, family_config
from pipeline.strategies.memory import Shape
from pipeline.strategies.registry import make_strategy

MECHANISMS = ("gemma2", "gemma3", "mixtral", "qwen3-moe")
"""The families with something of their own for the trainer to get right (eager attention and soft-capping, a scaled
embedding, per-expert tensors): every strategy question is asked of them on two ranks; the others train once."""
SHARDED = {"gemma4": "fsdp2", "llama4": "fsdp2", "qwen3_5": "fsdp2", "deepseek_v3": "fsdp2"}
"""The families of 2026 with a mechanism of their own (per-layer head sizes and a per-layer embedding, decoder layers
a base_model_prefix does not find, linear attention's 3-D convolution, MLA and a router's persistent bias) trained
once on two ranks under fsdp2; every family, these included, is also checked in one process under every strategy
(tests/test_build.py: its first loss, every buffer, and its export after a step)."""


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family(root / family, family) for family in FAMILIES}


def header_names(folder: Path) -> set[str]:
    return {name for path in folder.glob("*.safetensors") for name in read_header(path)}


def test_the_tested_model_types_are_the_families_the_suite_builds():
    assert set(TESTED_MODEL_TYPES) == {family_config(f, 1024, 0, 1).model_type for f in FAMILIES}
    assert untested_family(family_config("mixtral", 1024, 0, 1)) == ""
    config = AutoConfig.for_model("olmo", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2)
    assert untested_family(config).startswith("model_type 'olmo' is not one of the families the suite trains (llama,")


def test_transformers_conversion_rules_are_still_where_naming_reads_them():
    """naming.py is the one reader of transformers' conversion rules (not in its documented API)."""
    from transformers import conversion_mapping, core_model_loading

    assert callable(conversion_mapping.get_model_conversion_mapping)
    for name in ("WeightConverter", "WeightRenaming", "MergeModulelist", "Concatenate", "rename_source_key",
                 "revert_weight_conversion", "dot_natural_key"):
        assert hasattr(core_model_loading, name), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_imports_and_verifies(family, families, tmp_path):
    """MODEL_DOWNLOAD's check on the meta device: every model tensor found under the file's names (per-expert
    tensors joined by transformers' rules), none of the file's left over."""
    report = verify(families[family])
    assert report.unexpected == []
    assert report.num_params == param_counts(meta_model(report.config))[0]
    snapshot = import_local(families[family], f"local/{family}", "main", tmp_path / "hub")
    assert verify(snapshot).model_class == report.model_class


def test_moe_checkpoints_name_experts_one_by_one_and_a_rank_reads_only_its_experts(families):
    folder = families["mixtral"]
    names = header_names(folder)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    model = meta_model(AutoConfig.from_pretrained(folder))
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    source = WeightNames(model).sources(read_index(folder), ["model.layers.0.mlp.experts.gate_up_proj"],
                                        folder)["model.layers.0.mlp.experts.gate_up_proj"]
    read = []

    def reading(entry):
        read.append(entry.start)
        return torch.zeros(entry.shape)

    assert list(source.assemble(reading, model.config, (2, 4)).shape) == [2, 256, 64]
    starts = {e.start: (pattern, i) for pattern, entries in source.parts.items() for i, e in enumerate(entries)}
    assert sorted(starts[s][1] for s in read) == [2, 2, 3, 3]  # w1 and w3 of experts 2 and 3 only
    rows = source.assemble(read_tensor, model.config)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert torch.equal(rows, reference.model.layers[0].mlp.experts.gate_up_proj.detach())


def test_a_naming_mismatch_names_both_sides(families, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "renamed"
    folder.mkdir()
    for f in families["mixtral"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    save_file({k.replace("block_sparse_moe", "moe_block"): v for k, v in tensors.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError) as err:
        verify(folder)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("tensor model.layers.0.mlp.gate.weight of the model is not in the weights in ")
    assert "which hold 26 tensors under names the model does not use (e.g. model.layers.0.moe_block.experts.0.w2" \
           ".weight): a naming mismatch that transformers' conversion rules for model_type mixtral do not cover" \
           in message


def test_attention_kernel_auto_is_transformers_default_and_a_refused_one_is_one_line():
    gemma2, llama = family_config("gemma2", 1024, 0, 1), family_config("llama", 1024, 0, 1)
    assert meta_model(gemma2).config._attn_implementation == "eager"  # soft-capped scores: no sdpa in transformers
    assert meta_model(llama).config._attn_implementation == "sdpa"
    assert meta_model(llama, attn_implementation="eager").config._attn_implementation == "eager"
    with pytest.raises(UserError, match=r"^--attn-implementation sdpa: Gemma2ForCausalLM refuses it \("
                                        r"Gemma2ForCausalLM does not support an attention implementation through "
                                        r"torch\.nn\.functional\.scaled_dot_product_attention yet\); it accepts "
                                        r"eager, flex_attention, flash_attention_2$"):
        meta_model(gemma2, attn_implementation="sdpa")
    assert gemma2._attn_implementation is None  # the refused kernel is not left on the user's config


def test_eager_and_sdpa_train_the_same_loss_and_keep_packed_documents_apart(families, group_of_one):
    """The kernel changes how attention is computed, not what: the first loss is the same to 1e-5, for plain rows
    and for rows packing two documents (position ids restarting mid-row), where both see the documents apart."""
    from pipeline.data import packing
    from pipeline.data.batches import make_batch

    ids = np.random.default_rng(0).integers(0, 1024, size=(2, 32))
    flags = np.full(ids.shape, packing.TRAIN)
    flags[:, [0, 20]] |= packing.START
    got = {}
    for kernel in ("eager", "sdpa"):
        cfg = ModelConfig(model_name=str(families["llama"]), precision="fp32", strategy="ddp", sharding="NO_SHARD",
                          attn_implementation=kernel)
        strategy = make_strategy(cfg, group_of_one, torch.float32)
        strategy.build(AutoConfig.from_pretrained(families["llama"]))
        strategy.load_weights(families["llama"])
        with torch.no_grad():
            for packed in (False, True):
                batch = make_batch(ids, flags if packed else None, group_of_one.device)
                targets = int((batch.labels[:, 1:] != -100).sum())
                got[kernel, packed] = CausalLMLoss(strategy.head())(batch, targets).item()
            row, pos = torch.tensor(ids[:1]), torch.tensor(packing.positions(flags[:1]))
            second = strategy.module(input_ids=row, position_ids=pos, use_cache=False).logits[0, 20:]  # as trained
            alone = strategy.module(input_ids=row[:, 20:]).logits[0]
        torch.testing.assert_close(second, alone, rtol=0, atol=1e-5)  # the second document does not see the first
    assert got["eager", False] == pytest.approx(got["sdpa", False], abs=1e-5)
    assert got["eager", True] == pytest.approx(got["sdpa", True], abs=1e-5)


def test_moe_counts_the_experts_a_token_is_routed_to():
    """MFU's FLOPs and the memory estimate: every expert is held, 2 of 4 compute per token."""
    config = family_config("mixtral", 1024, 0, 1)
    total, active = param_counts(meta_model(config))
    experts = 2 * 4 * 3 * 64 * 128  # layers x experts x (w1, w2, w3) x hidden x intermediate
    assert total == Shape.of(config).num_params == 353_088
    assert active == total - 1024 * 64 - experts // 2
    assert Shape.of(config).intermediate == 2 * 128


# ---- on two ranks, through the user's commands


def train_args(env: dict, root: Path, model: str, *extra: object, dataset: str = "dataset") -> list[str]:
    """fsdp1.py's arguments for a short run of model logging every step, a checkpoint every 2."""
    return [str(a) for a in ("-d", env[dataset], "-m", model, "--save-dir", root, "--config",
                             ROOT / "configs" / "demo.yaml", "--log-freq", "1", "--eval-freq", "0", "--ckpt-freq", "2",
                             "--lr-schedule", "constant", "--warmup-steps", "0", *extra)]


def train(env: dict, root: Path, model: str, *extra: object, dataset: str = "dataset", nproc: int = 2):
    args = train_args(env, root, model, *extra, dataset=dataset)
    proc = torchrun(nproc, ROOT / "fsdp1.py", *args, env=env["env"]) if nproc > 1 else \
        run_script("fsdp1.py", *args, env=env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def family_env(train_env, families, tmp_path_factory) -> dict:
    """train_env's datasets with every family imported into its own HF_HOME as local/FAMILY."""
    hf = tmp_path_factory.mktemp("family_hf")
    for family, folder in families.items():
        import_local(folder, f"local/{family}", "main", hf / "hub")
    return {**train_env, "env": {**train_env["env"], "HF_HOME": str(hf)}}


def checkpoint_logits(checkpoint: Path, model_dir: Path, d, adapter: dict | None = None) -> torch.Tensor:
    """Logits of a training checkpoint's model (loaded as pipeline.export loads it) for fixed inputs."""
    from pipeline.train.checkpoint import checkpoint_model

    strategy = checkpoint_model(checkpoint, model_dir, d, adapter)
    with torch.no_grad():
        return strategy.model(input_ids=torch.arange(64).reshape(2, 32)).logits


def exported_logits(folder: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=torch.arange(64).reshape(2, 32)).logits


def validation_loss(run: Path, folder: Path) -> float:
    """The model in folder's own loss (transformers' forward) on the validation blocks the run held out."""
    (cache,) = (p for p in (run.parent / "token_cache").iterdir() if p.is_dir())
    blocks = torch.from_numpy(np.load(cache / "val.npy").astype(np.int64))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():  # every block has seq - 1 targets: the mean of the blocks' means is the mean over tokens
        return float(np.mean([model(input_ids=b[None], labels=b[None]).loss.item() for b in blocks]))


@pytest.mark.parametrize("family", MECHANISMS)
def test_family_resumes_bitwise_exports_what_it_trained_and_ddp_agrees(family, family_env, families, tmp_path,
                                                                       group_of_one):
    """fsdp2 rerun from its step-2 checkpoint gives the uninterrupted run's losses to step 4 bit for bit
    (tests/test_resume.py kills runs for real); ddp's agree to 1e-5; the export, in save_pretrained's layout,
    computes the checkpoint's logits, and its own loss on the validation blocks is the trainer's last one."""
    model = f"local/{family}"
    train(family_env, tmp_path, model, "-e", "r", "--max-steps", "4")
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "r", again / "r")
    resumed = train(family_env, again, model, "-e", "r", "--max-steps", "4", "--resume-from", "step-00000002")
    assert "resumed from" in resumed.stderr + resumed.stdout
    train(family_env, tmp_path, model, "-e", "ddp", "--max-steps", "4", "--strategy", "ddp")
    run, ref, ddp = (losses(root / name) for root, name in ((again, "r"), (tmp_path, "r"), (tmp_path, "ddp")))
    assert run == ref and sorted(run) == [1, 2, 3, 4]
    assert [e["step"] for e in events(again / "r", "train")] == [1, 2, 3, 4, 3, 4]  # 3 and 4 trained again
    assert ddp == pytest.approx(ref, abs=1e-5)
    assert header_names(again / "r" / "hf") == header_names(families[family])
    torch.testing.assert_close(exported_logits(again / "r" / "hf"),
                               checkpoint_logits(again / "r" / "checkpoints" / "step-00000004", families[family],
                                                 group_of_one), rtol=0, atol=0)
    final = events(tmp_path / "r", "eval")[-1]
    assert final["step"] == 4
    assert validation_loss(tmp_path / "r", tmp_path / "r" / "hf") == pytest.approx(final["loss"], abs=1e-5)


def test_lora_on_a_moe_trains_its_experts_on_two_ranks_resumes_on_one_and_exports_what_peft_loads(
        family_env, families, tmp_path, group_of_one):
    """qwen3-moe with LoRA under fsdp2 on 2 ranks (expert parallelism: each holding half of the experts, adding its
    experts' slices of the adapter to them): the start line counts the experts' adapters among the trainable
    parameters; resumed from step 2 in one process under ddp, the uninterrupted run's losses; peft's own model with
    the exported adapter computes the checkpoint's logits, and so does the merged export."""
    from peft import PeftModel
    from safetensors.torch import load_file

    lora = ("--adapter", "lora", "--lora-rank", "4", "--merge-export", "on")
    model = "local/qwen3-moe"
    first = train(family_env, tmp_path, model, "-e", "r", "--max-steps", "4", "--strategy", "fsdp2", "-b", "2", *lora)
    adapter = load_file(tmp_path / "r" / "adapter" / "adapter_model.safetensors")
    in_experts = sum(v.numel() for k, v in adapter.items() if ".experts." in k)
    total = sum(v.numel() for v in adapter.values())
    assert in_experts and f"({total:,} trainable, of which {in_experts:,} in experts)" in first.stdout + first.stderr
    # --expert-parallel auto, the default: the experts and their adapters split over the 2 ranks
    assert "expert parallelism: 4 experts per layer over 2 ranks (2 each)" in first.stdout + first.stderr
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "r", again / "r")
    train(family_env, again, model, "-e", "r", "--max-steps", "4", "--strategy", "ddp", "-b", "4", "--resume-from",
          "step-00000002", *lora, nproc=1)  # the same global batch
    run, ref = losses(again / "r"), losses(tmp_path / "r")
    assert sorted(run) == sorted(ref) == [1, 2, 3, 4]
    assert run == pytest.approx(ref, rel=1e-5)
    expected = checkpoint_logits(tmp_path / "r" / "checkpoints" / "step-00000004", families["qwen3-moe"],
                                 group_of_one, {"adapter": "lora", "lora_rank": 4, "lora_alpha": 32.0})
    base = AutoModelForCausalLM.from_pretrained(families["qwen3-moe"], dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=torch.arange(64).reshape(2, 32)).logits
        peft_model = PeftModel.from_pretrained(base, tmp_path / "r" / "adapter")
        theirs = peft_model(input_ids=torch.arange(64).reshape(2, 32)).logits
    assert (expected - plain).abs().max() > 1e-4  # it trained
    torch.testing.assert_close(theirs, expected, rtol=0, atol=2e-5)
    torch.testing.assert_close(exported_logits(tmp_path / "r" / "hf"), expected, rtol=0, atol=2e-5)


TWO_RANK = ["mistral", "qwen2", "qwen3", "phi3", *SHARDED]
"""The dense families before 2026 (under auto's choice of strategy) and the 2026 ones with a mechanism of their own."""


@pytest.mark.parametrize("family", TWO_RANK)
def test_family_trains_on_two_ranks_and_exports_what_it_trained(family, family_env, families, tmp_path,
                                                                group_of_one):
    """A family whose forward is Llama's in its parts (the suite's Llama runs cover resume for them), and each 2026
    family with a mechanism of its own under fsdp2, fine-tuned on conversations through the chat template their
    tokenizer carries."""
    strategy = ("--strategy", SHARDED[family]) if family in SHARDED else ()
    train(family_env, tmp_path, f"local/{family}", "-e", "r", "--max-steps", "2", *strategy, dataset="chats")
    assert "conversations: " in (tmp_path / "r" / "train.log").read_text()
    assert sorted(losses(tmp_path / "r")) == [1, 2]
    assert header_names(tmp_path / "r" / "hf") == header_names(families[family])
    torch.testing.assert_close(exported_logits(tmp_path / "r" / "hf"),
                               checkpoint_logits(tmp_path / "r" / "checkpoints" / "step-00000002", families[family],
                                                 group_of_one), rtol=0, atol=0)


def test_an_export_index_lists_every_tensor_once(families, tmp_path):
    from pipeline.train.export import write_index

    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "model-00001-of-00001.safetensors").write_bytes((families["qwen3"] / "model.safetensors").read_bytes())
    write_index(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == header_names(families["qwen3"])
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    with open(folder / "model-00001-of-00001.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert index["metadata"]["total_size"] == (folder / "model-00001-of-00001.safetensors").stat().st_size - 8 - n


def test_the_report_names_moe_routing_and_an_untested_family():
    from pipeline.prep.hub import family_lines

    assert family_lines(family_config("qwen3-moe", 1024, 0, 1)) == [
        "mixture of experts: 4 experts, 2 per token (every expert is held; activations, and MFU in training, count "
        "those a token is routed to)"]
    assert family_lines(family_config("llama", 1024, 0, 1)) == []
    assert family_lines(family_config("gemma4", 1024, 0, 1)) == [
        "layers differ in head_dim: every figure is counted layer by layer"]
    assert family_lines(family_config("deepseek_v3", 1024, 0, 1))[0].startswith(
        "mixture of experts: 4 experts, 2 per token")
    olmo = AutoConfig.for_model("olmo", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2)
    assert family_lines(olmo) == [f"warning: {untested_family(olmo)}; fsdp1.py attempts it"]


def test_a_causal_lm_with_a_loss_of_its_own_is_refused_before_training(train_env, tmp_path):
    """BartForCausalLM's forward takes the mean over unshifted labels, ignoring num_items_in_batch: it trained to copy
    its input with a loss twice transformers' own on two ranks, exit 0 (bench/all_families.py found it and 18 more
    over transformers' registry). Refused in one line before any weight is read; MODEL_DOWNLOAD's report says so."""
    from conftest import run_script

    from pipeline.model.modeling import own_loss
    from pipeline.prep.hub import family_lines

    bart = AutoConfig.for_model("bart", vocab_size=64, d_model=32, decoder_layers=1, encoder_layers=1,
                                decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=64,
                                encoder_ffn_dim=64)
    why = ("BartForCausalLM's forward does not compute transformers' causal-LM loss (loss_function: labels shifted "
           "by one, summed over num_items_in_batch), so the trainer would train it wrong; fine-tune a decoder-only "
           "causal LM instead")
    assert own_loss(bart) == why and own_loss(family_config("llama", 64, 0, 1)) == ""
    assert family_lines(bart) == [f"warning: fsdp1.py refuses it: {why}"]
    AutoModelForCausalLM.from_config(bart).save_pretrained(tmp_path / "bart")
    proc = run_script("fsdp1.py", "-e", "r", "-d", train_env["dataset"], "-m", tmp_path / "bart", "--save-dir",
                      tmp_path / "runs", env=train_env["env"])
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: --model-name {tmp_path / 'bart'}: {why}", \
        proc.stderr[-3000:]
    assert not (tmp_path / "runs").exists()


def test_an_encoder_as_a_causal_lm_is_refused_unless_its_config_says_is_decoder():
    """ELECTRA and RemBERT trained with exit 0 while attending to the tokens they predict (bench/all_families.py):
    every causal-LM class of transformers' registry whose __init__ checks is_decoder is refused from its defaults,
    and the advice holds: with is_decoder set, a tiny ELECTRA's earlier logits ignore a changed later token."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pipeline.model.modeling import attends_ahead, cannot_train
    from pipeline.prep.hub import family_lines

    def refused_by_default(model_type: str) -> bool:
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 (a family whose defaults transformers itself rejects: nothing to train)
            return False
        return bool(attends_ahead(config))

    refused = sorted(filter(refused_by_default, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    assert refused == ["bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                       "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
                       "xlm-roberta", "xlm-roberta-xl", "xmod"]
    electra = AutoConfig.for_model("electra", vocab_size=64, embedding_size=32, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2)
    why = ("ElectraForCausalLM attends to later tokens unless its config sets is_decoder (false here), so next-token "
           'training would teach it to read the answer; set "is_decoder": true in its config.json')
    assert cannot_train(electra) == why and family_lines(electra) == [f"warning: fsdp1.py refuses it: {why}"]
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    later = ids.clone()
    later[0, 6:] = (later[0, 6:] + 1) % 64
    moved = {}
    for is_decoder in (False, True):
        electra.is_decoder = is_decoder
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(electra).eval()
        with torch.no_grad():
            moved[is_decoder] = (model(later).logits - model(ids).logits)[0, :6].abs().max().item()
    assert attends_ahead(electra) == "" and moved[True] == 0.0 < 1e-5 < moved[False]


def test_an_untested_family_trains_without_the_vocabulary_parallel_head_under_auto(group_of_one):
    """Its loss is then the model's own forward: nothing the suite has not checked stands between them."""
    olmo = AutoConfig.for_model("olmo", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2)
    llama = family_config("llama", 64, 0, 1)
    built = {}
    for name, config in (("olmo", olmo), ("llama", llama)):
        strategy = make_strategy(ModelConfig(model_name="x", precision="fp32", strategy="fsdp2",
                                             sharding="FULL_SHARD"), group_of_one, torch.float32)
        strategy.build(config)
        built[name] = strategy.vocab_parallel
    assert built == {"olmo": False, "llama": True}
