"""--tools (pipeline/rl/tools.py, episodes.py): the user's functions offered through the chat template, the model's
calls parsed and run (a failure is the model's answer, never the run's end), and each completion continued through
tool turns whose tokens are the template's rendering of the conversation and train nothing."""

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, events, losses, preflight_errors, run_script, start_python, torchrun, with_root
from transformers import AutoModelForCausalLM, GenerationConfig

from pipeline.errors import UserError
from pipeline.model.head import Head
from pipeline.rl.episodes import Turns
from pipeline.rl.generation import Sampling
from pipeline.rl.tool_calls import Call, Tagged
from pipeline.rl.tools import Tools

TOOLS = '''
import time


def lookup(key: str) -> str:
    """The value stored under a key.

    Args:
        key: the key to look up
    """
    return {"a": "17", "b": "42"}.get(key, "unknown")


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise ValueError(f"no luck with {x}")


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def _helper():
    return None
'''
CHATML = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS)
    return path


def test_a_tool_file_offers_its_public_functions_with_their_schemas_and_its_mistakes_are_one_line(tool_file):
    tools = Tools(str(tool_file), 5)
    assert list(tools.functions) == ["lookup", "broken", "slow"]  # every public function, in the file's order
    assert tools.schemas[0] == {"type": "function", "function": {
        "name": "lookup", "description": "The value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the key to look up"}},
                       "required": ["key"]}, "return": {"type": "string"}}}
    named = Tools(f"{tool_file}:lookup", 5)
    assert list(named.functions) == ["lookup"] and named.identity.startswith("tools.py:lookup:")
    bad = tool_file.parent / "bad.py"
    bad.write_text("def undocumented(x: int) -> int:\n    return x\n")
    with pytest.raises(UserError, match=rf"^--tools {bad}: undocumented cannot be offered as a tool: .*a tool needs a "
                                        r"type hint on every argument and a docstring"):
        Tools(str(bad), 5)
    with pytest.raises(UserError, match=rf"^--tools {tool_file}:missing: {tool_file} defines no function missing$"):
        Tools(f"{tool_file}:missing", 5)
    with pytest.raises(UserError, match=r"^--tools /nowhere/tools.py: the file cannot be read"):
        Tools("/nowhere/tools.py", 5)


def test_the_models_calls_parse_and_run_and_every_failure_is_its_answer(tool_file):
    tools, reader = Tools(str(tool_file), 0.3), Tagged()
    text = 'Let me see.<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>' \
           '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"b\\"}"}</tool_call>'
    parsed = reader.parse(text)
    assert parsed.calls == [Call("lookup", {"key": "a"}), Call("lookup", {"key": "b"})] and not parsed.error
    run = lambda call: tools.run_all([(call, tools.table())])[0]  # noqa: E731
    assert [r.content for r in tools.run_all([(c, tools.table()) for c in parsed.calls])] == ["17", "42"]
    assert reader.parse("no call at all") == reader.parse("") and not reader.parse("plain").calls
    drafted = '<think>maybe <tool_call>{"name": "lookup", "arguments": {"key": "b"}}</tool_call></think>'
    assert reader.parse(drafted + text).calls == parsed.calls  # a call drafted while reasoning is not made
    opened = '<|im_start|>assistant\n<think>\n'  # a generation prompt that opens the reasoning: the turn starts in it
    assert reader.parse(drafted[len("<think>"):] + text, opened).calls == parsed.calls
    assert not reader.parse('<tool_call>{"name": "lookup", "arguments": {"key": "b"}}</tool_call>', opened).calls
    assert reader.parse("<tool_call>{name: lookup}</tool_call>").error.startswith("the tool call is not JSON")
    assert reader.parse('<tool_call>{"name": "lookup"').error == "a <tool_call> tag is not closed by </tool_call>"
    assert reader.parse('<tool_call>["lookup"]</tool_call>').error.startswith("a tool call must be a JSON object")
    answers = [run(Call("broken", {"x": 3})), run(Call("nothing", {})), run(Call("lookup", {"wrong": 1}))]
    assert [(a.outcome, a.content) for a in answers[:2]] == [
        ("error", "error: ValueError: no luck with 3"),
        ("error", "error: there is no tool 'nothing'; the tools are lookup, broken, slow")]
    assert answers[2].outcome == "error" and answers[2].content.startswith("error: TypeError: ")
    start = time.monotonic()
    late = run(Call("slow", {"seconds": 30}))
    assert (late.outcome, late.content) == ("timeout", "error: slow did not return within 0.3 s")
    assert time.monotonic() - start < 5
    assert run(Call("slow", {"seconds": 0})).content == "woke"  # the limit is disarmed after a call


ASYNC_TOOLS = '''
import asyncio


async def wait(seconds: float) -> str:
    """Waits.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return f"waited {seconds:g}"


async def fails(x: int) -> int:
    """Fails.

    Args:
        x: anything
    """
    raise ValueError(f"no luck with {x}")
'''


