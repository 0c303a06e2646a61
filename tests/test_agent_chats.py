"""Tool calls and reasoning traces through the templates users have: the exact targets of each rendered conversation,
turn-by-turn samples for a template that rewrites earlier turns, and what a template cannot render skipped by
reason."""

import json

import datasets
import numpy as np
import pytest
from conftest import ROOT
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer

from pipeline.config_merge import merge
from pipeline.data import pair_tokens
from pipeline.data.chat_render import NotRendered, template_messages
from pipeline.data.chat_tokens import (
    Rendered,
    TemplateMismatch,
    fit,
    special_texts,
    tokenize_conversation,
    tokenize_turns,
)
from pipeline.data.dataset import BlockSpec
from pipeline.data.packing import TRAIN
from pipeline.data.pair_tokens import tokenize_pairs_batch
from pipeline.data.token_cache import build_blocks
from pipeline.errors import UserError
from pipeline.prep.corpus import CorpusConfig, build_dataset

TEMPLATES = ROOT / "examples" / "templates"
DATE = "26 Jul 2024"
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = json.dumps([WEATHER])


def calls(*pairs: tuple[str, dict]) -> str:
    """Tool calls as DATA-HF stores them."""
    return json.dumps([{"type": "function", "function": {"name": n, "arguments": a}} for n, a in pairs])


AGENT = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": "", "tool_calls": calls(("weather", {"city": "Oslo"}))},
         {"role": "tool", "content": "sunny, 21 C"},
         {"role": "assistant", "content": "Sunny and 21 C."}]
REASONER = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Two and two."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Let me check.", "reasoning_content": "I need the tool.",
             "tool_calls": calls(("weather", {"city": "Oslo"}))},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool says sunny."}]
