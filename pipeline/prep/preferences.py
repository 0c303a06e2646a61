"""Preference records in the forms TRL reads, turned into one: a Pair.

Paired (a chosen and a rejected answer to one prompt):
    standard         {"prompt": "...", "chosen": "...", "rejected": "..."}
    conversational   {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    implicit prompt  {"chosen": [messages], "rejected": [messages]}: whole conversations sharing their first turns,
                     which are the prompt
Unpaired (KTO's: one completion, labelled desirable or not):
    standard         {"prompt": "...", "completion": "...", "label": true}
    conversational   {"prompt": [messages], "completion": [messages], "label": false}

Any record with a "chosen" or a "rejected" key, or with a prompt, a completion and a label, is one of these or is
skipped by reason; never text (its rejected answers would be trained on) nor a conversation (a completion labelled
bad must not become one to imitate). An unpaired record is a Pair with one answer: chosen when its label is true,
rejected when false, the other empty.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pipeline.prep import conversations

REASONS = ("missing_field", "malformed_message", "tool_calls", "reasoning_trace", "empty_answer", "same_answers",
           "prompt_not_shared", "not_alternating", "bad_label")
"""Why a preference record is skipped."""
ANSWER_ROLE = "assistant"


class BadPair(Exception):
    """A record in a preference form that cannot be trained on; the message is one of REASONS."""


@dataclass(frozen=True)
class Pair:
    """One preference row. A conversational pair has its prompt as messages (rendered by the chat template); a
    standard one as text (concatenated with the answers as they are)."""

    prompt_text: str
    prompt_messages: list[dict]
    chosen: list[dict]
    """The chosen answer: assistant messages continuing the prompt (a standard pair's: one, its text); an unpaired
    record's completion when labelled desirable, else empty."""
    rejected: list[dict]
    """The rejected answer; an unpaired record's completion when labelled undesirable, else empty."""
    unpaired: bool = False
    """A KTO record (its form says so, never an empty answer of a pair): one answer, its label which of the two."""

    @property
    def conversational(self) -> bool:
        return bool(self.prompt_messages)

    @property
    def chars(self) -> int:
        return len(self.prompt_text) + sum(len(m["content"]) for m in (*self.prompt_messages, *self.chosen,
                                                                       *self.rejected))


def detect(record: object) -> str | None:
    """The preference form of a JSON value ("standard", "conversational", "implicit", "row" for a pair of our own
    datasets read back, paired or not), "unpaired" for a KTO record, "incomplete" for a chosen without a rejected or
    the reverse, None when it is no preference record."""
    if not isinstance(record, dict):
        return None
    if "text" in record and isinstance(record.get("messages"), list) and set(record) <= conversations.OWN_ROW:
        return "row" if record.get("chosen") or record.get("rejected") else None  # one of our datasets' rows
    if "chosen" in record or "rejected" in record:
        if "chosen" not in record or "rejected" not in record:
            return "incomplete"
        if "prompt" not in record:
            return "implicit"
        return "standard" if isinstance(record["prompt"], str) else "conversational"
    if "label" in record and "completion" in record and "prompt" in record:
        return "unpaired"
    return None


def to_pair(record: dict, form: str) -> Pair:
    """The record (of form, from detect) as a checked Pair; BadPair with the reason when it cannot be trained on."""
    if form == "incomplete":
        raise BadPair("missing_field")
    if form == "unpaired":
        return _unpaired(record)
    if record.get("tools") not in (None, "", [], "[]"):  # schemas a pair's template would need: not trained yet
        raise BadPair("tool_schemas")
    if form == "row":  # read back from our own dataset: the prompt in messages (conversational) or in text
        if not isinstance(record["text"], str):
            raise BadPair("malformed_message")
        prompt = _messages(record["messages"])
        chosen, rejected = _messages(record.get("chosen") or []), _messages(record.get("rejected") or [])
        # a row with one answer is a KTO record of ours (DATA-HF writes no pair with an empty answer)
        pair = Pair(record["text"] if not prompt else "", prompt, chosen, rejected, bool(chosen) != bool(rejected))
        if prompt:
            _check_turns(pair)
    elif form == "standard":
        parts = (record["prompt"], record["chosen"], record["rejected"])
        if not all(isinstance(p, str) for p in parts):
            raise BadPair("malformed_message")
        prompt, chosen, rejected = parts
        pair = Pair(prompt, [], [_answer(chosen)], [_answer(rejected)])
    elif form == "conversational":
        prompt = _messages(record["prompt"])
        pair = Pair("", prompt, _messages(record["chosen"]), _messages(record["rejected"]))
        _check_turns(pair)
    else:
        pair = _split_shared_prompt(_messages(record["chosen"]), _messages(record["rejected"]))
        _check_turns(pair)
    _check_answers(pair)
    return pair


def _unpaired(record: dict) -> Pair:
    """A KTO record: its completion as the chosen answer (label true) or the rejected one (label false). The label
    must be a JSON boolean: a string "false" or a number would be a guess at which answer to imitate."""
    if record.get("tools") not in (None, "", [], "[]"):
        raise BadPair("tool_schemas")
    label, prompt, completion = record["label"], record["prompt"], record["completion"]
    if not isinstance(label, bool):
        raise BadPair("bad_label")
    if isinstance(prompt, str):
        if not isinstance(completion, str):
            raise BadPair("malformed_message")
        answer, pair_prompt, text = [_answer(completion)], [], prompt
    else:
        answer, pair_prompt, text = _messages(completion), _messages(prompt), ""
    pair = Pair(text, pair_prompt, answer if label else [], [] if label else answer, unpaired=True)
    if pair_prompt:
        _check_turns(pair)
    _check_answers(pair)
    return pair


def _answer(text: str) -> dict:
    return {"role": ANSWER_ROLE, "content": text}


def _messages(value: object) -> list[dict]:
    """A message list as conversations reads one (roles checked, content parts joined)."""
    if isinstance(value, str):
        raise BadPair("malformed_message")
    try:
        return conversations.messages_of(value)
    except conversations.BadConversation as exc:
        reason = str(exc)
        if reason in ("tool_calls", "reasoning_trace"):  # what the pair holds that is not trained yet
            raise BadPair(reason) from None
        raise BadPair("malformed_message" if reason != "unknown_role" else "not_alternating") from None


def _split_shared_prompt(chosen: list[dict], rejected: list[dict]) -> Pair:
    """The implicit-prompt form: the longest run of first messages the two conversations share, ending before an
    assistant turn, is the prompt; what follows in each is its answer."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    while shared and chosen[shared - 1]["role"] == ANSWER_ROLE:  # the answers start with the assistant's turn
        shared -= 1
    if not shared or chosen[shared - 1]["role"] != "user":
        raise BadPair("prompt_not_shared")
    return Pair("", chosen[:shared], chosen[shared:], rejected[shared:])


def _check_turns(pair: Pair) -> None:
    """The prompt ends with a user turn, each answer starts with the assistant's, and prompt + answer is a trainable
    conversation (system first if at all, then user and assistant alternating)."""
    prompt = pair.prompt_messages
    if not prompt or prompt[-1]["role"] != "user":
        raise BadPair("not_alternating")
    for answer in (pair.chosen, pair.rejected):
        if not answer and pair.unpaired:  # a KTO record's other answer
            continue
        if answer and answer[0]["role"] != ANSWER_ROLE:
            raise BadPair("not_alternating")
        try:
            conversations.check([*prompt, *answer])
        except conversations.BadConversation as exc:
            reason = str(exc)
            raise BadPair("empty_answer" if reason in ("empty", "no_assistant_turn") else "not_alternating") \
                from None


def _check_answers(pair: Pair) -> None:
    answers = [a for a in (pair.chosen, pair.rejected) if a] if pair.unpaired else [pair.chosen, pair.rejected]
    for answer in answers or [[]]:
        if not answer or any(not m["content"].strip() for m in answer):
            raise BadPair("empty_answer")
    if pair.chosen == pair.rejected:
        raise BadPair("same_answers")


def files_holding(shards: list[str], pairs: bool, shown: int = 3) -> str:
    """The source files of a folder's preference rows (pairs, or KTO's unpaired records) or of its other rows, read
    back from DATA-HF's Arrow shards, with their rows of that kind: where a folder that mixes the two has the fewer."""
    import pyarrow as pa
    import pyarrow.compute as pc

    found: Counter = Counter()
    for shard in shards:
        with pa.ipc.open_stream(shard) as reader:
            table = reader.read_all()
        is_pair = pc.or_(pc.greater(pc.list_value_length(table.column("chosen")), 0),
                         pc.greater(pc.list_value_length(table.column("rejected")), 0))
        for source, flag in zip(table.column("source").to_pylist(), is_pair.to_pylist(), strict=True):
            if flag == pairs:
                found[source] += 1
    named = ", ".join(f"{source} ({n} row{'s' if n > 1 else ''})" for source, n in found.most_common(shown))
    return named + (f" and {len(found) - shown} more files" if len(found) > shown else "")