def test_async_tools_are_awaited_together_each_under_its_own_time_limit(tool_file, tmp_path):
    """TRL's async tools: the calls of every episode awaited together (three half-second waits take about half a
    second), in the calls' order among the plain tools' results; one past --tool-timeout is answered as a timeout,
    one that raises as an error, and neither holds the others up."""
    (tmp_path / "async_tools.py").write_text(ASYNC_TOOLS)
    tools, plain = Tools(str(tmp_path / "async_tools.py"), 0.3), Tools(f"{tool_file}:lookup", 5)
    table = {**tools.table(), **plain.table()}
    calls = [Call("wait", {"seconds": 0.2}), Call("lookup", {"key": "a"}), Call("wait", {"seconds": 0.25}),
             Call("fails", {"x": 3}), Call("wait", {"seconds": 30}), Call("wait", {"seconds": 0.2})]
    start = time.monotonic()
    results = tools.run_all([(c, table) for c in calls])
    assert time.monotonic() - start < 1.5  # together: 0.3 s for all, not 30.65 s one after another
    assert [(r.outcome, r.content) for r in results] == [
        ("ok", "waited 0.2"), ("ok", "17"), ("ok", "waited 0.25"), ("error", "error: ValueError: no luck with 3"),
        ("timeout", "error: wait did not return within 0.3 s"), ("ok", "waited 0.2")]


ENVIRONMENT = '''
VALUES = {"a": "17", "b": "42"}


class Keys:
    """The key a prompt asks about is the environment's: its reward is whether the model looked that key up."""

    def __init__(self):
        self.key, self.asked = None, []

    def reset(self, key, **row):
        self.key, self.asked = key, []

    def lookup(self, key: str) -> str:
        """The value stored under a key.

        Args:
            key: the key to look up
        """
        self.asked.append(key)
        return VALUES.get(key, "unknown")

    def get_reward(self) -> float:
        return float(self.asked[:1] == [self.key])

    @property
    def state(self):
        raise RuntimeError("a property is never read to find the tools")


class Told(Keys):
    def reset(self, key, **row):
        super().reset(key)
        return f" (the key is {key})"


class Broken(Keys):
    def reset(self, key, **row):
        return {"wrong": 1}[key]


class Counted(Keys):
    def reset(self, key, **row):
        return 3


class NoReset:
    def lookup(self, key: str) -> str:
        """The value.

        Args:
            key: the key
        """
        return key


class Quiet:
    def reset(self, **row):
        return None


def seen(prompts, completions, completion_ids, environments, key, **columns):
    return [float(type(e).__name__ == "Keys" and e.key == k) for e, k in zip(environments, key)]
'''


def test_an_environment_gives_each_rollout_an_instance_whose_methods_are_tools_and_whose_reward_is_one(tmp_path,
                                                                                                      tool_file):
    """--environment FILE.py:CLASS, TRL's environment_factory: instances made once and reset with the row (its
    observation appended to the prompt's last message), the public methods its tools (bound to each rollout's
    instance; properties never read), get_reward() a reward named by the class beside --reward's functions, which
    get the instances as `environments`. Its mistakes, each one line."""
    from pipeline.rl.environments import Environment
    from pipeline.rl.prompts import PromptRow, with_observation
    from pipeline.rl.rewards import Rewards

    path = tmp_path / "env.py"
    path.write_text(ENVIRONMENT)
    env = Environment(f"{path}:Keys", 5)
    assert (env.methods, env.rewarded, env.name) == (["lookup"], True, "Keys")
    assert env.identity.startswith("env.py:Keys:")
    tools = Tools("", 5, env)
    assert tools.schemas == [LOOKUP] and tools.identity == ""
    a, b = env.instances(2)
    assert env.instances(1) == [a] and len(env.pool) == 2  # made once, reused
    question = [{"role": "user", "content": "What is stored under a?"}]
    assert env.reset(a, {"prompt": question, "key": "a"}) is None
    env.reset(b, {"prompt": question, "key": "a"})
    results = tools.run_all([(Call("lookup", {"key": "a"}), tools.table(a)), (Call("lookup", {"key": "b"}),
                                                                              tools.table(b))])
    assert [r.content for r in results] == ["17", "42"] and (a.asked, b.asked) == (["a"], ["b"])
    assert Rewards("", environment=env).names == ["Keys"]  # no --reward needed where the environment scores
    rewards = Rewards(f"{path}:seen", environment=env)
    assert rewards.names == ["seen", "Keys"] and rewards.identity[1] == f"Keys:1.0:{env.identity}"
    _, per = rewards.score([question] * 2, [[{"role": "assistant", "content": ""}]] * 2, [[1], [1]],
                           [{"key": "a"}, {"key": "a"}], environments=[a, b])
    assert per.tolist() == [[1.0, 1.0], [1.0, 0.0]]  # seen got the instances; b looked up the wrong key
    told = Environment(f"{path}:Told", 5)
    observation = told.reset(told.instances(1)[0], {"prompt": question, "key": "a"})
    assert with_observation(PromptRow(question, {}), observation).prompt == [
        {"role": "user", "content": "What is stored under a? (the key is a)"}]
    assert with_observation(PromptRow("Go:", {}), " now").prompt == "Go: now"
    broken, counted = Environment(f"{path}:Broken", 5), Environment(f"{path}:Counted", 5)
    mistakes = [lambda: Environment(f"{path}:Nope", 5), lambda: Environment(f"{path}:NoReset", 5),
                lambda: Environment(str(path), 5), lambda: Tools(f"{tool_file}:lookup", 5, env),
                lambda: broken.reset(broken.instances(1)[0], {"prompt": question, "key": "a"}),
                lambda: counted.reset(counted.instances(1)[0], {"prompt": question, "key": "a"}),
                lambda: Rewards("", environment=Environment(f"{path}:Quiet", 5))]
    said = []
    for mistake in mistakes:
        with pytest.raises(UserError) as caught:
            mistake()
        said.append(str(caught.value))
    assert said == [
        f"--environment {path}:Nope: {path} defines no class Nope",
        f"--environment {path}:NoReset: NoReset has no reset method; TRL's contract is reset(self, **row) -> str | "
        "None, called before each rollout with its prompt row",
        f"--environment {path}: give the file and the class, FILE.py:CLASS (TRL's environment_factory)",
        f"--tools {tool_file}:lookup and --environment {path}:Keys both offer a tool lookup; the model calls a tool by "
        "its name, so rename one",
        f"--environment {path}:Broken: reset raised KeyError: 'a' on the prompt 'What is stored under a?'",
        f"--environment {path}:Counted: reset returned a int on the prompt 'What is stored under a?'; it returns the "
        "observation appended to the prompt (a string) or None",
        "--objective grpo needs at least one --reward (FILE.py:FUNCTION[:WEIGHT] or a built-in: accuracy, "
        "think_format), or an --environment whose class has get_reward()"]