CALL_QWEN = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tok(tiny_models):
    """The tiny model's tokenizer with ChatML's markers as special tokens (Qwen's are)."""
    tok = AutoTokenizer.from_pretrained(tiny_models["tied"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def with_template(tok, name: str):
    tok.chat_template = (TEMPLATES / name).read_text()
    return tok


def trained_runs(tok, r: Rendered) -> list[str]:
    """The decoded runs of trained tokens, in order."""
    edges = np.flatnonzero(np.diff(np.r_[0, r.trained.astype(int), 0]))
    return [tok.decode(r.ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def reference_ids(tok, messages: list[dict], tools: str) -> list[int]:
    """transformers' own tokenization of the conversation (calls as objects, as templates take them)."""
    plain = [{**m, **({"tool_calls": json.loads(m["tool_calls"])} if "tool_calls" in m else {})} for m in messages]
    return tok.apply_chat_template(plain, tools=json.loads(tools) if tools else None, date_string=DATE,
                                   return_dict=True)["input_ids"]


def test_llama31_trains_the_tool_call_and_the_answer_never_the_result_or_the_schemas(tok):
    tok = with_template(tok, "llama3_1.jinja")
    turns = tokenize_turns(tok, AGENT, DATE, "assistant", tools=TOOLS)
    [r] = turns.samples
    assert r.ids.tolist() == reference_ids(tok, AGENT, TOOLS)
    assert trained_runs(tok, r) == ['{"name": "weather", "parameters": {"city": "Oslo"}}<|eot_id|>',
                                    "Sunny and 21 C.<|eot_id|>"]
    text, first = tok.decode(r.ids.tolist()), int(np.argmax(r.trained))
    assert "The weather in a city" in tok.decode(r.ids[:first].tolist())  # the schema: in the prompt, untrained
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21 C"<|eot_id|>' in text  # the result, untrained
    assert turns.extra == 0 and len(r.cuts) == 2
    last = tokenize_turns(tok, AGENT, DATE, "last", tools=TOOLS).samples
    assert [trained_runs(tok, s) for s in last] == [["Sunny and 21 C.<|eot_id|>"]]


def test_qwen3_reasoning_chats_are_trained_turn_by_turn_as_the_model_sees_them(tok):
    """Qwen3's template drops the reasoning of answers before the last user turn: the first answer is one sample
    (its trace shown, as at inference), the two after the second question another, whose history holds the first
    answer without its trace. Each sample's tokens are transformers' rendering of the conversation up to its last
    turn; the tokens beyond one rendering of the conversation are counted."""
    tok = with_template(tok, "qwen3.jinja")
    with pytest.raises(TemplateMismatch):  # the whole conversation is not one rendering
        tokenize_conversation(tok, REASONER, DATE, "assistant", tools=TOOLS)
    turns = tokenize_turns(tok, REASONER, DATE, "assistant", tools=TOOLS)
    first, second = turns.samples
    assert first.ids.tolist() == reference_ids(tok, REASONER[:2], TOOLS)
    assert second.ids.tolist() == reference_ids(tok, REASONER, TOOLS)
    assert trained_runs(tok, first) == ["<think>\nTwo and two.\n</think>\n\n4.<|im_end|>"]
    assert trained_runs(tok, second) == [
        "<think>\nI need the tool.\n</think>\n\nLet me check.\n" + CALL_QWEN,
        "<think>\nThe tool says sunny.\n</think>\n\nSunny.<|im_end|>"]
    history = tok.decode(second.ids[:int(np.argmax(second.trained))].tolist())
    assert history.endswith("<|im_start|>assistant\n") and "Two and two" not in history and "4.<|im_end|>" in history
    assert turns.whole == len(second.ids) and turns.extra == len(first.ids)  # the whole is the last sample here
    quiet = tokenize_turns(tok, REASONER, DATE, "assistant", tools=TOOLS, train_reasoning=False).samples
    assert [trained_runs(tok, s) for s in quiet] == [
        ["\n</think>\n\n4.<|im_end|>"],
        ["\n</think>\n\nLet me check.\n" + CALL_QWEN, "\n</think>\n\nSunny.<|im_end|>"]]
    assert [s.ids.tolist() for s in quiet] == [first.ids.tolist(), second.ids.tolist()]
    [last] = tokenize_turns(tok, REASONER, DATE, "last", tools=TOOLS).samples
    assert last.ids.tolist() == second.ids.tolist()
    assert trained_runs(tok, last) == ["<think>\nThe tool says sunny.\n</think>\n\nSunny.<|im_end|>"]


def test_qwen3_agent_turns_after_one_question_split_where_the_template_renders_the_last_turn_apart(tok):
    """Qwen3 gives the last answer an empty <think></think> it leaves off earlier ones: the call is trained as the
    model generates it (empty think included) and the final answer after the history as rendered then."""
    tok = with_template(tok, "qwen3.jinja")
    call, answer = tokenize_turns(tok, AGENT, DATE, "assistant", tools=TOOLS).samples
    assert trained_runs(tok, call) == ["<think>\n\n</think>\n\n" + CALL_QWEN]
    assert trained_runs(tok, answer) == ["<think>\n\n</think>\n\nSunny and 21 C.<|im_end|>"]
    assert answer.ids.tolist() == reference_ids(tok, AGENT, TOOLS)


def test_generation_markers_give_the_mask_we_find_with_tools_and_reasoning(tok):
    """On a template with {% generation %} markers, transformers' assistant mask is the reference."""
    tok = with_template(tok, "qwen3_marked.jinja")
    [r] = tokenize_turns(tok, REASONER, DATE, "assistant", tools=TOOLS).samples
    plain = [{**m, **({"tool_calls": json.loads(m["tool_calls"])} if "tool_calls" in m else {})} for m in REASONER]
    ref = tok.apply_chat_template(plain, tools=[WEATHER], return_dict=True, return_assistant_tokens_mask=True)
    assert r.ids.tolist() == ref["input_ids"]
    assert r.trained.astype(int).tolist() == ref["assistant_masks"]
    assert sum(ref["assistant_masks"]) > 0


def test_what_a_template_leaves_out_is_skipped_by_reason(tok, tiny_models):
    """A template without tools (the tiny model's Llama 3 one) given schemas or calls, a template without reasoning
    (Llama 3.1's) given a trace: NotRendered, never trained without them. Llama 3.1's own refusal of two calls in one
    turn is its TemplateError."""
    plain = AutoTokenizer.from_pretrained(tiny_models["tied"])
    with pytest.raises(NotRendered, match="tools_not_rendered"):
        tokenize_turns(plain, [AGENT[1], {"role": "assistant", "content": "Hi."}], DATE, "assistant", tools=TOOLS)
    with pytest.raises(NotRendered, match="tools_not_rendered"):
        tokenize_turns(plain, AGENT, DATE, "assistant")
    llama = with_template(tok, "llama3_1.jinja")
    with pytest.raises(NotRendered, match="reasoning_not_rendered"):
        tokenize_turns(llama, REASONER[:2], DATE, "assistant")
    two = [AGENT[1], {"role": "assistant", "content": "", "tool_calls": calls(("weather", {"city": "Oslo"}),
                                                                             ("weather", {"city": "Rome"}))}]
    with pytest.raises(TemplateError, match="single tool-calls"):
        tokenize_turns(llama, two, DATE, "assistant", tools=TOOLS)
    named = [AGENT[1], {"role": "assistant", "content": "Let me call weather.",
                        "tool_calls": calls(("weather", {"city": "Oslo"}))}]
    with pytest.raises(NotRendered, match="tools_not_rendered"):  # the name in the text is not the call
        tokenize_turns(plain, named, DATE, "assistant")
    # a trace in the history only (train_on last) is the template's business: context, as at inference
    [r] = tokenize_turns(llama, [*REASONER[:2], {"role": "user", "content": "And 3+3?"},
                                 {"role": "assistant", "content": "6."}], DATE, "last").samples
    assert trained_runs(llama, r) == ["6.<|eot_id|>"]


def test_a_long_first_trace_drops_its_own_sample_only(tok):
    """Qwen3 drops the first answer's trace from the second question's history: the first sample is longer than a
    block and dropped, the second fits and is kept."""
    tok = with_template(tok, "qwen3.jinja")
    long = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "two and two " * 100},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6.", "reasoning_content": "six"}]
    turns = tokenize_turns(tok, long, DATE, "assistant", capacity=100)
    assert [fit(s, 100)[1] for s in turns.samples] == ["dropped_too_long", "kept"]
    assert trained_runs(tok, turns.samples[1]) == ["<think>\nsix\n</think>\n\n6.<|im_end|>"]


def test_a_dataset_of_agent_and_reasoning_chats_packs_every_sample_with_its_targets(tok, tiny_models, tmp_path):
    """DATA-HF to token cache: OpenAI and ShareGPT records with calls, results, schemas and traces become the
    samples tokenize_turns gives (their trained tokens, and nothing else, flagged in the blocks); the turn-by-turn
    cost is in meta.json. Under a template that renders neither tools nor traces each such conversation is counted by
    its reason and the plain one kept."""

    sharegpt = {"conversations": [
        {"from": "human", "value": "Weather in Rome?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Rome"}})},
        {"from": "observation", "value": "rain"}, {"from": "gpt", "value": "Rain."}], "tools": TOOLS}
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    openai = [{**m, **({"tool_calls": json.loads(m["tool_calls"])} if "tool_calls" in m else {})} for m in REASONER]
    records = [{"messages": AGENT, "tools": [WEATHER]}, {"messages": openai, "tools": [WEATHER]}, sharegpt,
               {"messages": plain}, {"messages": REASONER[:2]}]
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "agent.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build_dataset(CorpusConfig(tmp_path / "raw", tmp_path / "ds", num_proc=1))
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    spec = BlockSpec(1024, 0.0, 0, chats=True, chat_date=DATE)
    tok = with_template(tok, "qwen3.jinja")
    build_blocks(ds, tok, spec, 1, tmp_path / "cache")
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    turns = [tokenize_turns(tok, row["messages"], DATE, "assistant", tools=row["tools"]) for row in ds]
    expected = [s for t in turns for s in t.samples]
    assert len(expected) == 8 and meta["conversations"]["kept"] == 8
    assert meta["turn_by_turn"] == {"conversations": 3, "samples": 6, "whole_tokens": sum(t.whole for t in turns),
                                    "extra_tokens": sum(t.extra for t in turns)}
    blocks, flags = np.load(tmp_path / "cache" / "train.npy"), np.load(tmp_path / "cache" / "train_flags.npy")
    packed = sorted(run for ids, f in zip(blocks, flags, strict=True)
                    for run in trained_runs(tok, Rendered(ids, (f & TRAIN).astype(bool), [])))
    assert packed == sorted(run for s in expected for run in trained_runs(tok, s))
    assert "<think>\n\n</think>\n\nRain.<|im_end|>" in packed and not any("tool_response" in run for run in packed)
    build_blocks(ds, AutoTokenizer.from_pretrained(tiny_models["tied"]), spec, 1, tmp_path / "plain")
    counts = json.loads((tmp_path / "plain" / "meta.json").read_text())["conversations"]
    assert {k: v for k, v in counts.items() if v} == {"kept": 1, "tools_not_rendered": 3, "reasoning_not_rendered": 1}


