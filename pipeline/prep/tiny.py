"""The bundled tiny Llama for the demo and the tests: random weights, a byte-level BPE trained on a corpus.

    python -m pipeline.tiny --out DIR [--corpus examples/raw] [--tied|--untied] [--layers 2] [--hidden 64] [--seed 0]
    python -m pipeline.tiny --out DIR --preset llama-3.2-1b      # a real model's shape, for benchmarks
    python -m pipeline.tiny --out DIR --family mixtral           # another family in miniature (FAMILIES)

The weights are random: the model exists to exercise every code path (sharded loading, tied embeddings, training,
checkpoints, export) on a CPU in seconds, not to produce useful text. Deterministic given the arguments (a preset
is initialised on the GPU when there is one, whose random numbers differ from the CPU's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast

from pipeline.errors import ArgumentParser, UserError
from pipeline.prep.conversations import Chat
from pipeline.prep.extract import SUPPORTED, Row, SkipFile, extract_file, strings_in
from pipeline.prep.preferences import Pair

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
HEADER = ("<|start_header_id|>", "<|end_header_id|>")
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if date_string is not defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}"
    "{%- endif %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}\n"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)
"""Llama 3.1/3.2 Instruct's chat format: a system header with today's date (pinned by passing date_string), each turn
between header tokens and closed by <|eot_id|>."""
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "examples" / "raw"


def corpus_texts(corpus: Path) -> list[str]:
    """Every extractable text of the corpus in path order (bad files are skipped, as DATA-HF would)."""
    texts = []
    for path in sorted(p for p in corpus.rglob("*") if p.suffix.lower() in SUPPORTED and p.is_file()):
        try:
            rows = extract_file(path).rows
        except (SkipFile, OSError):
            continue
        texts.extend(map(row_text, rows))
    if not texts:
        raise UserError(f"--corpus {corpus} holds no usable text to train a tokenizer on")
    return texts


def row_text(row: Row) -> str:
    """The text a row of the corpus holds, one piece a line: text as it is; a conversation's messages; a preference
    record's prompt and answers (both of a pair, a KTO record's one); a prompt record's prompt and the strings of its
    other keys (a reference answer)."""
    if isinstance(row, str):
        return row
    if isinstance(row, Chat):
        return "\n".join(m["content"] for m in row.messages)
    if isinstance(row, Pair):
        messages, pieces = [*row.prompt_messages, *row.chosen, *row.rejected], [row.prompt_text]
    else:
        messages, pieces = row.prompt_messages, [row.prompt_text, *strings_in(json.loads(row.columns))]
    return "\n".join(piece for piece in (*pieces, *(m["content"] for m in messages)) if piece)


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Llama 3's special-token names and chat template; BOS is prepended on encode, as Llama 3
    does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, EOT, *HEADER], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, model_max_length=2048,
                                   chat_template=CHAT_TEMPLATE)


def tiny_config(vocab_size: int, bos_id: int, eos_id: int, *, tied: bool, layers: int, hidden: int) -> LlamaConfig:
    """Llama 3 shape in miniature: grouped-query attention (2 KV heads for 4 query heads), rope theta 500k."""
    heads = max(2, hidden // 16)
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8 or 8,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=tied,
        bos_token_id=bos_id, eos_token_id=eos_id, dtype="float32",
    )


PRESETS = {
    "llama-3.2-1b": {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "dtype": "bfloat16",
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    "llama-3.1-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "dtype": "bfloat16",
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    "smollm2-135m": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "dtype": "bfloat16",
    },
}
"""Configs of real models (meta-llama/Llama-3.2-1B's, Llama-3.1-8B's and HuggingFaceTB/SmolLM2-135M's
config.json), whose shapes the benchmarks train: the tokenizer's ids are a subset of the vocabulary."""


FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "phi3": ("Phi3Config", {}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                                "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                                    "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    # the families of 2026: per-layer head sizes and a per-layer embedding (Gemma 4), chunked and NoPE attention
    # with a shared expert (Llama 4), linear attention (Qwen 3.5), MLA with dense first layers (DeepSeek-V3), ...
    "gemma4": ("Gemma4TextConfig", {"head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 1024,
                                    "final_logit_softcapping": 30.0, "tie_word_embeddings": True}),
    "llama4": ("Llama4TextConfig", {"head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 128,
                                    "num_local_experts": 4, "num_experts_per_tok": 2, "interleave_moe_layer_step": 2,
                                    "no_rope_layer_interval": 2, "attention_chunk_size": 8}),
    "qwen3_5": ("Qwen3_5TextConfig", {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                                      "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                      "linear_num_key_heads": 4, "linear_num_value_heads": 8}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                                             "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                             "linear_num_key_heads": 4, "linear_num_value_heads": 8, "num_experts": 4,
                                             "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                             "shared_expert_intermediate_size": 32}),
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 32, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                                         "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 16, "v_head_dim": 16}),
    "glm4_moe": ("Glm4MoeConfig", {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                   "use_qk_norm": True}),
    "olmo3": ("Olmo3Config", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    "ministral3": ("Ministral3Config", {"head_dim": 16, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}}),
}
"""The families the suite trains (README, "Model families"), as transformers' config class and what each needs
beyond the common miniature shape (family_config): what sets the family apart is kept (Gemma's scaled embedding and
soft-capping, sliding windows, QK norms, 4 experts of which 2 per token)."""


def one_of(name: str, value: str, allowed: list[str]) -> None:
    """A flag's value among its choices, else one line (as fsdp1.py's flags say it), never argparse's usage block."""
    if value not in allowed:
        raise UserError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def family_config(family: str, vocab_size: int, bos_id: int, eos_id: int) -> PretrainedConfig:
    """A 2-layer, hidden-64 config of a family of FAMILIES (grouped-query attention: 4 heads, 2 KV heads)."""
    one_of("--family", family, list(FAMILIES))
    config_class, extra = FAMILIES[family]
    common = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
              "dtype": "float32"}
    return getattr(transformers, config_class)(**{**common, **extra})


def build_family(out: Path, family: str, corpus: Path = DEFAULT_CORPUS, *, seed: int = 0) -> Path:
    """A tiny random-weight model of a family, saved as save_pretrained saves it, with the bundled tokenizer."""
    tokenizer = train_tokenizer(corpus_texts(corpus), 1024)
    config = family_config(family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    return save_random(out, config, tokenizer, seed)


def build_preset(out: Path, preset: str, corpus: Path = DEFAULT_CORPUS, *, seed: int = 0) -> Path:
    """A random-weight model with a preset's real config, in its file dtype, and the bundled tokenizer; returns out.
    Built on the GPU when there is one (a 1B model's random init takes minutes on two CPU cores)."""
    one_of("--preset", preset, sorted(PRESETS))
    tokenizer = train_tokenizer(corpus_texts(corpus), 1024)
    config = LlamaConfig(**PRESETS[preset], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return save_random(out, config, tokenizer, seed, "cuda" if torch.cuda.is_available() else "cpu")


def build_tiny(out: Path, corpus: Path = DEFAULT_CORPUS, *, tied: bool = True, layers: int = 2, hidden: int = 64,
               seed: int = 0, vocab_size: int = 1024, model_vocab: int | None = None) -> Path:
    """Write a tokenizer and a random-weight LlamaForCausalLM (safetensors) to out; returns out.

    model_vocab: rows of the embedding when larger than the tokenizer (Llama 3's 128,256 for benchmarks: the
    tokenizer's ids are a subset)."""
    if layers < 1 or hidden < 16 or hidden % 16:
        raise UserError(f"--layers must be >= 1 and --hidden a multiple of 16 (>= 16), got {layers} and {hidden}")
    tokenizer = train_tokenizer(corpus_texts(corpus), vocab_size)
    config = tiny_config(model_vocab or len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                         tied=tied, layers=layers, hidden=hidden)
    return save_random(out, config, tokenizer, seed)


def random_buffers(model: torch.nn.Module) -> None:
    """The persistent buffers (in the weight files: Gemma 4's layer scalars, a router's score bias) set to random
    values in [0.5, 1.5), as a real checkpoint holds values of its own: a loader or an export that dropped them would
    then show, where their initial values (ones, zeros) could be reproduced by chance."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in model.state_dict():
                buffer.copy_(torch.rand(buffer.shape) + 0.5)


def save_random(out: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerFast, seed: int,
                device: str = "cpu") -> Path:
    """The causal LM of config with seeded random weights in the config's dtype, and the tokenizer, saved to
    out (safetensors); returns out."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    random_buffers(model)
    # an Instruct model ends its turns with <|eot_id|>: generation stops there as well as at EOS
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(EOT)]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description="Build the tiny random-weight Llama used by the demo and tests.")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="text to train the tokenizer on")
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=True, help="tie embeddings (default)")
    tie.add_argument("--untied", dest="tied", action="store_false", help="separate lm_head")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a real model's config instead of the tiny one (--layers, --hidden and --tied ignored)")
    p.add_argument("--family", choices=list(FAMILIES), default=None,
                   help="a tiny model of another family (2 layers, hidden 64; --layers, --hidden, --tied ignored)")
    args = p.parse_args(argv)  # a value outside the choices: one line (errors.ArgumentParser)
    if not args.corpus.is_dir():
        raise UserError(f"--corpus {args.corpus} does not exist or is not a directory")
    if args.family:
        out = build_family(args.out, args.family, args.corpus, seed=args.seed)
        print(f"tiny {args.family} (random weights) written to {out}")
        return 0
    if args.preset:
        out = build_preset(args.out, args.preset, args.corpus, seed=args.seed)
        print(f"{args.preset} shape (random weights) written to {out}")
        return 0
    out = build_tiny(args.out, args.corpus, tied=args.tied, layers=args.layers, hidden=args.hidden, seed=args.seed)
    print(f"tiny Llama ({'tied' if args.tied else 'untied'}, {args.layers} layers, hidden {args.hidden}, random "
          f"weights) written to {out}")
    return 0
