"""Expert parallelism (--expert-parallel, pipeline/strategies/expert_parallel.py): a mixture of experts' routed experts
split by expert over fsdp2's ranks, tokens sent to them by all-to-all. Proven against one process (the same global
batch, fp32): every step's loss and gradient norm within 1e-5, the exports equal to fp32 rounding, and a run resumed
at another degree and on one process. The families of pipeline.tiny here; every MoE family of the installed
transformers in bench/moe_families.py."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import losses
from safetensors.torch import load_file
from test_families import train, train_args
from transformers import AutoConfig, AutoTokenizer

from pipeline.config_merge import from_flat
from pipeline.errors import UserError
from pipeline.model.modeling import meta_model
from pipeline.prep.tiny import family_config, save_random
from pipeline.strategies.expert_parallel import auto_off, degree
from pipeline.strategies.registry import settle


def norms(run: Path) -> dict[int, float]:
    events = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {e["step"]: e["grad_norm"] for e in events if e.get("event") == "train"}


def exported(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted((run / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_run(got: Path, expected: Path, *, norm: bool = True) -> None:
    a, b = losses(got), losses(expected)
    assert sorted(a) == sorted(b) and a == pytest.approx(b, rel=1e-5, abs=1e-6)
    if norm:
        assert norms(got) == pytest.approx(norms(expected), rel=1e-5)


def config(**flags) -> object:
    return from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": "m", **flags})


@pytest.fixture(scope="module")
def family_env(train_env, tmp_path_factory) -> dict:
    """train_env with tiny qwen3-moe and mixtral models imported as local/qwen3-moe and local/mixtral."""
    from pipeline.prep.hub import import_local
    from pipeline.prep.tiny import build_family

    root = tmp_path_factory.mktemp("moe")
    for family in ("qwen3-moe", "mixtral"):
        import_local(build_family(root / family, family), f"local/{family}", "main", root / "hf" / "hub")
    # hidden 256, heads of 64: every attention weight splits into whole NF4 scale groups over 2 shards (QLoRA, fsdp2)
    tokenizer = AutoTokenizer.from_pretrained(root / "qwen3-moe")
    wide = family_config("qwen3-moe", len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    wide.hidden_size, wide.head_dim = 256, 64
    import_local(save_random(root / "wide", wide, tokenizer, 0), "local/qwen3-moe-256", "main", root / "hf" / "hub")
    return {**train_env, "env": {**train_env["env"], "HF_HOME": str(root / "hf")}}


def test_what_expert_parallelism_cannot_take_is_one_line_before_any_work():
    for flags, message in [
        ({"strategy": "ddp"}, "--expert-parallel 2 needs --strategy fsdp2 (the experts are split over its mesh), got "
                              "--strategy ddp"),
        ({"strategy": "fsdp2", "sharding": "NO_SHARD"}, "--expert-parallel 2 needs --sharding FULL_SHARD, "
                                                        "SHARD_GRAD_OP or HYBRID_SHARD (the experts are split over the "
                                                        "ranks FSDP shards over; NO_SHARD has none)"),
        ({"strategy": "fsdp2", "cpu_offload": True}, "--expert-parallel 2 cannot be combined with --cpu-offload"),
    ]:
        with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            settle(config(expert_parallel="2", **flags))
    for bad in ("two", "0", "-2", "²", "1.5"):
        with pytest.raises(UserError, match=r"^--expert-parallel must be a number of ranks \(1: off\) or auto, got "):
            config(expert_parallel=bad)
    moe = family_config("qwen3-moe", 512, 0, 1)  # 4 experts
    m = settle(config(strategy="fsdp2", expert_parallel="2")).model
    assert degree(m, moe, 2, 2) == 2
    with pytest.raises(UserError, match=r"^--expert-parallel 2: the experts are split over the ranks FSDP shards "
                                        r"over, 4 here \(--sharding FULL_SHARD\); use --expert-parallel 4 or auto$"):
        degree(m, moe, 4, 4)
    with pytest.raises(UserError, match=r"^--expert-parallel 3 does not divide the 4 experts of each layer of "
                                        r"qwen3_moe; use a degree that does, or 1$"):
        degree(settle(config(strategy="fsdp2", expert_parallel="3")).model, moe, 3, 3)
    with pytest.raises(UserError, match=r"^--expert-parallel 2: llama is not a mixture of experts$"):
        degree(m, family_config("llama", 512, 0, 1), 2, 2)
    llama4 = family_config("llama4", 512, 0, 1)
    with pytest.raises(UserError, match=r"^--expert-parallel 2: Llama4TextExperts \(layers.1.feed_forward.experts\) "
                                        r"takes no routing indices \(its experts run on every token\)"):
        degree(m, llama4, 2, 2, meta_model(llama4))
    auto = settle(config(strategy="fsdp2", expert_parallel="auto")).model
    assert [degree(auto, moe, 2, 2), degree(auto, moe, 4, 2), degree(auto, moe, 3, 3), degree(auto, llama4, 2, 2),
            degree(auto, family_config("llama", 512, 0, 1), 2, 2)] == [2, 1, 1, 1, 1]
    olmoe = AutoConfig.for_model("olmoe", vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=4, num_experts=4, num_experts_per_tok=2)
    assert degree(auto, olmoe, 2, 2) == 1 and degree(m, olmoe, 2, 2) == 2  # auto: the suite's families only
    assert auto_off(auto, olmoe, 2, 2).startswith("model_type 'olmoe' is not one of the families the suite trains")
    assert auto_off(auto, moe, 3, 3) == "3 shard rank(s) do not split the 4 experts of each layer"
    assert auto_off(auto, moe, 2, 1) == ("the 2 shard ranks span nodes (all-to-all would cross them; --sharding "
                                         "HYBRID_SHARD splits the experts within each node)")
    for adapter in ("lora", "dora", "qlora"):
        assert degree(settle(config(strategy="fsdp2", expert_parallel="auto", adapter=adapter)).model, moe, 2, 2) == 2
    hybrid = settle(config(strategy="fsdp2", expert_parallel="auto", sharding="HYBRID_SHARD")).model
    assert degree(hybrid, moe, 2, 2) == 2  # the shard ranks of a node, whatever the nodes
    assert auto_off(settle(config(strategy="fsdp2", expert_parallel="auto", sharding="NO_SHARD")).model, moe, 1, 2) \
        == "--sharding NO_SHARD"


def test_qwen3_moe_with_expert_parallelism_trains_as_one_process_and_resumes_at_another_degree(family_env, tmp_path):
    """2 ranks, each holding 2 of every layer's 4 experts, against one process holding all 4 (the same 4 blocks a
    step), and against fsdp2 gathering every expert on the same 2 ranks: the losses, gradient norms and exports
    agree; killed after step 2's checkpoint, rerun at --expert-parallel
    1 on the same 2 ranks and on one process, the uninterrupted run's losses."""
    common = ("--max-steps", "4", "--strategy", "fsdp2", "--precision", "fp32")
    proc = train(family_env, tmp_path, "local/qwen3-moe", "-e", "ep", *common, "--expert-parallel", "2", "-b", "2")
    assert "expert parallelism: 4 experts per layer over 2 ranks (2 each)" in proc.stdout + proc.stderr
    train(family_env, tmp_path, "local/qwen3-moe", "-e", "one", *common, "-b", "4", nproc=1)
    train(family_env, tmp_path, "local/qwen3-moe", "-e", "fsdp", *common, "-b", "2", "--expert-parallel", "1")
    assert_same_run(tmp_path / "ep", tmp_path / "one")
    assert_same_run(tmp_path / "ep", tmp_path / "fsdp")
    ours, one, gathered = exported(tmp_path / "ep"), exported(tmp_path / "one"), exported(tmp_path / "fsdp")
    assert ours.keys() == one.keys() == gathered.keys() and any(".experts.3." in k for k in ours)  # one per expert
    for key in ours:
        # 4 AdamW steps (lr 3e-3) magnify the reduction order's rounding of tiny gradients: measured at most 1.7e-6
        # against fsdp2 gathering the experts on the same ranks, 2.8e-6 against one process (lm_head, experts)
        torch.testing.assert_close(ours[key], gathered[key], rtol=0, atol=1e-5, msg=key)
        torch.testing.assert_close(ours[key], one[key], rtol=0, atol=1e-5, msg=key)
    for name, extra, nproc in (("off", ("--expert-parallel", "1", "-b", "2"), 2), ("single", ("-b", "4"), 1)):
        shutil.copytree(tmp_path / "ep", tmp_path / name / "ep")
        train(family_env, tmp_path / name, "local/qwen3-moe", "-e", "ep", *common, *extra, "--resume-from",
              "step-00000002", nproc=nproc)
        assert_same_run(tmp_path / name / "ep", tmp_path / "ep", norm=False)


