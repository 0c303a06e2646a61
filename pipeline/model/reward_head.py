"""A reward model's head as a model transform: the causal LM's output layer replaced by one score per token (a linear
layer from the hidden state to one output, no bias) and its forward by the sequence-classification one's before
pooling (the body's last hidden state through the score, no term on the logits), so the model's own forward, under
every strategy's wrapper, gives each position's score; the reward objective reads it at each sequence's last token
that is not padding, where transformers' `AutoModelForSequenceClassification` reads it. The export is that class's
model: the body under the same names, the head as its `score`, the config naming the family's
sequence-classification class with one label and the pad token it pools by.

Why not build the sequence-classification class itself: its forward pools one position per row, and a packed block
holds many sequences. Why the family is checked first (reward_head_layout): the export is read by the family's
sequence-classification class, so its body must have the causal LM's names and its head a single linear map, which
preflight verifies on the two classes as transformers builds them, for the family at hand.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from pipeline.errors import UserError
from pipeline.model.modeling import trunk
from pipeline.model.transforms import ModelTransform

HEAD = "lm_head.weight"
"""Where the causal LM's output layer is (every family that has a sequence-classification class names it so)."""


def reward_head_layout(hf_config) -> tuple[str, str]:
    """(the family's sequence-classification class, the state-dict name of its score: `score.weight`), after
    checking that the class reads what this transform trains: the causal LM's body under the same names, and a score
    that is one bias-free linear map of the last hidden state. A family without such a class, or with another
    layout, is one line."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kind = type(hf_config).__name__.removesuffix("Config")
    config = copy.deepcopy(hf_config)
    config.num_labels = 1
    with torch.device("meta"):
        try:
            scorer = AutoModelForSequenceClassification.from_config(config)
        except ValueError:
            raise UserError(f"--objective reward: transformers has no sequence-classification class for {kind} "
                            f"(model_type {hf_config.model_type}), which would read the reward model") from None
        causal = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))
    body = {k for k in causal.state_dict() if k != HEAD}
    extra = sorted(set(scorer.state_dict()) - body)
    one = len(extra) == 1 and extra[0].endswith(".weight")  # a tensor of a module of its own, not a bare parameter
    score = scorer.get_submodule(extra[0].removesuffix(".weight")) if one else None
    if not isinstance(score, nn.Linear) or score.out_features != 1 or score.bias is not None or \
            body - set(scorer.state_dict()):
        raise UserError(f"--objective reward: {type(scorer).__name__} is not the causal LM's body with a one-output "
                        f"linear score (its own tensors: {', '.join(extra) or 'none'}), so a reward model trained "
                        "here would not load into it")
    return type(scorer).__name__, extra[0]


def is_reward_model(hf_config) -> bool:
    """Whether a model folder's config is a reward model's (a sequence-classification class with one label, as this
    transform exports one): its score is then read from the folder, not initialised."""
    architectures = getattr(hf_config, "architectures", None) or []
    return getattr(hf_config, "num_labels", None) == 1 and any(a.endswith("ForSequenceClassification")
                                                               for a in architectures)


def pad_id(tokenizer) -> int:
    """The token a reward model's sequence-classification class pools by: the tokenizer's pad token, else its end of
    sequence (as TRL's RewardTrainer sets it)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def checked_pad_id(tokenizer, hf_config, model_name: str) -> int:
    """pad_id, refused in one line where the exported class could not be built with it: transformers gives it to
    the embedding as padding_idx, which must lie within the embedding's rows ("Padding_idx must be within
    num_embeddings", at the export, after the whole run), and a model whose tokenizer has neither token has none."""
    pad = pad_id(tokenizer)
    rows = getattr(hf_config.get_text_config(), "vocab_size", None)
    if pad is None:
        raise UserError(f"--objective reward: the tokenizer of {model_name} has no pad token and no end-of-sequence "
                        "token to pool each sequence's score by; give it one (tokenizer_config.json's pad_token)")
    if rows is not None and not 0 <= pad < rows:
        raise UserError(f"--objective reward: the tokenizer of {model_name} pads with token id {pad}, beyond the "
                        f"model's embedding of {rows:,} rows, so the exported reward model could not be loaded; set "
                        "its pad_token (tokenizer_config.json) to a token the model has, e.g. its end-of-sequence "
                        "token")
    return pad


def scores_forward(self, input_ids=None, position_ids=None, **kwargs):
    """The sequence-classification forward before its pooling: every position's score, as `logits` [rows, seq, 1]."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden = trunk(self)(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
    score = self.get_output_embeddings()
    return CausalLMOutputWithPast(logits=score(hidden.to(score.weight.dtype)))  # an fp32 score beside adapters


class RewardHead(ModelTransform):
    """The output layer replaced by a score per token; initialised as transformers initialises a linear layer (normal,
    std initializer_range) from a generator seeded with torch's seed, so every rank and strategy draws the same."""

    name = "reward_head"

    def __init__(self, layout: tuple[str, str], pad_token_id: int, trained: bool = False):
        (self.architecture, self.score_name), self.pad_token_id = layout, pad_token_id
        self.trained = trained
        """The model folder is a reward model (is_reward_model): its score is read from it, not initialised."""
        self.std, self.shape = 0.02, (1, 0)
        """The score's initial spread (the config's initializer_range) and shape, read in apply."""

    def apply(self, model: nn.Module) -> None:
        old = model.get_output_embeddings()
        # trained in fp32 beside adapters (their frozen base, the old head included, is in the compute dtype: AdamW
        # on bf16 weights would lose updates below their precision), else in the model's own dtype
        dtype = old.weight.dtype if old.weight.requires_grad else torch.float32
        with torch.device("meta"):
            model.set_output_embeddings(nn.Linear(old.in_features, 1, bias=False, dtype=dtype))
        # the class's own forward would apply its terms on the logits (Gemma's soft-capping): the scores' instead
        model.__class__ = type(f"Reward{type(model).__name__}", (type(model),), {"forward": scores_forward})
        config = model.config
        self.std = getattr(config, "initializer_range", 0.02)
        self.shape = (1, old.in_features)
        # what the export's config says: the family's sequence-classification class, one label, the pad token it
        # pools by, no tie (its head is not the embedding)
        config.tie_word_embeddings = False
        config.num_labels = 1
        config.pad_token_id = self.pad_token_id
        config.architectures = [self.architecture]

    def base_name(self, name: str) -> str | None:
        if name != HEAD:
            return name
        return self.score_name if self.trained else None

    def after_base_weights(self, model: nn.Module) -> None:
        """The score's initial values, the same whole matrix on every rank, put in through DCP's state-dict API (which
        lays it out as each wrapper holds it: FSDP1's flat shards too). A collective under the sharding wrappers.
        Nothing where the folder held the score."""
        if self.trained:
            return
        generator = torch.Generator().manual_seed(torch.initial_seed())
        full = torch.empty(self.shape, dtype=torch.float32).normal_(0.0, self.std, generator=generator)
        set_model_state_dict(model, {HEAD: full}, options=StateDictOptions(full_state_dict=True, strict=False))

    def export_name(self, name: str) -> str:
        """A tensor's name in the sequence-classification model: the score's its own, every other the same."""
        return self.score_name if name == HEAD else name

    def export_state(self, state: dict) -> dict:
        return {self.export_name(k): v for k, v in state.items()}
