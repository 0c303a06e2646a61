"""The memory estimator (pipeline/strategies/memory.py) and --strategy auto, which chooses on it."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pipeline.config import ModelConfig
from pipeline.config_merge import from_flat
from pipeline.model.adapters import LowRankAdapter
from pipeline.strategies.auto import plan_memory
from pipeline.strategies.memory import GIB, Shape, Workload, layer_activation_bytes
from pipeline.strategies.registry import estimate, settle, traffic_bytes, uses_vocab_parallel, workload

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)


def launched_as(monkeypatch, world: int | str) -> None:
    """The variables a launcher of `world` processes on one node sets for its rank 0 (plan_memory reads them)."""
    for key, value in {"WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "RANK": 0, "LOCAL_RANK": 0,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(key, str(value))


def meta_params(config: LlamaConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": False},
    {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 32},
    {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
     "num_key_value_heads": 3, "vocab_size": 49152},
])
def test_parameter_counts_from_the_config_match_the_model(overrides):
    config = LlamaConfig(**{**LLAMA_1B, **overrides})
    assert Shape.of(config).num_params == meta_params(config)


def test_llama_1b_state_is_16_bytes_per_parameter_over_the_shards():
    shape = Shape.of(LlamaConfig(**LLAMA_1B))
    assert shape.num_params == 1_235_814_400

    def est(strategy: str, sharding: str, world: int, **kw) -> object:
        return estimate(shape, Workload(strategy, sharding, world, kw.pop("local", world), 2, 1, 2048, **kw))

    # fp32 weight and two AdamW moments, sharded over the GPUs; the (fused) step adds the fp32 gradient
    assert [est("fsdp2", "FULL_SHARD", n).weights for n in (1, 2, 4, 8)] == \
        [14_829_772_800, 7_414_886_400, 3_707_443_200, 1_853_721_600]
    assert est("fsdp2", "FULL_SHARD", 8).update == 16 * shape.num_params // 8
    assert est("ddp", "NO_SHARD", 8).weights == est("fsdp2", "NO_SHARD", 8).weights == 14_829_772_800
    assert est("ddp", "NO_SHARD", 8).gradients == 4 * shape.num_params  # the buckets stay between steps
    assert est("fsdp2", "HYBRID_SHARD", 8, local=4).weights == 3_707_443_200
    assert est("fsdp2", "FULL_SHARD", 8, cpu_offload=True).weights == 0
    # bf16 copies under ZeRO-3: the tied embedding (gathered root) and two of the 16 equal decoder layers; none
    # of the root with the vocabulary-parallel head; one layer (no prefetch) under manual
    layer = shape.layer_params
    assert est("fsdp2", "FULL_SHARD", 8).copies == 2 * (128256 * 2048 + 2048 + 2 * layer)
    assert est("fsdp2", "FULL_SHARD", 8, vocab_parallel=True).copies == 2 * 2 * layer
    assert est("manual", "FULL_SHARD", 8).copies == 2 * (128256 * 2048 + 2048 + layer)
    # gradient accumulation keeps the unsharded fp32 gradients between micro-steps
    assert est("fsdp2", "FULL_SHARD", 8, grad_accum=2).gradients - est("fsdp2", "FULL_SHARD", 8).gradients == \
        4 * shape.num_params
    # activation checkpointing keeps one hidden state per layer instead of every layer's saved tensors
    assert est("fsdp2", "FULL_SHARD", 8, activation_checkpointing=True).activations < \
        est("fsdp2", "FULL_SHARD", 8).activations / 5
    # selective checkpointing keeps 5 hidden, 2 KV and 2 intermediate widths per layer, and one layer's whole
    tokens = 2048
    kept = tokens * 2 * (5 * shape.hidden + 2 * shape.kv + 2 * shape.intermediate)
    whole = tokens * 2 * (8 * shape.hidden + 2 * shape.kv + 4 * shape.intermediate)
    assert est("fsdp2", "FULL_SHARD", 8, selective_checkpointing=True).activations - \
        est("fsdp2", "FULL_SHARD", 8).activations == shape.layers * (kept - whole) + whole


def test_dora_counts_the_two_outputs_it_rescales_per_adapted_layer():
    shape = Shape.of(LlamaConfig(**LLAMA_1B))

    def activations(adapter: str, **kw) -> int:
        return estimate(shape, Workload("fsdp2", "FULL_SHARD", 2, 2, 2, 1, 2048, adapter=adapter, **kw)).activations

    outputs = 2048 + 512 + 512 + 2048 + 8192 + 8192 + 2048  # q, k, v, o, gate, up, down
    assert activations("dora") - activations("lora") == 16 * 2048 * 2 * outputs * 2
    assert activations("lora") == activations("none")
    # only q and v adapted: their outputs alone; with checkpointing, one recomputed layer's
    assert activations("dora", lora_targets="q_proj,v_proj") - activations("lora", lora_targets="q_proj,v_proj") == \
        16 * 2048 * 2 * (2048 + 512) * 2
    assert activations("dora", activation_checkpointing=True) - activations("lora", activation_checkpointing=True) == \
        2048 * 2 * outputs * 2


def config_for(model: str, *extra: str):
    return from_flat({"experiment_name": "m", "dataset_name": "d", "model_name": model,
                      **dict(zip(extra[::2], extra[1::2], strict=True))})


def test_traffic_counts_what_each_collective_moves_per_rank():
    shape = Shape.of(LlamaConfig(**LLAMA_1B))
    body, root = 16 * shape.layer_params, shape.root_params

    def moved(strategy: str, sharding: str, world: int = 4, **kw) -> int:
        return traffic_bytes(shape, Workload(strategy, sharding, world, world, kw.pop("c", 4), 1, 2048, **kw))

    assert moved("ddp", "NO_SHARD") == int(0.75 * 2 * 4 * shape.num_params)  # one ring all-reduce of fp32 gradients
    assert moved("ddp", "NO_SHARD", grad_accum=4) == moved("ddp", "NO_SHARD")  # no_sync until the last micro-step
    assert moved("ddp", "NO_SHARD", world=1) == moved("fsdp2", "FULL_SHARD", world=1) == 0
    # ZeRO-3: layers gathered for the forward and again for the backward, the root once; all reduce-scattered in fp32
    assert moved("fsdp2", "FULL_SHARD") == int(0.75 * (4 * (2 * body + root) + 4 * (body + root)))
    assert moved("fsdp2", "FULL_SHARD", c=2) == int(0.75 * (2 * (2 * body + root) + 4 * (body + root)))
    assert moved("fsdp2", "SHARD_GRAD_OP") == int(0.75 * (4 * (body + root) + 4 * (body + root)))
    assert moved("fsdp2", "FULL_SHARD", grad_accum=2) == int(0.75 * (2 * 4 * (2 * body + root) + 4 * (body + root)))
    # the vocabulary-parallel head stays local; every rank's hidden states cross instead (4 x world x tokens x hidden)
    assert moved("fsdp2", "FULL_SHARD", vocab_parallel=True) == \
        int(0.75 * (4 * (2 * body + 2048) + 4 * (body + 2048) + 4 * 4 * 2048 * 2048 * 4))


def test_auto_picks_ddp_while_a_replica_fits_and_moves_less_and_fsdp2_beyond(monkeypatch):
    launched_as(monkeypatch, "4")
    hf = LlamaConfig(**LLAMA_1B)
    replica = plan_memory(config_for("m", "strategy", "ddp", "precision", "fp32"), hf, "cpu").estimate.total
    ddp_mib = traffic_bytes(Shape.of(hf), workload(settle(config_for("m", "strategy", "ddp")), "cpu", 4, 4)) / 2**20
    fsdp2_mib = traffic_bytes(Shape.of(hf), workload(settle(config_for("m", "strategy", "fsdp2")), "cpu", 4, 4)) / 2**20
    assert ddp_mib < fsdp2_mib  # fp32: gathering the layers twice and reduce-scattering them is 3 of 2 copies

    fits = replica * 1.2 / GIB + 0.01  # the auto rule's margin (AUTO_MARGIN) included
    cfg = config_for("m", "strategy", "auto", "memory_gb", fits, "precision", "fp32")
    plan = plan_memory(cfg, hf, "cpu")
    assert (cfg.model.strategy, cfg.model.sharding) == ("auto", "auto")  # the given config is left as it is
    assert (plan.config.model.strategy, plan.config.model.sharding) == ("ddp", "NO_SHARD")
    assert plan.estimate.total == replica
    assert plan.reason == (f"ddp: a whole replica fits ({replica / GIB:.2f} GiB per rank, 20% more to be safe, of "
                           f"{fits:.2f}) and ddp moves {ddp_mib:.0f} MiB per step per rank, fsdp2 {fsdp2_mib:.0f} MiB")

    tight = replica * 1.2 / GIB - 0.01  # fits the estimate, not its margin
    cfg = config_for("m", "strategy", "auto", "memory_gb", tight, "precision", "fp32")
    plan = plan_memory(cfg, hf, "cpu")
    assert (plan.config.model.strategy, plan.config.model.sharding) == ("fsdp2", "FULL_SHARD")
    assert plan.reason == (f"fsdp2: a whole replica would need {replica / GIB:.2f} GiB per rank, 20% more to be safe, "
                           f"of {tight:.2f} GiB")
    assert plan.estimate.weights == 12 * Shape.of(hf).num_params // 4

    plan = plan_memory(config_for("m", "strategy", "auto", "sharding", "SHARD_GRAD_OP", "memory_gb", 1000), hf, "cpu")
    assert plan.reason.startswith("fsdp2: the settings given")
    assert (plan.config.model.strategy, plan.config.model.sharding) == ("fsdp2", "SHARD_GRAD_OP")
    plan = plan_memory(config_for("m", "strategy", "auto", "vocab_parallel", "on", "memory_gb", 1000), hf, "cpu")
    assert plan.reason.startswith("fsdp2: the settings given")
    m = plan.config.model
    assert (m.strategy, m.sharding, uses_vocab_parallel(m)) == ("fsdp2", "FULL_SHARD", True)


@pytest.mark.parametrize(("world", "overrides", "chosen"), [
    (2, {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4,
         "num_key_value_heads": 4, "head_dim": 64}, "fsdp2"),  # the 128k head is most of it: kept local, not reduced
    (2, {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
         "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152}, "ddp"),  # SmolLM2-135M
    (1, {}, "fsdp2"),  # one rank: nothing moves either way, and fsdp2's chunked loss needs less memory
])
def test_auto_takes_the_strategy_that_moves_less_when_both_fit(monkeypatch, world, overrides, chosen):
    """The two CPU cases of BENCHMARKS.md section 11, where the choice was measured to be the faster."""
    launched_as(monkeypatch, str(world))
    cfg = config_for("m", "strategy", "auto", "memory_gb", 1000, "precision", "fp32", "seq_length", 256)
    assert plan_memory(cfg, LlamaConfig(**{**LLAMA_1B, **overrides}), "cpu").config.model.strategy == chosen


def test_auto_takes_fsdp2_on_one_rank_and_says_why(monkeypatch):
    launched_as(monkeypatch, "1")
    cfg = config_for("m", "strategy", "auto", "memory_gb", 1000)
    plan = plan_memory(cfg, LlamaConfig(**LLAMA_1B), "cpu")
    m = plan.config.model
    assert (m.strategy, m.sharding, uses_vocab_parallel(m)) == ("fsdp2", "FULL_SHARD", True)
    assert plan.reason == "fsdp2: one rank moves nothing, and fsdp2's chunked loss never builds full-width logits"


def test_a_given_strategy_is_kept_and_estimated():
    hf = LlamaConfig(**LLAMA_1B)
    cfg = config_for("m", "strategy", "fsdp1", "memory_gb", 0.5)
    plan = plan_memory(cfg, hf, "cpu")
    assert plan.config.model.strategy == "fsdp1" and plan.reason == "" and plan.budget == GIB // 2
    assert plan.estimate.total > plan.budget


@pytest.mark.parametrize("family", ["gemma4", "llama4", "qwen3_5", "qwen3_5_moe", "deepseek_v3", "glm4_moe", "olmo3"])
def test_layers_that_differ_are_counted_as_built(family):
    """Per-layer head sizes (Gemma 4: reading head_dim from its config raises), linear-attention layers, MLA, dense
    first layers and shared experts: the shape is read from the model transformers builds, layer by layer."""
    from pipeline.prep.tiny import family_config

    config = family_config(family, 512, 0, 1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = Shape.of(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.body_params == sum(p.numel() for p in model.model.layers.parameters())
    work = Workload("fsdp2", "FULL_SHARD", 2, 2, 2, 1, 128, adapter="lora", lora_rank=4)
    LowRankAdapter(ModelConfig(model_name="m", adapter="lora", lora_rank=4), torch.float32).apply(model)
    # what the adapter really trains, fused expert weights' adapters (peft's target_parameters) included
    assert shape.adapter_params(work) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert estimate(shape, work).total > 0


def test_lora_on_fused_experts_counts_the_merged_copy_of_each_layer_s_experts_autograd_keeps():
    """peft's ParamWrapper saves W + B A of every expert of each layer for the backward: the activations grow by the
    experts in the compute dtype, all layers' without checkpointing and one layer's with either kind; not under DoRA,
    which leaves the experts frozen."""
    from pipeline.prep.tiny import family_config

    shape = Shape.of(family_config("qwen3-moe", 512, 0, 1))
    experts = sum(e * a * b for _, e, a, b in shape.experts)
    assert experts == 2 * 4 * (64 * 64 + 64 * 32)  # 2 layers of 4 experts, gate_up_proj and down_proj

    def activations(adapter: str, **kw) -> int:
        return estimate(shape, Workload("fsdp2", "FULL_SHARD", 2, 2, 2, 1, 128, adapter=adapter, **kw)).activations

    assert activations("lora") - activations("lora", lora_targets="q_proj") == experts * 2
    for recomputed in ({"activation_checkpointing": True}, {"selective_checkpointing": True}):
        assert activations("lora", **recomputed) - activations("lora", lora_targets="q_proj", **recomputed) == \
            experts // 2 * 2
    assert activations("lora", lora_targets="experts.down_proj") - activations("lora", lora_targets="q_proj") == \
        2 * 4 * 64 * 32 * 2
    assert activations("dora") == activations("dora", lora_targets="q_proj,k_proj,v_proj,o_proj")


def test_a_model_whose_shape_cannot_be_read_trains_under_fsdp2_without_an_estimate(monkeypatch):
    from pipeline.strategies.memory import ShapeUnknown

    launched_as(monkeypatch, "2")
    broken = LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": 0})  # no decoder layers to find
    with pytest.raises(ShapeUnknown, match="cannot find the 0 decoder layers of LlamaForCausalLM"):
        Shape.of(broken)
    plan = plan_memory(config_for("m", "strategy", "auto"), broken, "cpu")
    assert (plan.config.model.strategy, plan.estimate) == ("fsdp2", None)
    assert plan.reason.startswith("fsdp2: the model's memory cannot be estimated (UserError: cannot find the 0")


def test_grpo_counts_its_completions_and_the_generations_kv_cache():
    """A GRPO micro-batch of B prompts is B x G completions of prompt + completion tokens, the logits only the
    completions' positions; the generation is a moment of its own: the weights, the model gathered whole under a
    sharding strategy, every layer's keys and values of every completion and the last logits; the total is the
    largest of the three moments."""
    from pipeline.strategies.memory import Generation

    shape = Shape.of(LlamaConfig(**LLAMA_1B))
    cfg = settle(config_for("m", "strategy", "fsdp2", "vocab_parallel", "off", "objective", "grpo", "batch_size", 2,
                            "num_generations", 8, "max_prompt_length", 256, "max_completion_length", 1024))
    work = workload(cfg, "cuda", 8, 8)
    assert (work.batch_size, work.seq_length, work.generation) == (16, 1280, Generation(16, 256, 1024, group=8,
                                                                                          packable=True))
    est, c = estimate(shape, work), work.compute_bytes
    # 8 completions of 1024 after 256: one dense row of 8448 positions would cost more than 8 rows of 1280, so they
    # are scored plain (pipeline/rl/packing.py); of 64, packed: 2 rows of 256 + 8 x 64 positions and their 4D mask,
    # unless the kernel takes no 4D mask
    assert est.activations == shape.layers * layer_activation_bytes(shape, 16 * 1280, c)
    short = replace(cfg, grpo=replace(cfg.grpo, max_completion_length=64))
    assert estimate(shape, workload(short, "cuda", 8, 8)).activations == \
        shape.layers * layer_activation_bytes(shape, 2 * (256 + 8 * 64), c) + 2 * (256 + 8 * 64) ** 2 * c
    flash = replace(short, model=replace(cfg.model, attn_implementation="flash_attention_2"))
    assert estimate(shape, workload(flash, "cuda", 8, 8)).activations == \
        shape.layers * layer_activation_bytes(shape, 16 * (256 + 64), c)
    kv = 2 * 16 * (8 * 64) * 16 * 1280 * c  # keys and values: 16 layers, 8 KV heads of 64
    assert est.generation == est.weights + c * shape.num_params + kv + 16 * 128256 * (c + 8)
    assert est.logits == 16 * 1025 * 128256 * (c + (4 if c < 4 else 0) + 8)
    assert est.total == max(est.forward, est.update, est.generation)
    # a KL penalty under full fine-tuning keeps a frozen copy of the base: sharded under fsdp2, whole (fp32) under ddp
    with_ref = settle(config_for("m", "strategy", "fsdp2", "vocab_parallel", "off", "objective", "grpo", "batch_size",
                                 2, "grpo_beta", 0.04))
    plain = settle(config_for("m", "strategy", "fsdp2", "vocab_parallel", "off", "objective", "grpo", "batch_size", 2))
    assert estimate(shape, workload(with_ref, "cuda", 8, 8)).weights - estimate(
        shape, workload(plain, "cuda", 8, 8)).weights == c * shape.num_params // 8
    ddp = settle(config_for("m", "strategy", "ddp", "objective", "grpo", "batch_size", 2, "grpo_beta", 0.04))
    assert estimate(shape, workload(ddp, "cuda", 8, 8)).weights == 12 * shape.num_params + 4 * shape.num_params
    # reward models, resident on every rank whole in the compute dtype, through every moment
    judged = estimate(shape, workload(cfg, "cuda", 8, 8, resident_params=10**8))
    assert (judged.weights - est.weights, judged.update - est.update, judged.generation - est.generation) == \
        (10**8 * c,) * 3
    sft = estimate(shape, workload(settle(config_for("m", "strategy", "fsdp2", "batch_size", 2)), "cuda", 8, 8))
    assert sft.generation == 0 and "generation" not in sft.gib() and "generation" in est.gib()


def test_tiled_mlp_takes_every_layers_mlp_intermediates_out_of_the_estimate_but_one_chunks():
    """--tiled-mlp on: without checkpointing no layer keeps its MLP's four intermediate widths, with it the layer
    recomputed does not either, and selective checkpointing's kept gate and up outputs go too; one chunk's
    (batch x hidden tokens) is counted once instead. At 1 x 32,768 tokens on Llama-3.2-1B's shape the activations
    fall by the predicted bytes."""
    shape = Shape.of(LlamaConfig(**LLAMA_1B))
    for flags, layers_saving in ((("activation_checkpointing", False), shape.layers),
                                 (("activation_checkpointing", True), 1),
                                 (("selective_checkpointing", True), shape.layers + 1)):
        cfg = settle(config_for("m", "strategy", "fsdp2", "batch_size", 1, "seq_length", 32768, *flags))
        plain = estimate(shape, workload(cfg, "cuda", 8, 8))
        tiled = estimate(shape, workload(replace(cfg, model=replace(cfg.model, tiled_mlp="on")), "cuda", 8, 8))
        c = plain.activations and workload(cfg, "cuda", 8, 8).compute_bytes
        whole, one_chunk = 4 * shape.intermediate * 32768 * c, 4 * shape.intermediate * shape.hidden * c
        dropped = whole * layers_saving if flags[0] == "activation_checkpointing" else \
            whole // 2 * shape.layers + whole  # selective: the kept gate and up outputs, and the recomputed layer's
        assert plain.activations - tiled.activations == dropped - one_chunk, flags
        assert (tiled.weights, tiled.logits) == (plain.weights, plain.logits)


def test_sequence_parallel_divides_each_ranks_activations_and_logits_by_its_degree():
    """--sequence-parallel N: a rank holds 1/N of every sequence's positions, so 1/N of the activations and logits
    at any checkpointing; weights, gradients and copies are the strategy's as before."""
    shape = Shape.of(LlamaConfig(**LLAMA_1B))
    for flags in (("activation_checkpointing", False), ("activation_checkpointing", True)):
        cfg = settle(config_for("m", "strategy", "fsdp2", "batch_size", 2, "seq_length", 32768, *flags))
        whole = estimate(shape, workload(cfg, "cuda", 8, 8))
        for n in (2, 4, 8):
            split = estimate(shape, workload(replace(cfg, model=replace(cfg.model, sequence_parallel=n)), "cuda", 8,
                                             8))
            quarter = estimate(shape, workload(replace(cfg, data=replace(cfg.data, seq_length=32768 // n)), "cuda",
                                               8, 8))
            assert (split.activations, split.logits) == (quarter.activations, quarter.logits), (flags, n)
            assert split.activations < whole.activations
            assert (split.weights, split.gradients, split.copies) == (whole.weights, whole.gradients, whole.copies)


def test_the_plan_states_the_longest_sequence_that_fits_and_what_would_lengthen_it(monkeypatch):
    """MemoryPlan.longest: the run's own longest --seq-length (its estimate fits the budget, one step more does not),
    and with each of checkpointing, the tiled MLP and sequence parallelism over the most ranks that divide the heads
    (Llama-3.2-1B: 32 heads, 8 ranks), each longer; none of them where the run has it already."""
    from pipeline.strategies.auto import longest_sequence

    launched_as(monkeypatch, "8")
    hf = LlamaConfig(**LLAMA_1B)
    cfg = config_for("m", "strategy", "fsdp2", "batch_size", 1, "seq_length", 65536, "memory_gb", 40)
    plan = plan_memory(cfg, hf, "cuda")
    assert list(plan.longest) == ["", "--activation-checkpointing on", "--tiled-mlp on", "--sequence-parallel 8",
                                  "--offload-activations on", "--activation-checkpointing on --tiled-mlp on "
                                  "--sequence-parallel 8 --offload-activations on"]
    own = plan.longest[""]
    assert 0 < own < 65536 and own % 256 == 0
    work = workload(plan.config, "cuda", 8, 8)
    assert estimate(Shape.of(hf), replace(work, seq_length=own)).total <= 40 * GIB
    assert estimate(Shape.of(hf), replace(work, seq_length=own + 256)).total > 40 * GIB
    assert longest_sequence(Shape.of(hf), work, 40 * GIB) == own
    assert all(n > own for flags, n in plan.longest.items() if flags)
    assert plan.longest["--activation-checkpointing on --tiled-mlp on --sequence-parallel 8 --offload-activations "
                        "on"] == max(plan.longest.values())
    on = config_for("m", "strategy", "fsdp2", "batch_size", 1, "seq_length", 65536, "memory_gb", 40,
                    "activation_checkpointing", True, "sequence_parallel", 8)
    assert list(plan_memory(on, hf, "cuda").longest) == ["", "--tiled-mlp on", "--offload-activations on",
                                                         "--tiled-mlp on --offload-activations on"]
    assert list(plan_memory(on, hf, "cpu").longest) == ["", "--tiled-mlp on"]  # offloading: a GPU's
    # a combination the run would refuse is offered no degree (dpo scores through the model's own head), the same
    # objective without it is
    dpo = config_for("m", "strategy", "fsdp2", "memory_gb", 40, "objective", "dpo")
    assert "--sequence-parallel 8" in plan_memory(dpo, hf, "cuda").longest
    dpo_vocab = config_for("m", "strategy", "fsdp2", "memory_gb", 40, "objective", "dpo", "vocab_parallel", "on")
    assert "--sequence-parallel 8" not in plan_memory(dpo_vocab, hf, "cuda").longest
    # a family sequence parallelism refuses is offered no degree (OLMo: outside the suite's families)
    olmo = LlamaConfig(**LLAMA_1B)
    olmo.model_type = "olmo"
    assert not any("--sequence-parallel" in flags for flags in plan_memory(cfg, olmo, "cuda").longest)


def test_an_estimate_above_the_budget_names_the_flags_that_would_fit_the_sequence():
    from pipeline.train.reports import longer_with

    longest = {"": 10240, "--activation-checkpointing on": 35840, "--tiled-mlp on": 19712,
               "--sequence-parallel 8": 83712}
    assert longer_with(longest, 32768) == ("--seq-length 32,768 would fit with --activation-checkpointing on "
                                           "(35,840); or --sequence-parallel 8 (83,712); ")
    assert longer_with(longest, 100_000) == longer_with({}, 4096) == ""


def test_offloaded_activations_leave_one_layers_on_the_gpu_and_change_nothing_on_a_cpu():
    """--offload-activations on: with checkpointing the layers' inputs go to host memory (one layer recomputed stays),
    without it every layer's saved tensors but the one in use; on a CPU the estimate is the same as off."""
    shape = Shape.of(LlamaConfig(**LLAMA_1B))
    for checkpointing in (True, False):
        cfg = settle(config_for("m", "strategy", "fsdp2", "batch_size", 1, "seq_length", 32768,
                                "activation_checkpointing", checkpointing))
        on = replace(cfg, model=replace(cfg.model, offload_activations="on"))
        plain, offloaded = (estimate(shape, workload(c, "cuda", 8, 8)) for c in (cfg, on))
        per_layer = layer_activation_bytes(shape, 32768, workload(cfg, "cuda", 8, 8).compute_bytes)
        assert offloaded.activations == per_layer, checkpointing
        assert plain.activations > offloaded.activations
        assert estimate(shape, workload(on, "cpu", 8, 8)) == estimate(shape, workload(cfg, "cpu", 8, 8))
