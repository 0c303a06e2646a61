"""A reward model as a GRPO reward (`--reward MODEL_FOLDER[:WEIGHT]`, as TRL takes a model id): the folder a run of
--objective reward exported (or any model transformers loads with AutoModelForSequenceClassification and one
output), scored in the training processes on each rank's own completions.

Each completion is scored as --objective reward trained the model to score an answer (pair_tokens.tokenize_pair):
a standard prompt as BOS, its text, the completion and EOS; a conversational prompt's messages with the completion as
the assistant's turn, through the reward model's own chat template. The score is the model's one output at the last
token (AutoModelForSequenceClassification's pooling); a conversation the template cannot render gets none. The
model stays resident on each rank beside the policy, not sharded: its memory is its weights in the compute dtype.
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


def _num_params(config) -> int:
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return sum(p.numel() for p in model.parameters())


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
        self.num_params = _num_params(config)
        """Its parameters, counted on the meta device: the memory estimate holds them in the compute dtype."""
        self.model = self.tokenizer = None
        self.limit = getattr(config, "max_position_embeddings", None)

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Load the model on this rank's device (eval mode, no gradient) and its tokenizer."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.model_dir, dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)

    def ids(self, prompt: str | list, completion: str | list) -> list[int] | None:
        """The tokens the reward model scores, built as --objective reward built each answer it trained on
        (pipeline/data/pair_tokens.tokenize_pair: a standard prompt's BOS, text and the completion then EOS; a
        conversation through the chat template); None where the template cannot render it (no score: abstains)."""
        from pipeline.data import chat_tokens
        from pipeline.data.pair_tokens import tokenize_pair
        from pipeline.prep.conversations import BadConversation

        text = completion if isinstance(completion, str) else completion[-1]["content"]
        if not isinstance(prompt, str) and prompt[-1]["role"] == "assistant":
            # a prompt whose answer was begun (continued by the policy): the reward model reads the whole answer
            prompt, text = prompt[:-1], prompt[-1]["content"] + text
        answer = [{"role": "assistant", "content": text}]
        keep = chat_tokens.special_texts(self.tokenizer)
        try:
            pair = tokenize_pair(self.tokenizer, prompt if isinstance(prompt, str) else "",
                                 [] if isinstance(prompt, str) else prompt, answer, answer, self.chat_date, keep)
        except (BadConversation, chat_tokens.TemplateMismatch):
            return None
        return pair.chosen.astype("int64").tolist()[-(self.limit or 1 << 30):]

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, completion_ids: list, **columns) -> list[float | None]:
        if self.model is None:
            raise RuntimeError("RewardModelFn.place() was not called")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        device = next(self.model.parameters()).device
        tokens = [self.ids(p, c) for p, c in zip(prompts, completions, strict=True)]
        scored = [i for i, t in enumerate(tokens) if t]
        scores: list[float | None] = [None] * len(tokens)
        for a in range(0, len(scored), SCORE_ROWS):
            chunk = scored[a:a + SCORE_ROWS]
            width = max(len(tokens[i]) for i in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, :len(tokens[i])], mask[row, :len(tokens[i])] = torch.tensor(tokens[i]), 1
            # the score at each row's last real token, read by position (the model's own pooling looks for the pad
            # token's id, which is EOS for many tokenizers and ends every row here)
            hidden = self.model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            last = (mask.sum(-1) - 1).to(device)
            values = self.model.score(hidden[torch.arange(len(chunk), device=device), last])
            for i, v in zip(chunk, values[:, 0].float().tolist(), strict=True):
                scores[i] = v
        return scores
