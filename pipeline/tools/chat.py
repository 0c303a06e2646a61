"""Try a model: generate replies through its chat template, offline, on the GPU when there is one, else the CPU.

    python -m pipeline.chat outputs/RUN/hf --prompt "What is 2 plus 3?"     # one reply, then exit
    python -m pipeline.chat outputs/RUN/hf                                   # interactive; an empty line ends it
    python -m pipeline.chat outputs/RUN/adapter --prompt "Hi"                # an adapter on its base model
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from pipeline.errors import ArgumentParser, UserError


def load(model_dir: Path):
    """(model, tokenizer) of a model folder (an export, or any Hugging Face folder) or of a PEFT adapter folder
    (RUN/adapter: its base model, resolved like --model-name, with the adapter on it), ready to generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = (model_dir / "adapter_config.json").exists()
    if not adapter and not (model_dir / "config.json").exists():
        raise UserError(f"{model_dir} is not a model folder (no config.json) nor an adapter folder (no "
                        "adapter_config.json); pass RUN/hf, RUN/adapter or RUN/best")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise UserError(f"{model_dir} has no chat template; train with --chat-template FILE.jinja (it is exported "
                        "with the model) or use an Instruct model")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _with_adapter(model_dir) if adapter else AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    return model.to(device).eval(), tokenizer


def _with_adapter(adapter_dir: Path):
    """The base model an adapter folder names (a hub id in the offline cache, or a folder), the adapter on it."""
    import json
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.prep.hub import resolve_model_dir

    base = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(base), dtype="auto")
    with warnings.catch_warnings():  # peft asks transformers a deprecated question (is_gradient_checkpointing)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return PeftModel.from_pretrained(model, adapter_dir)


@torch.inference_mode()
def reply(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float, date: str) -> str:
    """The assistant's next turn after messages; generation stops at the model's end-of-turn or EOS tokens
    (generation_config.json) or after max_new_tokens."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True, date_string=date).to(model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def _lines():
    """The user's messages: typed at a prompt, or piped in one per line."""
    if not sys.stdin.isatty():
        yield from sys.stdin
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description="Chat with a trained model through its chat template.")
    p.add_argument("model_dir", type=Path, help="a model folder (RUN/hf, RUN/best, any Hugging Face folder) or an "
                   "adapter folder (RUN/adapter)")
    p.add_argument("--prompt", help="one user message: print the reply and exit (default: interactive)")
    p.add_argument("--system", help="a system message before the conversation")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy, reproducible")
    p.add_argument("--chat-date", default="26 Jul 2024", help="the date templates that print one are given")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0:
        raise UserError("--max-new-tokens must be >= 1 and --temperature >= 0")
    model, tokenizer = load(args.model_dir)
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        history.append({"role": "user", "content": args.prompt})
        print(reply(model, tokenizer, history, args.max_new_tokens, args.temperature, args.chat_date))
        return 0
    print(f"chatting with {args.model_dir} (an empty line or end of input ends)", file=sys.stderr)
    for line in _lines():
        if not line.strip():
            break
        history.append({"role": "user", "content": line.strip()})
        answer = reply(model, tokenizer, history, args.max_new_tokens, args.temperature, args.chat_date)
        history.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
    return 0