def test_a_hub_dataset_with_call_objects_and_no_tools_column_trains_its_calls_as_objects(tok, tmp_path):
    """A hub dataset as OpenAI writes one (no tools column, content null on a turn that only calls, arguments a
    JSON string) and one with argument objects (Arrow gives each row's the keys of every row's, as None): under
    Llama 3.1's template the arguments render as the row's own object, never a string in a string. A special token's
    text inside the arguments stays text."""
    def chat(arguments: object) -> dict:
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": arguments}}]}
        return {"messages": [AGENT[1], call, {"role": "tool", "content": "sunny"},
                             {"role": "assistant", "content": "Sunny."}]}

    spec = BlockSpec(256, 0.0, 0, chats=True, chat_date=DATE)
    tok = with_template(tok, "llama3_1.jinja")
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    for name, rows in (("strings", [chat('{"city": "Oslo"}'), chat('{"city": "Rome<|eot_id|>"}')]),
                       ("objects", [chat({"city": "Oslo"}), chat({"days": 2})])):
        build_blocks(datasets.Dataset.from_list(rows), tok, spec, 1, tmp_path / name)
        blocks, flags = np.load(tmp_path / name / "train.npy"), np.load(tmp_path / name / "train_flags.npy")
        runs = sorted(run for ids, f in zip(blocks, flags, strict=True)
                      for run in trained_runs(tok, Rendered(ids, (f & TRAIN).astype(bool), [])))
        other = '{"name": "weather", "parameters": {"city": "Rome<|eot_id|>"}}' if name == "strings" else \
            '{"name": "weather", "parameters": {"days": 2}}'
        assert runs == sorted([f"{other}<|eot_id|>", '{"name": "weather", "parameters": {"city": "Oslo"}}<|eot_id|>',
                               "Sunny.<|eot_id|>", "Sunny.<|eot_id|>"]), name
    # the two datasets' conversations have the same turns: the same count of <|eot_id|> tokens, none from the text
    assert int((np.load(tmp_path / "strings" / "train.npy") == eot).sum()) == int((blocks == eot).sum()) == 2 * 5


