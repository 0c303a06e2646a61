"""The TRL side of bench/chat_speed.py, launched under torchrun: SFTTrainer on the same conversations, model, batch
(blocks per rank), block length, AdamW, lr schedule, clipping and precision as our chat run, with packing (TRL's
best-fit decreasing, padding-free) and assistant-only loss.

TRL finds assistant tokens through `{% generation %}` markers, so it is given the model's template with markers
added around each answer and its end-of-turn token: it renders the same text. Before training, rank 0 checks our
masks against TRL's on every conversation, and the first batch's loss both ways: TRL's compute_loss on its own
first batch, and our loss (pipeline/model/loss.py) on the same conversations with our masks and our packing.
Rank 0 writes {"step_end": [...], "targets_per_row", "mask_mismatches", "first_loss": {"trl", "ours"}} to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

from pipeline.data import packing
from pipeline.data.batches import count_targets, make_batch
from pipeline.data.chat_tokens import tokenize_conversation
from pipeline.model.head import Head
from pipeline.objectives.causal_lm import CausalLMLoss

MARKED = {
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}":
        "'' }}{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}",
}
"""The tiny model's template (pipeline/prep/tiny.py) with generation markers: the same text, TRL's way of masking."""


def marked(template: str) -> str:
    for old, new in MARKED.items():
        if old not in template:
            raise SystemExit("the model's chat template is not pipeline.prep.tiny's: add its generation markers here")
        template = template.replace(old, new)
    return template


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.time())


def check_masks(ours_tok, trl_tok, conversations: list, date: str) -> int:
    """Conversations whose ids or assistant mask differ between ours (the model's template, no markers) and
    transformers' (TRL's, through the marked template)."""
    bad = 0
    for messages in conversations:
        ours = tokenize_conversation(ours_tok, messages, date, "assistant")
        ref = trl_tok.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True,
                                          date_string=date)
        bad += ours.ids.tolist() != ref["input_ids"] or ours.trained.astype(int).tolist() != ref["assistant_masks"]
    return bad


def first_losses(trainer: SFTTrainer, tokenizer, by_ids: dict, seq: int) -> dict:
    """TRL's loss on its first batch, and ours on the same conversations (our masks, our packing)."""
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, dict(batch)).item()  # a copy: compute_loss may pop keys we read next
        ids, pos = batch["input_ids"][0].tolist(), batch["position_ids"][0].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        rendered = [by_ids[tuple(ids[a:b])] for a, b in zip(starts, starts[1:], strict=False)]
        blocks, flags = packing.pack([r.ids for r in rendered], [r.trained for r in rendered], seq,
                                     tokenizer.eos_token_id)
        ours = CausalLMLoss(Head(model, False, 1))(make_batch(blocks, flags, torch.device("cpu")),
                                             count_targets(blocks, flags)).item()
    return {"trl": trl_loss, "ours": ours, "conversations": len(rendered)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True, help="a DATA-HF dataset of conversations")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--chat-date", default="26 Jul 2024")
    args = p.parse_args()
    ours_tok = AutoTokenizer.from_pretrained(args.model)  # the model's own template, as fsdp1.py renders it
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = marked(tokenizer.chat_template)
    ds = load_from_disk(args.dataset).select_columns(["messages"])
    ds = ds.filter(lambda row: len(row["messages"]) > 0)
    # TRL passes a row's chat_template_kwargs to apply_chat_template: the date pinned as fsdp1.py's --chat-date does
    ds = ds.map(lambda _: {"chat_template_kwargs": {"date_string": args.chat_date}})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    config = SFTConfig(
        output_dir=str(args.out.parent / "trl_out"), per_device_train_batch_size=args.batch_size,
        max_length=args.seq, packing=True, assistant_only_loss=True, max_steps=args.max_steps, learning_rate=3e-4,
        warmup_steps=5, lr_scheduler_type="cosine", adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
        weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, ddp_backend="gloo", optim="adamw_torch", report_to=[],
        # TRL's configs default to bf16 autocast and gradient checkpointing: fp32 and none, as our run
        bf16=False, gradient_checkpointing=False,
        save_strategy="no", eval_strategy="no", logging_steps=10**9, disable_tqdm=True, seed=0,
        dataset_num_proc=1, dataloader_num_workers=0)
    timer = StepTimes()
    trainer = SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tokenizer, callbacks=[timer])
    conversations = ds["messages"]
    by_ids = {}
    for messages in conversations:
        r = tokenize_conversation(ours_tok, messages, args.chat_date, "assistant")
        by_ids[tuple(r.ids.tolist())] = r
    # on every rank: TRL's compute_loss gathers its metrics over the ranks (a collective)
    result = {"first_loss": first_losses(trainer, tokenizer, by_ids, args.seq * args.batch_size)}
    if trainer.args.process_index == 0:
        result["mask_mismatches"] = check_masks(ours_tok, tokenizer, conversations, args.chat_date)
        result["conversations"] = len(conversations)
        rows = trainer.train_dataset  # packed rows; labels are -100 where a token is not in the loss
        result["targets_per_row"] = float(np.mean([sum(t != -100 for t in labels) for labels in rows["labels"]]))
        result["tokens_per_row"] = float(np.mean([len(x) for x in rows["input_ids"]]))
    trainer.train()
    if trainer.args.process_index == 0:
        result["step_end"] = timer.times
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