def test_mixtral_with_averaged_gradients_and_checkpointing_trains_as_one_process(family_env, tmp_path):
    """The model's own loss (vocabulary-parallel head off: FSDP averages gradients, so the experts' are divided by
    the world size too) and whole-layer checkpointing (each layer's all-to-alls run again in the backward)."""
    common = ("--max-steps", "2", "--strategy", "fsdp2", "--precision", "fp32", "--vocab-parallel", "off",
              "--activation-checkpointing")
    train(family_env, tmp_path, "local/mixtral", "-e", "ep", *common, "--expert-parallel", "2", "-b", "2")
    train(family_env, tmp_path, "local/mixtral", "-e", "one", *common, "-b", "4", nproc=1)
    assert_same_run(tmp_path / "ep", tmp_path / "one")


def test_every_tiny_moe_family_but_llama4_is_split_under_auto():
    """What auto splits: every MoE family of pipeline.tiny whose experts take routing indices."""
    auto = settle(config(strategy="fsdp2", expert_parallel="auto")).model
    split = [f for f in ("mixtral", "qwen3-moe", "qwen3_5_moe", "deepseek_v3", "glm4_moe", "llama4")
             if degree(auto, family_config(f, 512, 0, 1), 2, 2) == 2]
    assert split == ["mixtral", "qwen3-moe", "qwen3_5_moe", "deepseek_v3", "glm4_moe"]