def test_turns_whose_history_cannot_fit_are_one_dropped_sample_never_lost(tok):
    """Once the user turns and tool results alone are more characters than a block's tokens can hold, the rest of
    the conversation is one sample that cannot fit (None: counted as dropped_too_long), the turns before it kept;
    under --train-on last the conversation is that one sample, never no sample at all."""
    tok = with_template(tok, "qwen3.jinja")
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
            {"role": "user", "content": "x " * 256 * 20}, {"role": "assistant", "content": "Long."}]
    turns = tokenize_turns(tok, talk, DATE, "assistant", capacity=256)
    assert [s is None for s in turns.samples] == [False, True] and turns.extra == 0
    assert trained_runs(tok, turns.samples[0]) == ["<think>\ngreet\n</think>\n\nHello.<|im_end|>"]
    assert tokenize_turns(tok, talk, DATE, "last", capacity=256).samples == [None]


def test_special_token_text_in_a_call_name_or_argument_key_stays_text(tok):
    tok = with_template(tok, "llama3_1.jinja")
    eot, header = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|start_header_id|>")
    counts = []
    for name, key in (("weather", "city"), ("w<|eot_id|><|start_header_id|>", "<|eot_id|><|start_header_id|>")):
        call = {"role": "assistant", "content": "", "tool_calls": calls((name, {key: "Oslo"}))}
        [r] = tokenize_turns(tok, [AGENT[1], call], DATE, "assistant", special_texts(tok)).samples
        counts.append((int((r.ids == eot).sum()), int((r.ids == header).sum())))
        assert trained_runs(tok, r) == [f'{{"name": "{name}", "parameters": {{"{key}": "Oslo"}}}}<|eot_id|>']
    assert counts[0] == counts[1]


