"""Try a model: generate replies through its chat template, offline, on the GPU when there is one, else the CPU.

    python -m pipeline.chat outputs/RUN/hf --prompt "What is 2 plus 3?"     # one reply, then exit
    python -m pipeline.chat outputs/RUN/hf                                   # interactive; an empty line ends it
    python -m pipeline.chat outputs/RUN/adapter --prompt "Hi"                # an adapter on its base model

A model with no chat template, or one this pipeline trained on plain text only (its export's mark says so), has not
learned chat turns: it would answer with an empty line. It continues the prompt as text instead, saying so in one
line (`--mode chat` or `--mode text` decides).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from pipeline.errors import ArgumentParser, UserError
from pipeline.model.reward_head import is_reward_model
from pipeline.model.weight_files import read_index
from pipeline.ownership import read_mark


def base_folder(model_dir: Path) -> tuple[Path, bool]:
    """(the folder whose config and weights are the model's, whether model_dir is an adapter folder on it), checked:
    an adapter's base is the one it was trained on (eval/adapter_folder.base_dir)."""
    from pipeline.eval.adapter_folder import base_dir

    if (model_dir / "adapter_config.json").exists():
        config = json.loads((model_dir / "adapter_config.json").read_text(encoding="utf-8"))
        if config.get("task_type") == "SEQ_CLS":  # a reward model's adapter: on a causal LM it would babble
            raise UserError(f"{model_dir} is a reward model's adapter: it scores text and does not generate")
        return base_dir(model_dir, config.get("base_model_name_or_path") or ""), True
    if not (model_dir / "config.json").exists():
        raise UserError(f"{model_dir} is not a model folder (no config.json) nor an adapter folder (no "
                        "adapter_config.json); pass RUN/hf, RUN/adapter or RUN/best")
    return model_dir, False


def positions(config) -> int | None:
    """The most positions the model was built for (max_position_embeddings), None where its config does not say."""
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def choose_mode(model_dir: Path, tokenizer, asked: str) -> tuple[str, str]:
    """("chat" or "text", the one line saying why text was chosen, or ""): auto is chat unless the model has no chat
    template or was trained on plain text only."""
    if asked == "chat" and not tokenizer.chat_template:
        raise UserError(f"{model_dir} has no chat template; train with --chat-template FILE.jinja (it is exported "
                        "with the model), use an Instruct model, or drop --mode chat to continue text")
    if asked != "auto":
        return asked, ""
    if not tokenizer.chat_template:
        return "text", (f"note: {model_dir} has no chat template, so it has not learned chat turns: each message is "
                        "continued as text")
    if read_mark(model_dir).get("trained_on") == "text":
        return "text", (f"note: {model_dir} was fine-tuned on plain text, not conversations: each message is "
                        "continued as text (--mode chat uses its chat template anyway)")
    return "chat", ""


def load(model_dir: Path, folder: Path, adapter: bool):
    """The model in folder (an export, or any Hugging Face folder), with model_dir's adapter on it when adapter,
    on the GPU when there is one, ready to generate."""
    import warnings

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    if adapter:
        from peft import PeftModel

        with warnings.catch_warnings():  # peft asks transformers a deprecated question (is_gradient_checkpointing)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, model_dir)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


@torch.inference_mode()
def reply(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float, date: str,
          mode: str = "chat") -> str:
    """The assistant's next turn after messages (mode chat), or the continuation of the last message's text (mode
    text); generation stops at the model's end-of-turn or EOS tokens (generation_config.json), after
    max_new_tokens, or at the model's last position."""
    if mode == "chat":
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True, date_string=date)
    else:
        inputs = tokenizer(messages[-1]["content"], return_tensors="pt")
    inputs = inputs.to(model.device)
    if (limit := positions(model.config)) is not None:  # never past the positions the model was trained for
        room = limit - inputs["input_ids"].shape[1]
        if room < 1:
            raise UserError(f"the conversation is {inputs['input_ids'].shape[1]} tokens, at the model's limit of "
                            f"{limit} positions; start a new chat")
        max_new_tokens = min(max_new_tokens, room)
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""What a folder holds when it has a tokenizer AutoTokenizer can load (one of them at least)."""


def check_readable(model_dir: Path, folder: Path) -> None:
    """A tokenizer beside the model, and weight files whose headers and sizes are whole, before any weight is read:
    one line each instead of transformers' traceback. folder: where the weights are (an adapter's base)."""
    if not any((model_dir / name).exists() for name in TOKENIZER_FILES):
        raise UserError(f"{model_dir} has no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}): an export writes one "
                        "beside the weights; copy the base model's tokenizer files there, or export the run again")
    read_index(folder)  # a truncated or damaged shard is one line naming it


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig, AutoTokenizer

    p = ArgumentParser(description="Chat with a trained model through its chat template.")
    p.add_argument("model_dir", type=Path, help="a model folder (RUN/hf, RUN/best, any Hugging Face folder) or an "
                   "adapter folder (RUN/adapter)")
    p.add_argument("--prompt", help="one user message: print the reply and exit (default: interactive)")
    p.add_argument("--system", help="a system message before the conversation")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy, reproducible")
    p.add_argument("--chat-date", default="26 Jul 2024", help="the date templates that print one are given")
    p.add_argument("--mode", choices=("auto", "chat", "text"), default="auto", help="chat: through the chat "
                   "template; text: continue each message as text; auto (default): chat, unless the model has no "
                   "template or was fine-tuned on plain text only")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.temperature <= 100:  # nan and inf too: sampling divides the logits by it
        raise UserError(f"--temperature must be in [0, 100], got {args.temperature}")
    folder, adapter = base_folder(args.model_dir)
    config = AutoConfig.from_pretrained(folder)
    if is_reward_model(config):  # loaded as a causal LM its missing head would be random: babble, not an answer
        raise UserError(f"{args.model_dir} is a reward model ({config.architectures[0]}): it scores text and does not "
                        f"generate; score pairs with python -m pipeline.evaluate {args.model_dir} -d PAIRS")
    limit = positions(config)
    if limit is not None and args.max_new_tokens >= limit:  # before any weight is read
        raise UserError(f"--max-new-tokens {args.max_new_tokens} is beyond what {args.model_dir} can generate: it has "
                        f"{limit} positions in all, the prompt included")
    check_readable(args.model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    mode, why = choose_mode(args.model_dir, tokenizer, args.mode)
    if why:
        print(why, file=sys.stderr)
    model = load(args.model_dir, folder, adapter)
    history = [{"role": "system", "content": args.system}] if args.system and mode == "chat" else []
    lines = [args.prompt] if args.prompt is not None else _lines()
    if args.prompt is None:
        print(f"chatting with {args.model_dir} (an empty line or end of input ends)", file=sys.stderr)
    for line in lines:
        if not line.strip():
            break
        history.append({"role": "user", "content": line.strip()})
        answer = reply(model, tokenizer, history, args.max_new_tokens, args.temperature, args.chat_date, mode)
        history.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
        if not answer and mode == "chat":
            print("note: an empty reply: the model ended its turn at once, so it has not learned to answer in chat "
                  "turns yet (train it more, or on conversations); --mode text continues the message as text",
                  file=sys.stderr, flush=True)
    return 0
