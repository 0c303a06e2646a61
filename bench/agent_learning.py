"""Agents learn by acting: GRPO with --environment against the same run without the tool (issue 78's learning proof).

Section `agent_learning`. A tiny ChatML model (2 layers, hidden 64, Qwen 3's template, the bundled corpus's byte-level
tokenizer) is taught by chat SFT two answers to "What is the secret?": half its conversations call the tool
`reveal` and answer with its result (4 secrets), half say "I do not know.". The prompts' secrets are a column the
prompt does not show; the environment (one instance per rollout) holds its row's and `reveal` is its method. The
reward `told` is 1 where the last assistant turn is the row's secret, which only the tool's answer gives. GRPO runs
with the environment, and again without it (the control: the prompt renders no tool, and nothing answers a call).
Figures: the mean reward over the first and the last 5 steps of each run, and the share of completions that call.

    .venv/bin/python bench/agent_learning.py    # rewrites BENCHMARKS.md's agent_learning section (about 4 minutes)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

from common import ROOT, bench_env, launch, machine, table, update_section

REVEAL = {"type": "function", "function": {"name": "reveal", "description": "This conversation's secret.",
                                           "parameters": {"type": "object", "properties": {}},
                                           "return": {"type": "string"}}}
SECRETS = ["17", "42", "63", "88"]
ENVIRONMENT = '''
class Secret:
    """The row's secret, which the prompt does not show: reveal tells it."""

    def __init__(self):
        self.secret = ""

    def reset(self, secret, **row):
        self.secret = secret

    def reveal(self) -> str:
        """This conversation's secret."""
        return self.secret
'''
REWARD = '''
def told(prompts, completions, completion_ids, secret, **columns):
    return [float(c[-1]["content"].strip() == s) for c, s in zip(completions, secret)]
'''
WINDOW = 5


def build(work: Path) -> Path:
    """The tiny ChatML model, the chats and prompts datasets, the environment and reward files; the model's folder."""
    from transformers import GenerationConfig

    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.prep.tiny import DEFAULT_CORPUS, corpus_texts, save_random, tiny_config, train_tokenizer

    tok = train_tokenizer(corpus_texts(DEFAULT_CORPUS), 1024)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (ROOT / "examples" / "templates" / "qwen3.jinja").read_text()
    config = tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id, tied=True, layers=2, hidden=64)
    model = save_random(work / "model", config, tok, 0)
    GenerationConfig(bos_token_id=tok.bos_token_id,
                     eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]).save_pretrained(model)
    user = {"role": "user", "content": "What is the secret?"}
    chats = []
    for i in range(64):
        secret, called = SECRETS[i % len(SECRETS)], i % 2 == 0
        turns = [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "reveal", "arguments": {}}}]},
            {"role": "tool", "name": "reveal", "content": secret}, {"role": "assistant", "content": secret}] \
            if called else [{"role": "assistant", "content": "I do not know."}]
        chats.append({"messages": [user, *turns], "tools": [REVEAL]})
    draw = random.Random(0)
    prompts = [{"prompt": [user], "secret": draw.choice(SECRETS)} for _ in range(64)]
    for name, rows in (("chats", chats), ("prompts", prompts)):
        (work / name).mkdir(exist_ok=True)
        (work / name / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        build_dataset(CorpusConfig(work / name, work / f"{name}-ds", num_proc=1, overwrite=True))
    (work / "env.py").write_text(ENVIRONMENT)
    (work / "rewards.py").write_text(REWARD)
    return model


def run(work: Path, name: str, *flags: object) -> list[dict]:
    """One fsdp1.py run in one process on the demo config; its train events."""
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "fsdp1.py"), "-e", name, "--save-dir", work / "runs", "--config",
           ROOT / "configs" / "demo.yaml", "--log-freq", 1, "--eval-freq", 0, "--ckpt-freq", 0, *flags]
    launch([str(c) for c in cmd], bench_env(), timeout=1800)
    from pipeline.train.telemetry import read_metrics

    return [e for e in read_metrics(work / "runs" / name / "metrics.jsonl") if e["event"] == "train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "agent")
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=40, help="GRPO steps of each run")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = args.workdir
    model = build(work)
    run(work, "sft", "-d", work / "chats-ds", "-m", model, "--max-steps", args.sft_steps, "--lr", 1e-2, "-b", 8,
        "--seq-length", 1024)
    grpo = ["-d", work / "prompts-ds", "-m", work / "runs" / "sft" / "hf", "--objective", "grpo",
            "--num-generations", 4, "-b", 8, "--max-completion-length", 192, "--max-steps", args.steps, "--lr", 3e-4,
            "--temperature", 0.5, "--warmup-steps", 0, "--lr-schedule", "constant",
            "--reward", f"{work / 'rewards.py'}:told"]
    runs = {"with the environment (reveal)": run(work, "agent", *grpo, "--environment", f"{work / 'env.py'}:Secret"),
            "control: no tool": run(work, "control", *grpo)}
    rows, rises = [], {}
    for name, train in runs.items():
        rewards = [e["rewards/told/mean"] for e in train]
        first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
        rises[name] = last - first
        calls = [e.get("tools/call_frequency") for e in train]
        shown = "-" if calls[0] is None else \
            f"{sum(calls[:WINDOW]) / WINDOW:.2f} -> {sum(calls[-WINDOW:]) / WINDOW:.2f}"
        rows.append([name, f"{first:.3f}", f"{last:.3f}", f"{last - first:+.3f}", shown,
                     " ".join(f"{r:.2f}" for r in rewards)])
        print(name, rows[-1], flush=True)
    body = "\n".join([
        f"`.venv/bin/python bench/agent_learning.py --sft-steps {args.sft_steps} --steps {args.steps}` on "
        f"{machine()}.",
        "",
        f"The tiny ChatML model after {args.sft_steps} steps of chat SFT (half its conversations call `reveal` and "
        "answer with its result), then GRPO on 64 prompts \"What is the secret?\" whose secrets (4 values) are a "
        f"column the prompt does not show: {args.steps} steps of 8 prompts x 4 completions, temperature 0.5, lr 3e-4, "
        "dapo, one process. The reward `told` is 1 where the last assistant turn is the row's secret.",
        "",
        table(["run", f"reward, first {WINDOW} steps", f"reward, last {WINDOW} steps", "rise",
               "completions that call", "reward at each step"], rows),
        "",
        f"With the environment the reward rises by {rises['with the environment (reveal)']:+.3f}; without the tool "
        f"by {rises['control: no tool']:+.3f}. The rise comes from calling (the share of completions that call "
        "grows); what bounds it is how often the tiny model copies the tool's answer right.",
    ])
    update_section("agent_learning", body)


if __name__ == "__main__":
    main()
