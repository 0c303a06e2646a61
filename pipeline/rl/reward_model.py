"""A reward model as a GRPO reward (`--reward MODEL_FOLDER[:WEIGHT]`, as TRL takes a model id): the folder a run of
--objective reward exported (or any model transformers loads with AutoModelForSequenceClassification and one
output), scored in the training processes on each rank's own completions.

Each completion is scored as the reward model was trained to score an answer: a standard prompt's text followed by
the completion, without special tokens added; a conversational prompt's messages with the completion as the
assistant's turn, through the reward model's own chat template. The score is the model's one output at the last
token (AutoModelForSequenceClassification's pooling). The model stays resident on each rank beside the policy, not
sharded: its memory is its weights in the compute dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import UserError

SCORE_ROWS = 16
"""Completions scored per forward: the reward model's activations stay those of a small batch."""


def is_model_folder(name: str) -> bool:
    """Whether a --reward entry names a model (a folder with config.json, or a Hub id ORG/NAME) rather than a file or a
    built-in."""
    return (Path(name) / "config.json").exists() or ("/" in name and not name.endswith(".py") and ".py:" not in name
                                                      and not Path(name).exists())


def model_name(name: str) -> str:
    """A reward model's name in the metrics (rewards/NAME/mean): its folder's name (a run's export RUN/hf: RUN_hf),
    or its Hub id with "/" as "_"."""
    path = Path(name)
    if not path.is_dir():
        return name.replace("/", "_")
    path = path.resolve()
    return f"{path.parent.name}_{path.name}" if path.name == "hf" else path.name


class RewardModelFn:
    """A reward model folder as a reward function of TRL's signature. Loaded by place(), on the rank's device."""

    def __init__(self, name: str, chat_date: str = ""):
        from transformers import AutoConfig

        from pipeline.model.reward_head import is_reward_model
        from pipeline.model.weight_check import unchanged_weights, weights_digest
        from pipeline.prep.hub import resolve_model_dir

        self.name, self.chat_date = name, chat_date
        self.model_dir = resolve_model_dir(name, "--reward")
        config = AutoConfig.from_pretrained(self.model_dir)
        if not is_reward_model(config) or getattr(config, "num_labels", 1) != 1:
            raise UserError(f"--reward {name} is not a reward model (a sequence classifier with one output, as "
                            "--objective reward exports to RUN/hf); give FILE.py:FUNCTION, a built-in, or a reward "
                            "model folder")
        self.digest = weights_digest(unchanged_weights(self.model_dir, name))
        self.__name__ = model_name(name)
        self.model = self.tokenizer = None
        self.limit = getattr(config, "max_position_embeddings", None)

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Load the model on this rank's device (eval mode, no gradient) and its tokenizer."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.model_dir, dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)

    def text(self, prompt: str | list, completion: str | list) -> str:
        if isinstance(prompt, str):
            return prompt + (completion if isinstance(completion, str) else completion[-1]["content"])
        from pipeline.data.chat_render import render

        if not self.tokenizer.chat_template:
            raise UserError(f"--reward {self.name} has no chat template to render the conversational prompts with")
        answer = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        return render(self.tokenizer, [*prompt, *answer], self.chat_date)

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, completion_ids: list, **columns) -> list[float]:
        if self.model is None:
            raise RuntimeError("RewardModelFn.place() was not called")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for a in range(0, len(completions), SCORE_ROWS):
            rows = [self.tokenizer(self.text(p, c), add_special_tokens=False)["input_ids"][-(self.limit or 1 << 30):]
                    for p, c in zip(prompts[a:a + SCORE_ROWS], completions[a:a + SCORE_ROWS], strict=True)]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r, dtype=torch.long), 1
            # the score at each row's last real token, read by position (the model's own pooling looks for the pad
            # token's id, which a row's text may hold)
            hidden = self.model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            last = (mask.sum(-1) - 1).to(device)
            values = self.model.score(hidden[torch.arange(len(rows), device=device), last])
            scores += values[:, 0].float().tolist()
        return scores
