"""Typed trainer configuration: nested dataclasses, one flat set of keys shared by the CLI and YAML files, each
field's choices and ranges checked when built (pipeline/config_merge.py reads flags, YAML files and profiles into
them). Every key of a YAML file is a field name below (snake_case); every flag is the same name in kebab case.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline.config_base import Section, flag, in_range, require
from pipeline.config_grpo import GRPOConfig, Rollouts
from pipeline.data.sources import parse_sources
from pipeline.train.trackers import check_report_to

Precision = Literal["auto", "bf16", "fp16", "fp32"]
Sharding = Literal["auto", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
StrategyName = Literal["fsdp2", "fsdp1", "ddp", "manual", "auto"]
AutoWrap = Literal["transformer", "size"]
BackwardPrefetch = Literal["BACKWARD_PRE", "BACKWARD_POST", "NONE"]
Schedule = Literal["cosine", "linear", "constant"]
AutoOnOff = Literal["auto", "on", "off"]
OnOff = Literal["on", "off"]
ExportDtype = Literal["auto", "bf16", "fp16", "fp32"]
TrainOn = Literal["assistant", "last", "all"]
AttnImplementation = Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"]
Adapter = Literal["none", "lora", "dora", "qlora"]
VOCAB_PARALLEL_SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP")
"""The shardings the vocabulary-parallel head works with (a 1-D mesh)."""
YEAR_S = 365 * 24 * 3600
"""The longest time a flag may give, in seconds: beyond it a timedelta or a wait overflows and nobody means it."""
NAME_BYTES = 200
"""The longest --experiment-name, in bytes: file systems allow 255 per name, and NAME-2 (--no-resume) adds some."""


@dataclass
class RunConfig(Section):
    experiment_name: str = ""
    """Name of the run: its folder under save_dir. Rerunning with the same name resumes it."""
    save_dir: str = "outputs"
    """Root of all runs."""
    seed: int = 0
    """Seeds data order, validation split, initialisation of RNGs on every rank."""
    resume_from: str = ""
    """Resume from this checkpoint (step-NNNNNNNN) instead of the newest complete one."""
    no_resume: bool = False
    """Start over under a new run name (NAME-2, NAME-3, ...) even if the run has checkpoints; nothing is deleted."""
    async_ckpt: AutoOnOff = "auto"
    """Write checkpoints in the background while training goes on (auto: on for GPU, off on CPU)."""
    export_dtype: ExportDtype = "auto"
    """dtype of the exported Hugging Face model (auto: the base model's)."""
    save_best: bool = False
    """Also export the model with the best validation loss to RUN/best/."""
    merge_export: bool = True
    """With --adapter: also export the base model with the adapter merged into its weights to RUN/hf/ (off: only
    the adapter, RUN/adapter/)."""
    collective_timeout_s: float = 3600.0
    """Seconds a collective may wait for the slowest rank before the run fails (the process group's timeout).
    Waiting for the token cache is not a collective: a long build never hits it."""
    peer_timeout_s: float = 30.0
    """Seconds a rank's heartbeat may stall before it counts as lost (a dead node, a killed process): every other rank
    then exits within about this plus 10 s, naming it. 0 turns the heartbeat off (the collective timeout remains)."""

    report_to: str = "tensorboard"
    """Where the metrics go besides metrics.jsonl, comma-separated: tensorboard, mlflow, wandb, trackio, or none.
    Offline unless the tracker's own variables say otherwise: MLflow to RUN/mlflow.db unless MLFLOW_TRACKING_URI, W&B
    with WANDB_MODE=offline unless set (RUN/wandb; `wandb sync` uploads it later), Trackio to its local store. A
    resumed run continues its tracker run (RUN/trackers.json holds the ids)."""

    def check(self) -> None:
        check_report_to(self.report_to)
        require(bool(self.experiment_name), "--experiment-name (-e) is required")
        require(not self.resume_from or (self.resume_from.startswith("step-") and self.resume_from[5:].isdigit()),
               f"--resume-from must name a checkpoint like step-00000040, got {self.resume_from!r}")
        require("/" not in self.experiment_name and self.experiment_name not in (".", ".."),
               f"--experiment-name must be a plain folder name, got {self.experiment_name!r}")
        require(len(self.experiment_name.encode("utf-8", "surrogateescape")) <= NAME_BYTES,
               f"--experiment-name is {len(self.experiment_name.encode('utf-8', 'surrogateescape'))} bytes long; a "
               f"folder name may have at most {NAME_BYTES}")
        require(0 <= self.seed < 2**32, f"--seed must be in [0, {2**32 - 1}], got {self.seed}")
        # a year at most: a timedelta or a wait beyond that overflows
        in_range(self.collective_timeout_s, 0, YEAR_S, "collective_timeout_s", low_open=True)
        require(self.peer_timeout_s == 0 or 2 <= self.peer_timeout_s <= YEAR_S,
               f"--peer-timeout-s must be 0 (off) or in [2, {YEAR_S:g}], got {self.peer_timeout_s:g}")


@dataclass
class DataConfig(Section):
    dataset_name: str = ""
    """A dataset saved by DATA-HF.py (a path), or a hub dataset id already in the datasets cache."""
    seq_length: int = 1024
    """Tokens per training block; at most the model's max_position_embeddings."""
    val_fraction: float = 0.01
    """Share of blocks held out for validation (at least one block when there are two or more)."""
    num_proc: int = 0
    """Processes for tokenization; 0 means all cores."""
    cache_dir: str = ""
    """Folder of the token cache; empty means SAVE_DIR/token_cache. May be a node-local disk: each node then builds
    (or finds) its own copy; nodes that share it take turns under a file lock."""
    train_on: TrainOn = "assistant"
    """Conversations (rows with messages): the tokens in the loss. assistant: every assistant turn (its content and
    end-of-turn token); last: the last assistant turn only; all: every token of the rendered conversation."""
    train_on_reasoning: bool = True
    """An assistant turn's reasoning trace (reasoning_content, thinking or reasoning, rendered by the template): on,
    a target like the answer; off, context (the tokens from the turn's start to the trace's end are not trained)."""
    chat_date: str = "26 Jul 2024"
    """The date Llama 3.1/3.2 chat templates print as "Today Date" (they take today's otherwise): pinned, so the
    token cache and an exact resume do not change with the day."""
    chat_template: str = ""
    """A Jinja chat template file used instead of the model's own (or for a model without one); the export carries
    it as chat_template.jinja."""
    document_mask: bool = False
    """Text rows: restart positions after each EOS and keep attention within each document (conversations always
    are)."""
    allow_special_tokens_in_data: bool = False
    """Let a special token's text inside the data (`<|eot_id|>` in a message, `<|end_of_text|>` in a text row) become
    that token. Off: it is tokenized as text, so user data cannot end a document or forge a chat turn; only the chat
    template's own markers are special."""
    prepare_only: bool = False
    """Build the token cache (tokenize, pack, split) and exit: no process group, no GPU, so it can run on a CPU node
    before the job (plain python, same arguments); the training run then finds it. A killed build resumes."""

    def check(self) -> None:
        require(bool(self.chat_date.strip()), "--chat-date must not be empty")
        require(self.train_on_reasoning or self.train_on != "all",
               "--train-on-reasoning off makes traces context, but --train-on all trains every token; use --train-on "
               "assistant or last with it")
        if self.dataset_name:  # a mixture's weights and names: one line before anything is loaded
            parse_sources(self.dataset_name)
        require(not self.chat_template or Path(self.chat_template).is_file(),
               f"--chat-template {self.chat_template} does not exist or is not a file")
        require(self.seq_length >= 8, f"--seq-length must be at least 8, got {self.seq_length}")
        require(0 <= self.val_fraction < 0.5, f"--val-fraction must be in [0, 0.5), got {self.val_fraction}")
        require(self.num_proc >= 0, f"--num-proc must be >= 0, got {self.num_proc}")


@dataclass
class ModelConfig(Section):
    model_name: str = ""
    """Hub id resolved from the local cache (offline), or a local model directory."""
    precision: Precision = "auto"
    """Compute dtype: bf16 where supported (auto on GPU), fp32 on CPU; fp16 (GPUs without bf16: V100, T4) with
    dynamic loss scaling (--loss-scale). Master weights, optimizer states and gradient reduction are fp32."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward: less memory, about a third more compute."""
    selective_checkpointing: bool = False
    """Keep each decoder layer's matrix products' and attention's outputs and recompute the rest in backward (norms,
    activation functions, rotary embedding, residual adds): about half the activations of no checkpointing, for
    the time of those cheap operations, the same values (pipeline/model/checkpointing.py). Or
    --activation-checkpointing, not both."""
    compile: bool = False
    """torch.compile each decoder layer."""
    attn_implementation: AttnImplementation = "auto"
    """The attention kernel, as transformers names it; auto: transformers' own default for the family (what
    from_pretrained gives: sdpa where the family supports it, eager for Gemma2, whose attention soft-caps its
    scores). Packed documents are kept apart by their position ids under every one. A kernel the family refuses is
    one line naming those it accepts."""
    strategy: StrategyName = "auto"
    """How the model is spread over the ranks: fsdp2 (fully_shard), fsdp1 (FullyShardedDataParallel, with the
    --auto-wrap, --backward-prefetch, --forward-prefetch, --limit-all-gathers and --use-orig-params knobs), ddp
    (DistributedDataParallel: a whole replica per rank) or manual (this project's readable ZeRO-3,
    pipeline/strategies/manual.py); auto: of ddp and fsdp2, the one that moves fewer bytes per step among those
    whose memory estimate fits --memory-gb, fsdp2 on one rank (the reason is logged). All write the same checkpoints:
    a run resumes under another one."""
    sharding: Sharding = "auto"
    """FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2: keep parameters gathered between forward and backward),
    NO_SHARD (replicate, DDP semantics), HYBRID_SHARD (shard within a node, replicate across nodes); auto:
    NO_SHARD under ddp, FULL_SHARD otherwise."""
    memory_gb: float = 0.0
    """Memory per rank, in GiB, that --strategy auto and the start-up estimate plan for; 0: the device's (a GPU's
    memory less 1 GiB for the CUDA context; on CPU the host's RAM divided by the ranks on the node)."""
    auto_wrap: AutoWrap = "transformer"
    """fsdp1: one FSDP unit per decoder layer (transformer), or per module of at least --min-params parameters
    (size); the embeddings and LM head always stay in the root unit."""
    min_params: int = 100_000_000
    """fsdp1 with --auto-wrap size: the smallest module given its own FSDP unit."""
    backward_prefetch: BackwardPrefetch = "BACKWARD_PRE"
    """fsdp1: all-gather the next unit's parameters before (BACKWARD_PRE) or after (BACKWARD_POST) the current
    unit's gradient computation, or only when needed (NONE). fsdp2 prefetches as BACKWARD_PRE."""
    forward_prefetch: bool = False
    """fsdp1 and fsdp2: all-gather the next decoder layer's parameters while the current one computes."""
    limit_all_gathers: bool = True
    """fsdp1: at most two units' parameters gathered ahead of use (bounds memory; off may overlap more)."""
    use_orig_params: bool = True
    """fsdp1: keep the original parameters as views into each unit's flat parameter (needed by --compile and by
    --weight-decay, which skips norms and biases); off gives the optimizer one flat parameter per unit."""
    cpu_offload: bool = False
    """Keep parameter shards, gradients and optimizer states in host memory; the optimizer step runs on CPU."""
    vocab_parallel: AutoOnOff = "auto"
    """Keep the embedding and LM head sharded by vocabulary rows (never gathered) and compute the loss in chunks
    without full-width logits (auto: on with FULL_SHARD or SHARD_GRAD_OP and no CPU offload, on CPU and GPU)."""
    adapter: Adapter = "none"
    """Train low-rank adapters on a frozen base instead of every weight: lora, dora (LoRA with a learned
    magnitude per output row), or qlora (LoRA on a base whose adapted linear layers are held in 4-bit NF4);
    none: full fine-tuning. The base stays in the compute dtype with no gradient or optimizer state; checkpoints
    hold the adapter only; the run exports RUN/adapter/ (PEFT's format) and, with
    --merge-export on, the merged model to RUN/hf/."""
    lora_rank: int = 16
    """--adapter: the rank r of each adapter's two matrices (A: r x in, B: out x r)."""
    lora_alpha: float = 32.0
    """--adapter: the adapter's output is scaled by alpha / rank."""
    lora_dropout: float = 0.0
    """--adapter: dropout on the adapter's input, in training only."""
    lora_targets: str = ""
    """--adapter: the linear layers that get an adapter, as a comma-separated list of module names (q_proj,v_proj)
    matched against the end of each module's path, and a mixture of experts' fused expert weights by their names
    (gate_up_proj, down_proj; experts.down_proj for the experts' alone where a linear layer is also so named); empty:
    every linear layer of the decoder blocks except a mixture of experts' router, and every fused expert weight."""

    expert_parallel: str = "auto"
    """A mixture of experts under fsdp2: each layer's routed experts split by expert over the ranks FSDP shards over
    (E/N whole experts per rank, never gathered), tokens sent to their experts' ranks and back by all-to-all; the
    value is that number of ranks. 1: off (the experts sharded and gathered as every other weight); auto: on where
    the shard ranks divide the experts and sit on one node (FULL_SHARD or SHARD_GRAD_OP on one node; HYBRID_SHARD's
    node-local shard ranks over any number of nodes, the experts replicated across them), without CPU offload or
    sequence parallelism (measured: 5.5x fsdp2's tokens/s on Qwen3-30B-A3B's shape, BENCHMARKS.md section 31)."""
    sequence_parallel: int = 1
    """Split each sequence by position over this many consecutive ranks (DeepSpeed Ulysses): around attention an
    all-to-all gives each rank the whole sequence for 1/N of the heads, so a rank holds 1/N of every other
    activation; the ranks of a group share one batch (the global batch is world / N x batch x grad accum). fsdp2 or
    ddp; sft, the preference objectives (dpo, ipo, simpo, orpo, kto) and reward; 1: off. N must divide the world
    size, the attention heads and --seq-length."""
    offload_activations: OnOff = "off"
    """on: what autograd saves for backward outside checkpointed regions (under --activation-checkpointing each
    layer's input, all that stays of the activations) held in pinned host memory and copied back for the backward
    (torch.autograd.graph.save_on_cpu), so the GPU holds one layer's activations at a time, for a copy each way over
    PCIe. A GPU's: on a CPU it changes nothing, said in one line."""
    tiled_mlp: OnOff = "off"
    """on: each decoder layer's MLP computed over chunks of about hidden-size tokens, each recomputed in backward
    (ALST's TiledMLP), so its intermediate activations are one chunk's, not the whole sequence's: for long sequences.
    The same result token by token; a mixture of experts' MLP is refused (its router must see the whole sequence)."""
    router_aux_loss_coef: float = -1.0
    """A mixture of experts: the auxiliary load-balancing loss transformers defines for the family is added to the
    training loss times this; -1 (the default): the model config's router_aux_loss_coef where its
    output_router_logits is set, else 0 (the loss is then only logged, as aux_loss). Under --adapter the router
    itself stays frozen, so the loss moves the experts' inputs only."""

    def check(self) -> None:
        require(bool(self.model_name), "--model-name (-m) is required")
        ep = self.expert_parallel
        require(ep == "auto" or (ep.isascii() and ep.isdigit() and 1 <= int(ep) <= 1 << 20),
                f"--expert-parallel must be a number of ranks (1: off) or auto, got {ep!r}")
        require(1 <= self.sequence_parallel <= 1 << 20,
                f"--sequence-parallel must be a number of ranks from 1 (off), got {self.sequence_parallel}")
        require(self.router_aux_loss_coef == -1 or 0 <= self.router_aux_loss_coef <= 100,
                f"--router-aux-loss-coef must be in [0, 100] (or -1: the model config's), got "
                f"{self.router_aux_loss_coef:g}")
        require(self.lora_rank >= 1, f"--lora-rank must be at least 1, got {self.lora_rank}")
        in_range(self.lora_alpha, 0, 1e4, "lora_alpha", low_open=True)  # alpha / rank scales every adapter's output
        require(0 <= self.lora_dropout < 1, f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        require(all(t.strip() for t in self.lora_targets.split(",")) or not self.lora_targets,
               f"--lora-targets must be a comma-separated list of module names, got {self.lora_targets!r}")
        require(not (self.adapter == "qlora" and self.cpu_offload), "--adapter qlora does not take --cpu-offload "
               "(its base is already 4-bit, and NF4 weights are not moved between host and device); use --adapter lora "
               "with --cpu-offload")
        require(not (self.activation_checkpointing and self.selective_checkpointing), "--activation-checkpointing "
                "recomputes whole layers and --selective-checkpointing the cheap part of each: turn one of them off")
        # the operator policy around a compiled layer is untried (a compile is minutes of C++ builds on the CPU
        # machines the suite runs on), so the pair is refused rather than left to do what it may
        require(not (self.compile and self.selective_checkpointing), "--selective-checkpointing does not take "
                "--compile yet; use --activation-checkpointing with --compile")
        require(self.min_params >= 1, f"--min-params must be at least 1, got {self.min_params}")
        require(self.memory_gb >= 0, f"--memory-gb must be >= 0, got {self.memory_gb}")
        require(self.memory_gb <= 2**20, f"--memory-gb must be at most {2**20} (a PiB), got {self.memory_gb:g}")
        # what a strategy accepts, and so --vocab-parallel on, is the strategies' to say (registry.check); --sharding
        # auto is resolved there (settle), never here


@dataclass
class OptimConfig(Section):
    lr: float = 2e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices only (not norms or biases)."""
    warmup_steps: int = 0
    """Linear warm-up steps before the schedule."""
    lr_schedule: Schedule = "cosine"
    """After warm-up: cosine or linear decay to zero, or constant."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    def check(self) -> None:
        # no upper bound: weights an lr or a decay too large breaks turn non-finite, which the step guard stops in
        # one line that names --lr
        require(self.lr > 0, f"--lr must be a positive number, got {self.lr}")
        require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        require(self.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        require(self.max_grad_norm >= 0, f"--max-grad-norm must be >= 0, got {self.max_grad_norm}")


@dataclass
class TrainConfig(Section):
    batch_size: int = 1
    """Blocks per process per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step; the global batch is world size x batch size x grad accum blocks."""
    num_epochs: int = 1
    """Passes over the training blocks."""
    max_steps: int = 0
    """Stop after this many optimizer steps (overrides num_epochs when > 0)."""
    log_freq: int = 10
    """Optimizer steps between log lines and metrics events."""
    ckpt_freq: int = 0
    """Optimizer steps between checkpoints (0: at each epoch's end instead); the run's end always has one."""
    ckpt_minutes: float = 30.0
    """Also checkpoint once this many minutes of wall time have passed since the last checkpoint (or the start), so a
    crash, an OOM or a lost node costs at most this much training whatever --ckpt-freq is; 0 turns it off."""
    eval_freq: int = 0
    """Optimizer steps between validations (0: only at the end)."""
    eval_base: bool = True
    """Validate the base model at step 0, before the first update (an eval event at step 0), so the run ends with
    `validation loss BASE -> FINAL (ppl A -> B)`; off skips its cost (one pass over the validation blocks)."""
    sample_prompts: str = ""
    """A JSONL file of prompts, one per line: {"prompt": TEXT}, or {"messages": [...]} rendered through the chat
    template. At every validation (step 0 with --eval-base, each --eval-freq, the end) the model completes each
    greedily, logged as a sample event in metrics.jsonl, TensorBoard's text tab and train.log."""
    sample_max_tokens: int = 32
    """--sample-prompts: the most tokens a completion has (it ends earlier at EOS or an end-of-turn token)."""
    lm_eval_tasks: str = ""
    """lm-evaluation-harness tasks, comma-separated (lm-eval's own names, or those of --lm-eval-include's YAMLs), run
    offline on the exported model at the end of the run (results in RUN/lm_eval.json). Needs `make lm-eval`; every
    task's data is checked to be on this machine before training starts."""
    lm_eval_include: str = ""
    """A folder of lm-eval task YAMLs (lm-eval's --include_path) that --lm-eval-tasks may name."""
    lm_eval_batch_size: int = 8
    """--lm-eval-tasks: requests lm-eval scores per forward."""
    keep_last: int = 2
    """Complete checkpoints to keep (at least 2, so the previous good one survives a failed save)."""
    max_bad_steps: int = 3
    """Stop the run after this many steps in a row with a non-finite loss or gradient norm (each one is skipped:
    nothing applied, nothing checkpointed); 0 never stops. Under --precision fp16 an overflow is not one of these
    (--max-overflow-steps)."""
    loss_scale: float = 65536.0
    """--precision fp16: the loss scale at the start. Dynamic: an overflow (a non-finite gradient) skips its step and
    halves it, 2000 steps without one double it (torch's GradScaler); it is saved in checkpoints."""
    max_overflow_steps: int = 30
    """--precision fp16: stop the run as diverging after this many overflowing steps in a row, or once the loss scale
    falls below 1 (fp16 cannot hold the run's values even unscaled)."""
    profile_from: int = 0
    """Profile rank 0's optimizer steps from this one on (0: off), --profile-steps of them, with torch.profiler:
    RUN/profile/profile.json holds the top kernels, the step split by kind of work (matmuls, attention, loss,
    optimizer, norms and elementwise, communication, host waits) and the memory at the first step's start and the
    peak; RUN/profile/trace.json.gz the Chrome trace. The device is synchronised around them, so their logging
    window's throughput reads a little lower, and its peak memory is the profiled steps' own (the peak restarts at
    the first)."""
    profile_steps: int = 3
    """--profile-from: how many steps to profile."""

    def check(self) -> None:
        for name in ("batch_size", "grad_accum", "num_epochs", "log_freq", "lm_eval_batch_size"):
            require(getattr(self, name) >= 1, f"{flag(name)} must be at least 1, "
                                             f"got {getattr(self, name)}")
        require(self.loss_scale >= 1, f"--loss-scale must be at least 1, got {self.loss_scale:g}")
        # the scale is an fp32 tensor (GradScaler) and multiplies the loss in fp32, whose largest value is 3.4e38
        require(self.loss_scale <= 2**64, f"--loss-scale must be at most 2^64 ({2**64:.4g}), got {self.loss_scale:g}")
        require(self.max_overflow_steps >= 1, f"--max-overflow-steps must be at least 1, got {self.max_overflow_steps}")
        require(self.profile_steps >= 1, f"--profile-steps must be at least 1, got {self.profile_steps}")
        for name in ("max_steps", "ckpt_freq", "eval_freq", "max_bad_steps", "profile_from"):
            require(getattr(self, name) >= 0, f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        require(self.keep_last >= 2, f"--keep-last must be at least 2, got {self.keep_last}")
        require(self.ckpt_minutes >= 0, f"--ckpt-minutes must be >= 0, got {self.ckpt_minutes:g}")
        require(self.ckpt_minutes <= YEAR_S / 60, f"--ckpt-minutes must be at most {YEAR_S / 60:g} (a year), got "
                                                  f"{self.ckpt_minutes:g}")
        require(self.sample_max_tokens >= 1, f"--sample-max-tokens must be at least 1, got {self.sample_max_tokens}")
        require(not self.sample_prompts or Path(self.sample_prompts).is_file(),
               f"--sample-prompts {self.sample_prompts} does not exist or is not a file")
        require(not self.lm_eval_include or Path(self.lm_eval_include).is_dir(),
               f"--lm-eval-include {self.lm_eval_include} is not a folder (of lm-eval task YAMLs)")
        require(not self.lm_eval_include or bool(self.lm_eval_tasks.strip(" ,")),
               f"--lm-eval-include {self.lm_eval_include} names no task to run; add --lm-eval-tasks T1,T2")


Objective = Literal["sft", "dpo", "ipo", "simpo", "orpo", "kto", "reward", "grpo"]


@dataclass
class ObjectiveConfig(Section):
    objective: Objective = "sft"
    """What the run trains for: sft (next-token loss on the targets of text and conversations), or, on a dataset of
    preference pairs, dpo, ipo (both against a reference: the base with the adapters off, or under full fine-tuning
    the base's log-probabilities computed once before the first step), simpo or orpo (no reference); kto on unpaired
    records (a completion labelled desirable or not) or on pairs (each answer a record, as TRL unpairs them),
    against a reference as dpo's; reward trains a reward model on pairs (the family's sequence-classification head,
    one score, the Bradley-Terry loss of TRL's RewardTrainer); grpo is online RL on a dataset of prompts (completions
    generated in the training processes, scored by --reward: pipeline/config_grpo.py)."""
    reference_model: str = ""
    """dpo, ipo, kto: the reference, when not the base: a Hub id or folder found as --model-name is (the SFT model a
    run aligns from), of the policy's architecture and vocabulary; its log-probabilities are computed once before
    the first step and kept beside the token cache."""
    pref_beta: float = 0.1
    """dpo, ipo, kto, simpo: beta, how far the policy may move from the reference (simpo: the reward scale)."""
    pref_label_smoothing: float = 0.0
    """dpo: the share of pairs assumed mislabelled (conservative DPO, cDPO); below 0.5."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin, divided by beta as TRL's simpo_gamma is."""
    orpo_lambda: float = 0.1
    """orpo: the weight of the odds-ratio term beside the chosen answer's negative log-likelihood."""
    kto_desirable_weight: float = 1.0
    """kto: the weight of a desirable completion's loss (TRL's desirable_weight); with fewer desirable than
    undesirable records, raise it so that their weighted counts are about even (KTO paper, eq. 8)."""
    kto_undesirable_weight: float = 1.0
    """kto: the weight of an undesirable completion's loss (TRL's undesirable_weight)."""
    center_rewards_coefficient: float = 0.0
    """reward: the weight of (r_chosen + r_rejected)^2 beside the Bradley-Terry loss, which keeps the rewards
    centred on 0 (TRL's center_rewards_coefficient; 0: off)."""

    ONLY = {"kto_desirable_weight": "kto", "kto_undesirable_weight": "kto", "center_rewards_coefficient": "reward"}
    """Fields of one objective, which a run's fingerprint holds only under it: a run from before they existed still
    resumes."""

    def check(self) -> None:
        # beta multiplies sums of log-probabilities (thousands) and divides simpo's gamma: neither may overflow
        in_range(self.pref_beta, 1e-6, 1e3, "pref_beta")
        require(0 <= self.pref_label_smoothing < 0.5,
               f"--pref-label-smoothing must be in [0, 0.5), got {self.pref_label_smoothing:g}")
        require(self.pref_label_smoothing == 0 or self.objective == "dpo",
               f"--pref-label-smoothing is for --objective dpo, not {self.objective}")
        in_range(self.simpo_gamma, 0, 1e3, "simpo_gamma")
        in_range(self.orpo_lambda, 1e-6, 1e3, "orpo_lambda")
        require(not self.reference_model or self.objective in ("dpo", "ipo", "kto"),
               f"--reference-model is for --objective dpo, ipo or kto, not {self.objective}")
        for name, objective in self.ONLY.items():
            in_range(getattr(self, name), 0, 1e3, name)
            require(getattr(self, name) == ObjectiveConfig.__dataclass_fields__[name].default
                   or self.objective == objective, f"{flag(name)} is for --objective {objective}, not {self.objective}")
        require(self.kto_desirable_weight > 0 or self.kto_undesirable_weight > 0,
               "--kto-desirable-weight and --kto-undesirable-weight are both 0: nothing would be trained")

    @property
    def preference(self) -> bool:
        return self.objective not in ("sft", "grpo")

    @property
    def unpairs(self) -> bool:
        """Whether it reads each answer of a pair as a record of its own (KTO), beside unpaired records."""
        return self.objective == "kto"

    @property
    def generates(self) -> bool:
        """Whether it trains on completions it generates (online RL), not on the token cache's blocks."""
        return self.objective == "grpo"

    @property
    def scores_answers(self) -> bool:
        """Whether its loss reads the model's log-probabilities of whole answers (any objective but sft's next-token
        loss), through the model's own head."""
        return self.objective != "sft"


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    @property
    def rollouts(self) -> Rollouts | None:
        """What the objective generates per prompt, where it generates (its micro-batch is then a batch of prompts
        times their completions); None for an objective over blocks."""
        return self.grpo.rollouts(self.model.adapter) if self.objective.generates else None

    @property
    def run_dir(self) -> Path:
        return Path(self.run.save_dir) / self.run.experiment_name

    @property
    def cache_root(self) -> Path:
        """The folder of token caches: --cache-dir, else SAVE_DIR/token_cache."""
        return Path(self.data.cache_dir) if self.data.cache_dir else Path(self.run.save_dir) / "token_cache"

    def flat(self) -> dict[str, Any]:
        """The resolved config as flat snake_case keys (the format of config files)."""
        return {k: v for section in dataclasses.asdict(self).values() for k, v in section.items()}


SECTIONS = {"run": RunConfig, "data": DataConfig, "model": ModelConfig, "optim": OptimConfig,
            "train": TrainConfig, "objective": ObjectiveConfig, "grpo": GRPOConfig}