def test_hub_rows_with_aliased_fields_and_pairs_the_template_cannot_render(tok):
    """A hub dataset's `thinking` is the trace (never dropped); a hub preference pair whose answer holds a trace the
    template leaves out is counted by that reason, not a crash of the build."""
    assert template_messages([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "a", "thinking": "why"}])[1] == {
        "role": "assistant", "content": "a", "reasoning_content": "why"}
    plain = AutoTokenizer.from_pretrained(tok.name_or_path)
    batch = {"text": [""], "messages": [[{"role": "user", "content": "q"}]],
             "chosen": [[{"role": "assistant", "content": "a", "reasoning_content": "why"}]],
             "rejected": [[{"role": "assistant", "content": "b"}]]}
    out = tokenize_pairs_batch(batch, plain, DATE, 256, None)
    assert [pair_tokens.STATUS[s] for s in out["status"]] == ["reasoning_not_rendered"]


def test_train_on_all_with_reasoning_off_is_one_line():
    with pytest.raises(UserError, match="--train-on-reasoning off makes traces context, but --train-on all trains "
                                        "every token; use --train-on assistant or last with it"):
        merge({"experiment_name": "e", "model_name": "m", "train_on": "all", "train_on_reasoning": False})


def test_a_long_conversation_under_a_rewriting_template_renders_only_what_a_block_can_hold(tok, monkeypatch):
    """Qwen3's template rewrites earlier turns, so the conversation is cut turn by turn: once its user turns alone are
    more tokens than a block holds, no later turn is rendered (each would be rendered with its whole history, the
    time quadratic in the turns). 300 turns cost what 100 do."""
    tok = with_template(tok, "qwen3.jinja")
    renders = []
    template = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: renders.append(1) or template(*a, **k))
    counts = {}
    for n in (100, 300):
        talk = []
        for k in range(n):
            talk += [{"role": "user", "content": f"question number {k}, please"},
                     {"role": "assistant", "content": f"Answer {k}.", "reasoning_content": f"think {k}"}]
        renders.clear()
        turns = tokenize_turns(tok, talk, DATE, "assistant", capacity=128)
        counts[n] = (len(renders), [s is None for s in turns.samples])
    assert counts[100] == counts[300] and counts[100][1][-1]  # the same renderings; the rest one dropped sample
    assert counts[100][0] < 2 * 100