def test_the_estimate_leaves_split_experts_ungathered_and_counts_their_all_to_all():
    """Under expert parallelism the gathered layer copies and the reduce-scattered gradients leave the experts out,
    the bytes sent lose their gathers and reductions and gain each token's top-k rows there and back in the forward
    and the backward; a degree that does not divide the experts counts as off."""
    from dataclasses import replace

    from pipeline.strategies.memory import Shape, Workload
    from pipeline.strategies.registry import estimate, traffic_bytes

    shape = Shape.of(family_config("qwen3-moe", 512, 0, 1))  # 2 layers of 4 experts, 2 per token, fp32 below
    assert shape.layer_experts == 4 * (64 * 64 + 64 * 32) and shape.routed_params == 2 * shape.layer_experts
    off = Workload("fsdp2", "FULL_SHARD", 2, 2, 4, 2, 128, vocab_parallel=True)
    on = replace(off, expert_parallel=2)
    assert estimate(shape, off).copies - estimate(shape, on).copies == 2 * shape.layer_experts * 4
    assert estimate(shape, off).gradients - estimate(shape, on).gradients == shape.layer_experts * 8
    gathers_and_reduction = (2 * 4 + 4) * shape.routed_params / 2  # fp32 gathers fwd + bwd, fp32 reduce-scatter
    rows = 2 * 128 * 2 * 2  # tokens x top-k x MoE layers
    assert traffic_bytes(shape, on) == int(traffic_bytes(shape, off) - gathers_and_reduction
                                           + 2 * 2 * rows * 64 * 4 / 2)
    assert estimate(shape, replace(off, expert_parallel=3)) == estimate(shape, off)
    # auto over two nodes of 2: the shard ranks of a node under HYBRID_SHARD, off where FULL_SHARD's would span them
    from pipeline.strategies.registry import planned_degree

    hybrid, full = (settle(config(strategy="fsdp2", expert_parallel="auto", sharding=s)).model
                    for s in ("HYBRID_SHARD", "FULL_SHARD"))
    assert (planned_degree(hybrid, 4, 2), planned_degree(full, 4, 2), planned_degree(full, 2, 2)) == (0, 1, 0)
    assert shape.split_experts(Workload("fsdp2", "HYBRID_SHARD", 4, 2, 4, 2, 128, expert_parallel=0)) == 2
    assert shape.split_experts(Workload("fsdp2", "FULL_SHARD", 4, 4, 4, 2, 128, expert_parallel=0)) == 4