@pytest.fixture(scope="module")
def chatml_model(tmp_path_factory) -> Path:
    """A tiny random Llama whose tokenizer holds ChatML's markers as special tokens, with Qwen 3's template."""
    from pipeline.prep.tiny import DEFAULT_CORPUS, corpus_texts, save_random, tiny_config, train_tokenizer

    tok = train_tokenizer(corpus_texts(DEFAULT_CORPUS), 1024)
    tok.add_special_tokens({"additional_special_tokens": CHATML})
    tok.chat_template = (ROOT / "examples" / "templates" / "qwen3.jinja").read_text()
    config = tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id, tied=True, layers=2, hidden=64)
    folder = save_random(tmp_path_factory.mktemp("chatml") / "model", config, tok, 0)
    # a turn ends at <|im_end|>, as Qwen's generation_config.json lists it
    GenerationConfig(bos_token_id=tok.bos_token_id,
                     eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("template", "end_token"), [("qwen3.jinja", "<|im_end|>"), ("llama3_1.jinja", "<|eot_id|>")])
def test_an_episode_is_the_templates_rendering_of_its_conversation_and_its_tool_turns_are_not_the_models(
        chatml_model, tool_file, template, end_token):
    """Qwen 3's template (calls as <tool_call> JSON; its last assistant turn rendered otherwise) and Llama 3.1's (a
    bare JSON call, tool results as ipython turns): the episode's tokens are the template's rendering of the whole
    conversation, and its calls are read back as the template writes them."""
    from transformers import AutoTokenizer

    from pipeline.rl.tool_calls import call_reader

    tok = AutoTokenizer.from_pretrained(chatml_model)
    tok.chat_template = (ROOT / "examples" / "templates" / template).read_text()
    model = AutoModelForCausalLM.from_pretrained(chatml_model).eval()
    tools = Tools(f"{tool_file}:lookup", 5)
    end = tok.convert_tokens_to_ids(end_token)
    reader = call_reader(tok, "26 Jul 2024", tools.schemas, "m")
    assert reader.name == {"qwen3.jinja": "<tool_call> JSON", "llama3_1.jinja": "Llama 3's JSON"}[template]
    turns = Turns(tools, reader, tok, "26 Jul 2024", 1, {end, tok.eos_token_id}, tok.eos_token_id)
    user = [{"role": "user", "content": "What is stored under a?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "a"}}}]}
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    render = lambda messages, **kw: tok.apply_chat_template(  # noqa: E731
        messages, tools=tools.schemas, tokenize=False, date_string="26 Jul 2024", **kw)
    prompt = ids(render(user, add_generation_prompt=True))
    answered = [*user, call, {"role": "tool", "name": "lookup", "content": "17"}]
    expected = ids(render(answered, add_generation_prompt=True))
    # the model's first turn, as the template renders an assistant turn that calls the tool (through its end token)
    first = expected[len(prompt):]
    first = first[:first.index(end) + 1]
    head = Head(model, False, 1)
    (episode,) = turns.continue_all(head, [prompt], [first], Sampling(256), torch.Generator().manual_seed(0), False,
                                    torch.device("cpu"))
    assert prompt + episode.ids[:len(expected) - len(prompt)] == expected  # the template's own tokens, to the turn
    tool_turn = len(expected) - len(prompt) - len(first)
    assert episode.model[:len(first)] == [1] * len(first)
    assert episode.model[len(first):len(first) + tool_turn] == [0] * tool_turn  # the template's: no loss
    assert set(episode.model[len(first) + tool_turn:]) == {1} and len(episode.ids) > len(expected) - len(prompt)
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant"]
    assert episode.messages[1] == {"role": "tool", "name": "lookup", "content": "17"}
    assert (episode.calls, episode.failures, episode.turns) == (1, 0, 2)
    assert "17" in tok.decode(episode.ids)


CALLS = [Call("lookup", {"key": "a"}), Call("lookup", {"key": "ключ \"q\" <b>"}),
         Call("plan", {"steps": [1, 2.5, None], "options": {"deep": True}}), Call("noargs", {})]
"""Calls whose arguments exercise JSON: quotes and markup in a string, non-ASCII, lists, nesting, none at all."""
UNREADABLE = """{% if tools %}TOOLS {% endif %}{%- for m in messages %}{{ m.role }}: {% if m.tool_calls %}\
{% for c in m.tool_calls %}CALL {{ c.function.name }}({{ c.function.arguments | items | list }}){% endfor %}\
{% else %}{{ m.content }}{% endif %}<|im_end|>{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"""
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
    "fields": {"reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
               "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                              "content": "json", "transform": {"type": "function", "function": "{content}"}},
               "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
"""A response_template as a model may ship one in its tokenizer_config.json (transformers' response parsing): Qwen 3's
turn, its calls as JSON between tags."""


def test_every_bundled_templates_calls_are_read_back_exactly_as_it_writes_them(chatml_model):
    """For each chat template the project bundles, and for a tokenizer that ships a response_template, the reader
    call_reader picks reads back every call as the template renders it (name and arguments exactly); a template that
    writes calls in a form no reader reads is one line."""
    from transformers import AutoTokenizer

    from pipeline.rl.tool_calls import call_reader

    tok = AutoTokenizer.from_pretrained(chatml_model)
    user = [{"role": "user", "content": "?"}]
    chosen = {}
    cases = [(path.name, path.read_text(), None) for path in sorted((ROOT / "examples" / "templates").glob("*.jinja"))]
    cases.append(("qwen3.jinja + response_template", (ROOT / "examples" / "templates" / "qwen3.jinja").read_text(),
                  RESPONSE_TEMPLATE))
    for name, template, response in cases:
        tok.chat_template, tok.response_template = template, response
        reader = chosen[name] = call_reader(tok, "26 Jul 2024", [LOOKUP], "m")
        for call in CALLS:
            turn = {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
            before = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            whole = tok.apply_chat_template([*user, turn], tokenize=False)
            assert reader.parse(whole[len(before):], before).calls == [call], (name, call)
    assert {n: r.name for n, r in chosen.items()} == {
        "llama3_1.jinja": "Llama 3's JSON", "qwen3.jinja": "<tool_call> JSON", "qwen3_marked.jinja": "<tool_call> JSON",
        "qwen3.jinja + response_template": "the tokenizer's response_template"}
    tok.chat_template, tok.response_template = UNREADABLE, None
    with pytest.raises(UserError) as caught:
        call_reader(tok, "26 Jul 2024", [LOOKUP], "m")
    assert str(caught.value) == (
        "--tools: the chat template of m writes a tool call as \"CALL probe_tool([('probe_key', 'probe value'), "
        "('probe_count', 3)])<|im_end|>\", which none of <tool_call> JSON, Llama 3's JSON reads back; give the "
        "tokenizer a response_template (transformers' response parsing) in its tokenizer_config.json, or use a "
        "template that writes <tool_call> JSON (--chat-template FILE.jinja)")


LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The value stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the key to look up"}},
                   "required": ["key"]}, "return": {"type": "string"}}}
VALUES = {"a": "17", "b": "42"}
PREEMPTING = """
import os
import signal
import time
from pathlib import Path


def lookup(key: str) -> str:
    \"\"\"The value stored under a key.

    Args:
        key: the key to look up
    \"\"\"
    if os.environ["RANK"] == "0":
        Path(os.environ["TOOL_MARK"]).write_text(repr(time.time()))
        os.kill(os.getppid(), signal.SIGTERM)  # a scheduler's preemption, to the launcher, which passes it on
        time.sleep(60)
    return {"a": "17", "b": "42"}.get(key, "unknown")
"""
REWARD = """
def right(prompts, completions, completion_ids, answer, **columns):
    return [float(answer in c[-1]["content"]) for c, answer in zip(completions, answer)]
"""


@pytest.fixture(scope="module")
def taught(chatml_model, train_env, tmp_path_factory) -> Path:
    """The tiny model taught by SFT to call lookup and answer with its result (a minute of the chat trainer on 64
    such conversations), its chats and prompts datasets (each prompt's key and answer its columns) beside it."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    folder = tmp_path_factory.mktemp("taught")
    for name in ("chats", "prompts"):
        (folder / name).mkdir()
    keys = "ab" * 32
    chats = [{"messages": [
        {"role": "user", "content": f"What is stored under {k}?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "lookup", "arguments": {"key": k}}}]},
        {"role": "tool", "name": "lookup", "content": VALUES[k]},
        {"role": "assistant", "content": VALUES[k]}], "tools": [LOOKUP]} for k in keys]
    prompts = [{"prompt": [{"role": "user", "content": f"What is stored under {k}?"}], "answer": VALUES[k], "key": k}
               for k in keys]
    for name, rows in (("chats", chats), ("prompts", prompts)):
        (folder / name / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        build_dataset(CorpusConfig(folder / name, folder / f"{name}-ds", num_proc=1))
    (folder / "rewards.py").write_text(REWARD)
    sft = run_script("fsdp1.py", "-e", "sft", "-d", folder / "chats-ds", "-m", chatml_model, "--save-dir",
                     folder / "runs", "--config", ROOT / "configs" / "demo.yaml", "--log-freq", 1, "--eval-freq", 0,
                     "--ckpt-freq", 0, "--max-steps", 100, "--lr", 1e-2, "-b", 8, "--seq-length", 1024,
                     env=train_env["env"])
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert losses(folder / "runs" / "sft")[100] < 0.1
    return folder


def test_grpo_with_tools_runs_episodes_of_tool_turns_on_two_ranks(chatml_model, taught, tool_file, train_env,
                                                                  tmp_path):
    """The taught model under GRPO with --tools under fsdp2 on 2 ranks (each forward a collective: the ranks agree
    on every tool turn): its completions call the tool, read its answer and end; the episodes' figures are logged
    under TRL's names and ours, and the samples show whole episodes; ddp, generating over its own replica, takes the
    same first step. A preemption while a tool runs stops every rank
    at once, in one line. The preflight refusals of --tools, each one line."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "rows.jsonl").write_text('{"prompt": "What is stored under a?", "answer": "17"}\n' * 4)
    build_dataset(CorpusConfig(tmp_path / "text", tmp_path / "text-ds", num_proc=1))
    grpo = ["-e", "r", "--save-dir", tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--objective",
            "grpo", "--reward", f"{taught / 'rewards.py'}:right"]
    assert preflight_errors([[*grpo, "-m", chatml_model, "-d", tmp_path / "text-ds", "--tools", tool_file],
                             [*grpo, "-m", "local/tiny", "-d", taught / "prompts-ds", "--tools", tool_file],
                             [*grpo, "-m", chatml_model, "-d", taught / "prompts-ds", "--tools", f"{tool_file}:nope"],
                             [*grpo, "-m", chatml_model, "-d", taught / "prompts-ds", "--tool-timeout", 5]],
                            train_env["env"]) == [
        f"--tools: 4 prompts of {tmp_path / 'text-ds'} are plain text, which no chat template renders with tools; "
        'give them as conversations ({"prompt": [{"role": "user", "content": ...}]})',
        "--tools: the chat template of local/tiny renders no tools (a prompt reads the same with them and without), so "
        "the model would never see them; use a template that does (the model's Instruct version's, or --chat-template "
        "FILE.jinja)",
        f"--tools {tool_file}:nope: {tool_file} defines no function nope",
        "--max-tool-calling-iterations and --tool-timeout are for --tools or --environment"]
    common = ["--save-dir", tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--log-freq", 1,
              "--eval-freq", 0, "--ckpt-freq", 0]
    def agent(name: str, strategy: str, steps: int) -> list[dict]:
        proc = torchrun(2, ROOT / "fsdp1.py", "-e", name, "-d", taught / "prompts-ds", "-m",
                        taught / "runs" / "sft" / "hf", *common, "--objective", "grpo", "--strategy", strategy,
                        "--num-generations", 2, "-b", 2, "--max-completion-length", 256, "--max-steps", steps,
                        "--reward", f"{taught / 'rewards.py'}:right", "--tools", f"{tool_file}:lookup",
                        env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return events(tmp_path / "runs" / name, "train")

    train = agent("agent", "fsdp2", 2)
    assert len(train) == 2
    # ddp generates over its own replica (no collective: each rank's episodes end on their own); its first step is
    # fsdp2's, where every rank agrees on each turn: the same episodes, rewards and loss
    (first,) = agent("ddp", "ddp", 1)
    keys = ("loss", "reward", "tools/call_frequency", "episodes/mean_turns", "episodes/mean_length")
    assert [first[k] for k in keys] == [train[0][k] for k in keys]
    assert first["grad_norm"] == pytest.approx(train[0]["grad_norm"], rel=1e-5)
    for e in train:
        # sampled at temperature 1, a call now and then names another tool or argument: answered, counted
        assert e["tools/call_frequency"] >= 0.5 and 0 <= e["tools/failure_frequency"] < 0.5
        assert e["episodes/mean_turns"] > 1 and e["episodes/mean_length"] > e["completions/mean_length"]
        assert 0 <= e["tools/parse_failure_frequency"] < 0.5 and e["tools/timeout_frequency"] == 0.0
    shown = [s["completion"] for s in events(tmp_path / "runs" / "agent", "sample")]
    assert any("<tool_response>" in c and c.split("<tool_response>")[1].strip().split()[0] in VALUES.values()
               for c in shown), shown
    # a preemption while rank 0's tool runs (and would run for a minute): the tool is interrupted at once, rank 1,
    # waiting in the turn's all-reduce, hears of it there, and the run stops in one line, exit 128 + SIGTERM
    (tmp_path / "preempting.py").write_text(PREEMPTING)
    mark = tmp_path / "called"
    with open(tmp_path / "p.log", "w") as out:
        argv = ["fsdp1.py", "--nproc-per-node", "2", "-e", "p", "-d", taught / "prompts-ds", "-m",
                taught / "runs" / "sft" / "hf", *common, "--objective", "grpo", "--strategy", "fsdp2",
                "--num-generations", 2, "-b", 2, "--max-completion-length", 256, "--max-steps", 2,
                "--reward", f"{taught / 'rewards.py'}:right", "--tools", tmp_path / "preempting.py"]
        proc = start_python([str(a) for a in argv], with_root({**train_env["env"], "TOOL_MARK": str(mark)}),
                            offline=True, stdout=out, stderr=subprocess.STDOUT)
        code = proc.wait(timeout=300)
    said = (tmp_path / "p.log").read_text()
    assert (code, "Traceback" in said) == (128 + signal.SIGTERM, False), said[-3000:]
    assert time.time() - float(mark.read_text()) < 60
    assert re.search(r"stopped by signal (during tool calls|during generation|during the rollouts) at step \d+",
                     said), said[-3000:]


def test_the_tool_turns_of_an_episode_have_no_loss_and_no_gradient():
    """The loss mask of a rollout with tool turns (GRPOObjective._loss_mask) leaves them out, so every loss type's
    gradient on their log-probabilities is exactly 0, the model's tokens around them keep theirs, and dapo's count
    is the model's tokens alone."""
    from types import SimpleNamespace

    from pipeline.config_grpo import GRPOConfig
    from pipeline.objectives.grpo import GRPOObjective
    from pipeline.objectives.grpo_losses import GRPOLossSettings, StepCounts, micro_loss, token_terms
    from pipeline.rl.rollout import Rollout

    # two completions: the first a model turn (3), a tool turn (2) and a model turn (2); the second one turn (4)
    tool_mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    real = torch.tensor([[1] * 7, [1, 1, 1, 1, 0, 0, 0]])
    r = Rollout(torch.zeros(2, 1), torch.ones(2, 1), torch.zeros(2, 7, dtype=torch.long), real, torch.zeros(2),
                torch.zeros(2, 1), torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool), [], [],
                tool_mask=tool_mask)
    assert r.lengths.tolist() == [5, 4]  # the model's tokens, as TRL counts them
    for loss_type in ("dapo", "dr_grpo", "grpo", "bnpo"):
        mask = GRPOObjective._loss_mask(SimpleNamespace(g=GRPOConfig(loss_type=loss_type)), r).float()
        assert mask.tolist() == (real * tool_mask).float().tolist()
        logps = torch.randn(2, 7, generator=torch.Generator().manual_seed(0)).requires_grad_()
        settings = GRPOLossSettings(loss_type, 0.2, 0.2, 0.0, 7)
        terms = token_terms(logps, logps.detach(), torch.tensor([1.0, -1.0]), settings, None, mask)
        micro_loss(terms.loss, mask, settings, StepCounts(int(mask.sum()), 2, 1, 1)).backward()
        assert (logps.grad[mask == 0] == 0).all() and (logps.grad[mask == 1] != 0).all(), loss_type


def test_the_bundled_example_offers_its_tools_and_its_prompts_render_with_them(chatml_model, tmp_path):
    """examples/tools: its tools load with their schemas, and its environment offers the same tools as methods and
    rewards a rollout whose tools computed the answer; DATA-HF reads its prompts as conversations, and each prompt
    renders with the tools' schemas before it (the prompt blocks the run builds)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from pipeline.config_grpo import GRPOConfig
    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.rl.environments import Environment
    from pipeline.rl.prompts import build_prompt_blocks

    tools = Tools(str(ROOT / "examples" / "tools" / "tools.py"), 60)
    assert [s["function"]["name"] for s in tools.schemas] == ["add", "multiply"]
    calculator = Environment(f"{ROOT / 'examples' / 'tools' / 'environment.py'}:Calculator", 60)
    assert Tools("", 60, calculator).schemas == tools.schemas  # the same tools, as methods
    (instance,) = calculator.instances(1)
    calculator.reset(instance, {"prompt": [], "answer": "122"})
    instance.multiply(a=59, b=63)
    assert instance.get_reward() == 0.0
    instance.add(a=59, b=63)
    assert instance.get_reward() == 1.0
    build_dataset(CorpusConfig(ROOT / "examples" / "tools" / "prompts", tmp_path / "ds", num_proc=1))
    tok = AutoTokenizer.from_pretrained(chatml_model)
    # the tiny vocabulary spends about 600 tokens on the two schemas (a real model's about 200)
    blocks = build_prompt_blocks(load_from_disk(str(tmp_path / "ds")), tok, GRPOConfig(max_prompt_length=2048),
                                 "26 Jul 2024", 0.0, 0, tok.eos_token_id, tools.schemas)
    assert blocks.counts["kept"] == 24
    part = blocks.part("train")
    first = tok.decode(part.blocks[0][part.mask[0].astype(bool)])
    assert first.index('"name": "add"') < first.index("<|im_start|>user") and "Use the tools." in first
    with pytest.raises(UserError, match=r"^24 prompts with the tools' schemas \(--tools, --environment\) are longer "
                                        r"than --max-prompt-length 8, and cutting "):
        build_prompt_blocks(load_from_disk(str(tmp_path / "ds")), tok, GRPOConfig(max_prompt_length=8),
                            "26 Jul 2024", 0.0, 0, tok.eos_token_id, tools.schemas)


def test_grpo_with_an_environment_scores_by_it_and_a_killed_run_resumes_its_episodes_bitwise(taught, train_env,
                                                                                            tmp_path):
    """The taught model under GRPO with --environment (the lookup tool a method of each rollout's instance, which
    knows the row's key; its get_reward, whether the model looked that key up, a reward beside --reward's): the
    episodes call it and both rewards are logged. Killed (SIGKILL) once step 2's checkpoint is complete, the rerun
    makes fresh instances and repeats the uninterrupted run's step 3 bit for bit: loss, rewards, and the episodes
    with their tool results."""
    from conftest import kill_tree, wait_for

    (tmp_path / "env.py").write_text(ENVIRONMENT)
    args = ["-d", taught / "prompts-ds", "-m", taught / "runs" / "sft" / "hf", "--save-dir", tmp_path / "runs",
            "--config", ROOT / "configs" / "demo.yaml", "--log-freq", 1, "--eval-freq", 0, "--ckpt-freq", 2,
            "--objective", "grpo", "--num-generations", 2, "-b", 2, "--max-completion-length", 128,
            "--warmup-steps", 0, "--lr-schedule", "constant", "--lr", 1e-4,
            "--reward", f"{taught / 'rewards.py'}:right", "--environment", f"{tmp_path / 'env.py'}:Keys"]
    whole = run_script("fsdp1.py", "-e", "whole", *args, "--max-steps", 3, env=train_env["env"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    train = events(tmp_path / "runs" / "whole", "train")
    assert len(train) == 3 and all(e["tools/call_frequency"] >= 0.5 for e in train)
    assert {"rewards/Keys/mean", "rewards/right/mean"} <= set(train[0])
    assert max(e["rewards/Keys/mean"] for e in train) > 0  # some episodes looked the row's key up
    samples = events(tmp_path / "runs" / "whole", "sample")
    again = tmp_path / "runs" / "again"
    proc = start_python(["fsdp1.py", *map(str, ["-e", "again", *args, "--max-steps", 40])],
                        with_root(train_env["env"]), offline=True, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    wait_for(lambda: any(e["step"] == 2 for e in events(again, "checkpoint")), proc)
    kill_tree(proc)
    assert proc.wait() == -signal.SIGKILL
    rerun = run_script("fsdp1.py", "-e", "again", *args, "--max-steps", 3, env=train_env["env"])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = events(again, "resume")
    assert resumed[0]["from_step"] == 2
    after = [e for e in events(again, "train") if e["time"] > resumed[0]["time"]]
    keys = ("loss", "grad_norm", "reward", "rewards/Keys/mean", "rewards/right/mean", "tools/call_frequency",
            "episodes/mean_length")
    assert [[e[k] for k in keys] for e in after] == [[e[k] for k in keys] for e in train[2:]]
    retold = [s["completion"] for s in events(again, "sample") if s["time"] >= resumed[0]["time"]]
    assert retold == [s["completion"] for s in samples if s["step"] == 3]


RANKS = '''
import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import pipeline.rl.episodes as episodes
from pipeline.model.head import Head
from pipeline.rl.generation import Sampling
from pipeline.rl.tool_calls import Tagged
from pipeline.rl.tools import Tools

model_dir, tool_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
end = tok.convert_tokens_to_ids("<|im_end|>")
turns = episodes.Turns(Tools(f"{tool_file}:lookup", 5), Tagged(), tok, "26 Jul 2024", 0, {end, tok.eos_token_id},
                       tok.eos_token_id)
rows = []
generate = episodes.generate
def counted(head, ids, *args, **kwargs):
    rows.append(ids.shape[0])
    return generate(head, ids, *args, **kwargs)
episodes.generate = counted
ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]
prompt = ids(tok.apply_chat_template([{"role": "user", "content": "What is stored under a?"}],
                                     tools=turns.tools.schemas, tokenize=False, add_generation_prompt=True))
# rank 0's first turn calls the tool, rank 1's answers: rank 1 has no episode to continue
first = '<tool_call>\\n{"name": "lookup", "arguments": {"key": "a"}}\\n</tool_call><|im_end|>' if rank == 0 \\
    else "17<|im_end|>"
found = {}
for mode, collective in (("together", True), ("alone", False)):  # every rank steps together, then each on its own
    rows.clear()
    (e,) = turns.continue_all(Head(model, False, 1), [prompt], [ids(first)], Sampling(256),
                              torch.Generator().manual_seed(rank), collective, torch.device("cpu"))
    found[mode] = {"ids": e.ids, "turns": e.turns, "calls": e.calls, "generated_rows": list(rows)}
json.dump(found, open(f"{out}-{rank}.json", "w"))
dist.destroy_process_group()
'''


def test_a_rank_with_no_episode_to_continue_steps_with_the_others_and_changes_nothing(chatml_model, tool_file,
                                                                                      train_env, tmp_path):
    """Collective generation on 2 ranks where only rank 0's row calls a tool: rank 1, with nothing to continue,
    generates one row it drops (every rank steps the same forwards), and rank 0's episode is the one it makes
    alone, token for token."""
    (tmp_path / "ranks.py").write_text(RANKS)
    proc = torchrun(2, tmp_path / "ranks.py", chatml_model, tool_file, tmp_path / "found", env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [json.loads((tmp_path / f"found-{r}.json").read_text()) for r in range(2)]
    together, alone = [f["together"] for f in found], [f["alone"] for f in found]
    assert [(r["turns"], r["calls"], r["generated_rows"]) for r in together] == [(2, 1, [1]), (1, 0, [1])]
    assert [(r["turns"], r["generated_rows"]) for r in alone] == [(2, [1]), (1, [])]
    assert together[0]["ids"] == alone[0]["ids"] and together[1]["ids"] == alone[1]["ids"]


SLOTS = '''
class Slots:
    made = 0

    def __init__(self):
        self.slot = Slots.made
        Slots.made += 1

    def reset(self, **row):
        self.keys = sorted(row)
        return f" slot {self.slot}"


def slot(prompts, completions, completion_ids, environments, **columns):
    return [float(e.slot) for e in environments]
'''


def test_observations_that_differ_within_a_group_each_reach_their_rollout(tiny_models, tmp_path):
    """An environment whose reset() observes its own instance: each rollout's prompt is its row's with that
    observation appended and tokenized again (the group's rollouts then differ, and are generated as rows of their
    own), and the reward functions get each rollout's instance beside its completion. An observation that makes the
    prompt longer than --max-prompt-length is one line."""
    import functools

    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data.batches import Batch
    from pipeline.rl.environments import Environment
    from pipeline.rl.generation import generate
    from pipeline.rl.prompts import PromptRow, observed_ids, tokenized
    from pipeline.rl.rewards import Rewards
    from pipeline.rl.rollout import Roller

    (tmp_path / "slots.py").write_text(SLOTS)
    env = Environment(f"{tmp_path / 'slots.py'}:Slots", 5)  # its probe instance is slot 0
    tok = AutoTokenizer.from_pretrained(tiny_models["tied"])
    head = Head(AutoModelForCausalLM.from_pretrained(tiny_models["tied"], dtype=torch.float32).eval(), False, 1)
    rows = [PromptRow("Count to 3:", {"answer": "3"})]
    ids = torch.tensor([tokenized(tok, rows[0], "")] * 2)
    # the second prompt a padding row (a validation batch's last): no instance, no reset, its ids as they are
    batch = Batch(ids, torch.full_like(ids, -100), None, torch.ones_like(ids), rows=np.array([0, -1]))

    def roller(limit: int, cut: bool = False) -> Roller:
        observed = functools.partial(observed_ids, tok, chat_date="", tools=None, limit=limit, cut=cut)
        rewards = Rewards(f"{tmp_path / 'slots.py'}:slot")
        rewards.check_columns({"answer": 1, "source": 0}, 1, "prompts")  # every column reaches reset(), as TRL's
        return Roller(head, rows, rewards, tok, {tok.eos_token_id}, tok.eos_token_id, collective=False,
                      environment=env, observed=observed)

    r = roller(64).roll(batch, 3, Sampling(6, greedy=True), None)
    assert r.prompts == ["Count to 3: slot 0", "Count to 3: slot 1", "Count to 3: slot 2", *["Count to 3:"] * 3]
    assert len(env.pool) == 3 and env.pool[0].keys == ["answer", "prompt", "source"]
    assert r.rewards[:3].tolist() == [0.0, 1.0, 2.0]  # each completion scored with its own instance
    shown = [tok.decode(row[keep.bool()].tolist()) for row, keep in zip(r.prompt_ids, r.prompt_mask, strict=True)]
    assert shown == r.prompts
    for i, prompt in enumerate(r.prompts):  # each generated after its own prompt, as it is alone
        alone = torch.tensor([tokenized(tok, PromptRow(prompt, {}), "")])
        ids, keep = generate(head, alone, torch.ones_like(alone), Sampling(6, greedy=True), {tok.eos_token_id},
                             tok.eos_token_id, None)
        assert r.completion_ids[i][r.completion_mask[i].bool()].tolist() == ids[0][keep[0].bool()].tolist()
    with pytest.raises(UserError, match=r"^--environment: the observation reset\(\) returned makes the prompt \d+ "
                                        r"tokens, above --max-prompt-length 4 \(prompt 'Count to 3: slot 0'\)"):
        roller(4).roll(batch, 3, Sampling(4), torch.Generator().manual_seed(0))
    cut = roller(4, cut=True).roll(batch, 3, Sampling(4), torch.Generator().manual_seed(0))  # no tools to lose
    assert cut.prompt_mask[:3].sum(1).tolist() == [4, 4, 4]


def test_an_episode_stops_after_max_tool_calling_iterations_or_at_its_length(chatml_model, tool_file):
    """A policy that calls the tool in every turn (scripted: the loop's bounds are under test, not a model's
    choice): --max-tool-calling-iterations 2 answers two turns' calls and ends the episode after the third turn, its
    call unanswered; with no cap, the episode runs until --max-completion-length leaves no room for a result."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chatml_model)
    tools, end = Tools(f"{tool_file}:lookup", 5), tok.convert_tokens_to_ids("<|im_end|>")
    call = tok('<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call><|im_end|>',
               add_special_tokens=False)["input_ids"]

    class Calling(Turns):
        def _generate(self, head, inputs, rooms, sampling, generator, collective, device):
            return [call[:room] for room in rooms]

    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "?"}], tools=tools.schemas, tokenize=False,
                                         add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    for cap, limit in ((2, 4096), (0, 400)):
        turns = Calling(tools, Tagged(), tok, "26 Jul 2024", cap, {end, tok.eos_token_id}, tok.eos_token_id)
        (e,) = turns.continue_all(None, [prompt], [call], Sampling(limit), None, False, torch.device("cpu"))
        roles = [m["role"] for m in e.messages]
        assert roles == ["assistant", "tool"] * (e.turns - 1) + ["assistant"] and e.calls == e.turns - 1
        assert len(e.ids) <= limit
        if cap:
            assert e.turns == cap + 1
        else:  # no cap: as many turns as the length allows, each call of them but the last answered
            suffix = len(e.ids) // e.turns
            assert e.turns > 3 and len(e.ids) + suffix > limit - len(call)
