"""A reward for the agent prompts of examples/tools/prompts: with --tools, each completion is the episode's messages
(the assistant's turns and the tools' results, TRL's form); the answer must be in the last assistant turn."""


def answered(prompts, completions, completion_ids, answer, **columns):
    return [1.0 if messages and str(a) in (messages[-1].get("content") or "") else 0.0
            for messages, a in zip(completions, answer, strict=True)]