def test_a_rank_whose_experts_get_no_token_still_takes_part_in_the_backward(family_env, tmp_path):
    """Every token routed to rank 0's experts, under transformers' loop-style experts (which return a tensor with no
    graph when no expert is hit): both ranks finish the backward (rank 1 would otherwise skip the all-to-alls rank 0
    waits in), rank 1's experts get zero gradients, not none, and the loss and norm are those without expert
    parallelism."""
    from conftest import ROOT, torchrun

    from pipeline.prep.tiny import build_family

    model = build_family(tmp_path / "qwen3-moe", "qwen3-moe")
    out = tmp_path / "rows.jsonl"
    proc = torchrun(2, ROOT / "tests" / "helpers" / "ep_starved_rank.py", model, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["rank"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == [0, 1]
    for row in rows.values():
        assert row["2"]["loss"] == pytest.approx(row["1"]["loss"], abs=1e-6)
        assert row["2"]["norm"] == pytest.approx(row["1"]["norm"], rel=1e-5)
    starved = rows[1]["2"]["grads"]
    assert starved and all(g == 0.0 for g in starved.values())  # zeros, every one present
    assert all(g > 0 for g in rows[0]["2"]["grads"].values())


def test_lora_on_the_experts_under_expert_parallelism_trains_as_one_process(family_env, tmp_path):
    """LoRA on every linear layer and every fused expert weight, the experts split over 2 ranks (each adds its
    experts' slices of B and A to its own experts; peft's wrappers pass through): every step's loss and gradient norm
    as one process training the same adapter on the same blocks, and the same exported adapter."""
    common = ("--max-steps", "3", "--strategy", "fsdp2", "--precision", "fp32", "--adapter", "lora", "--lora-rank",
              "4")
    proc = train(family_env, tmp_path, "local/qwen3-moe", "-e", "ep", *common, "--expert-parallel", "2", "-b", "2")
    assert "expert parallelism: 4 experts per layer over 2 ranks (2 each)" in proc.stdout + proc.stderr
    train(family_env, tmp_path, "local/qwen3-moe", "-e", "one", *common, "-b", "4", nproc=1)
    assert_same_run(tmp_path / "ep", tmp_path / "one")
    ours, theirs = (load_file(tmp_path / r / "adapter" / "adapter_model.safetensors") for r in ("ep", "one"))
    assert ours.keys() == theirs.keys() and any(".experts.lora_A" in k for k in ours)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-5, msg=key)


def test_dora_and_qlora_under_expert_parallelism_train_as_without_it(family_env, tmp_path):
    """DoRA (its experts frozen: peft's wrapper of a fused weight takes no DoRA) against one process, and QLoRA (NF4
    linear layers beside split experts in the compute dtype, LoRA on the experts too) against fsdp2 gathering every
    expert on the same 2 ranks (fsdp2 on one rank cannot rebuild NF4 weights): every step's loss and gradient norm,
    and the same exported adapter."""
    common = ("--max-steps", "3", "--strategy", "fsdp2", "--precision", "fp32", "--lora-rank", "4")
    for adapter, model, name, other in (
            ("dora", "local/qwen3-moe", "one", ("-b", "4")),
            ("qlora", "local/qwen3-moe-256", "gathered", ("-b", "2", "--expert-parallel", "1"))):
        proc = train(family_env, tmp_path, model, "-e", f"{adapter}-ep", *common, "--adapter", adapter,
                     "--expert-parallel", "2", "-b", "2")
        assert "expert parallelism: 4 experts per layer over 2 ranks (2 each)" in proc.stdout + proc.stderr
        train(family_env, tmp_path, model, "-e", f"{adapter}-{name}", *common, "--adapter", adapter, *other,
              nproc=1 if name == "one" else 2)
        assert_same_run(tmp_path / f"{adapter}-ep", tmp_path / f"{adapter}-{name}")
        ours, theirs = (load_file(tmp_path / f"{adapter}-{r}" / "adapter" / "adapter_model.safetensors")
                        for r in ("ep", name))
        assert ours.keys() == theirs.keys()
        assert any(".experts.lora_A" in k for k in ours) == (adapter == "qlora")
        for key in ours:
            # losses and norms measured bitwise equal; AdamW's last step magnifies the experts' reduction order in
            # components whose gradient is near zero: measured at most 2.2e-5 (QLoRA's q_proj.lora_A), 1.7e-6 (DoRA)
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=5e-5, msg=key)


def test_hybrid_shard_splits_the_experts_within_each_node_and_sums_them_over_the_nodes(family_env, tmp_path):
    """Two nodes of 2 ranks (loopback) under HYBRID_SHARD: each node splits every layer's 4 experts over its 2 ranks
    and the nodes replicate them, their gradients summed across the nodes; against one process taking the same 4
    blocks a step, every step's loss and gradient norm and the exports agree, and the run resumed from its step-2
    checkpoint on one process trains the same losses."""
    from test_multinode import two_nodes

    common = ("--max-steps", "3", "--strategy", "fsdp2", "--precision", "fp32")
    nodes = two_nodes(family_env, 2, train_args(family_env, tmp_path, "local/qwen3-moe", "-e", "hsdp", *common,
                                                "--sharding", "HYBRID_SHARD", "-b", "1"), tmp_path)
    assert [code for code, _ in nodes] == [0, 0], nodes[0][1][-3000:] + nodes[1][1][-3000:]
    assert "expert parallelism: 4 experts per layer over 2 ranks (2 each)" in nodes[0][1]  # auto, within the node
    train(family_env, tmp_path, "local/qwen3-moe", "-e", "one", *common, "-b", "4", nproc=1)
    assert_same_run(tmp_path / "hsdp", tmp_path / "one")
    ours, one = exported(tmp_path / "hsdp"), exported(tmp_path / "one")
    assert ours.keys() == one.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], one[key], rtol=0, atol=1e-5, msg=key)
    shutil.copytree(tmp_path / "hsdp", tmp_path / "single" / "hsdp")
    train(family_env, tmp_path / "single", "local/qwen3-moe", "-e", "hsdp", *common, "-b", "4", "--resume-from",
          "step-00000002", nproc=1)
    assert_same_run(tmp_path / "single" / "hsdp", tmp_path / "hsdp", norm=False)
