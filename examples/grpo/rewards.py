"""Example reward functions for `fsdp1.py --objective grpo --reward examples/grpo/rewards.py:FUNCTION[:WEIGHT]`.

A reward function takes TRL's arguments: the prompts and completions of a batch (strings for standard prompts, lists
of messages for conversational ones), the completions' token ids, and each other column of the prompt rows as a
keyword argument holding one value per completion (here `answer`). It returns one float per completion, or None
where it has nothing to say about one (that completion's reward is then the other functions' weighted sum).
"""


def digits(prompts, completions, completion_ids, **columns):
    """The share of the completion's non-space characters that are digits: an arithmetic answer is all digits. A
    reward that varies within a group from the first step, so even a small model learns from it at once."""
    out = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return out


def brevity(prompts, completions, completion_ids, **columns):
    """1 for a completion of at most 8 tokens, falling to 0 at 32: the answer, not an essay."""
    return [max(0.0, min(1.0, (32 - len(ids)) / 24)) for ids in completion_ids]
