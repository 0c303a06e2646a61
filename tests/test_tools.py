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
from pipeline.rl.tools import Call, Tools

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
    tools = Tools(str(tool_file), 0.3)
    text = 'Let me see.<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>' \
           '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"b\\"}"}</tool_call>'
    parsed = tools.parse(text)
    assert parsed.calls == [Call("lookup", {"key": "a"}), Call("lookup", {"key": "b"})] and not parsed.error
    assert [tools.run(c).content for c in parsed.calls] == ["17", "42"]
    assert tools.parse("no call at all") == tools.parse("") and not tools.parse("plain").calls
    drafted = '<think>maybe <tool_call>{"name": "lookup", "arguments": {"key": "b"}}</tool_call></think>'
    assert tools.parse(drafted + text).calls == parsed.calls  # a call drafted while reasoning is not made
    assert tools.parse("<tool_call>{name: lookup}</tool_call>").error.startswith("the tool call is not JSON")
    assert tools.parse('<tool_call>{"name": "lookup"').error == "a <tool_call> tag is not closed by </tool_call>"
    assert tools.parse('<tool_call>["lookup"]</tool_call>').error.startswith("a tool call must be a JSON object")
    answers = [tools.run(Call("broken", {"x": 3})), tools.run(Call("nothing", {})),
               tools.run(Call("lookup", {"wrong": 1}))]
    assert [(a.outcome, a.content) for a in answers[:2]] == [
        ("error", "error: ValueError: no luck with 3"),
        ("error", "error: there is no tool 'nothing'; the tools are lookup, broken, slow")]
    assert answers[2].outcome == "error" and answers[2].content.startswith("error: TypeError: ")
    start = time.monotonic()
    late = tools.run(Call("slow", {"seconds": 30}))
    assert (late.outcome, late.content) == ("timeout", "error: slow did not return within 0.3 s")
    assert time.monotonic() - start < 5
    assert tools.run(Call("slow", {"seconds": 0})).content == "woke"  # the limit is disarmed after a call


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


def test_an_episode_is_the_templates_rendering_of_its_conversation_and_its_tool_turns_are_not_the_models(
        chatml_model, tool_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chatml_model)
    model = AutoModelForCausalLM.from_pretrained(chatml_model).eval()
    tools = Tools(f"{tool_file}:lookup", 5)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = Turns(tools, tok, "26 Jul 2024", 1, {end, tok.eos_token_id}, tok.eos_token_id)
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


def test_grpo_with_tools_runs_episodes_of_tool_turns_on_two_ranks(chatml_model, tool_file, train_env, tmp_path):
    """The tiny model taught by SFT to call lookup and answer with its result (a minute of the chat trainer on 64
    such conversations), then GRPO with --tools under fsdp2 on 2 ranks (each forward a collective: the ranks agree
    on every tool turn): its completions call the tool, read its answer and end; the episodes' figures are logged
    under TRL's names and ours, and the samples show whole episodes. A preemption while a tool runs stops every rank
    at once, in one line. The preflight refusals of --tools, each one line."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    for folder in ("chats", "prompts"):
        (tmp_path / folder).mkdir()
    keys = "ab" * 32
    chats = [{"messages": [
        {"role": "user", "content": f"What is stored under {k}?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "lookup", "arguments": {"key": k}}}]},
        {"role": "tool", "name": "lookup", "content": VALUES[k]},
        {"role": "assistant", "content": VALUES[k]}], "tools": [LOOKUP]} for k in keys]
    prompts = [{"prompt": [{"role": "user", "content": f"What is stored under {k}?"}], "answer": VALUES[k]}
               for k in keys]
    for folder, rows in (("chats", chats), ("prompts", prompts)):
        (tmp_path / folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        build_dataset(CorpusConfig(tmp_path / folder, tmp_path / f"{folder}-ds", num_proc=1))
    (tmp_path / "rewards.py").write_text(REWARD)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "rows.jsonl").write_text('{"prompt": "What is stored under a?", "answer": "17"}\n' * 4)
    build_dataset(CorpusConfig(tmp_path / "text", tmp_path / "text-ds", num_proc=1))
    grpo = ["-e", "r", "--save-dir", tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--objective",
            "grpo", "--reward", f"{tmp_path / 'rewards.py'}:right"]
    assert preflight_errors([[*grpo, "-m", chatml_model, "-d", tmp_path / "text-ds", "--tools", tool_file],
                             [*grpo, "-m", "local/tiny", "-d", tmp_path / "prompts-ds", "--tools", tool_file],
                             [*grpo, "-m", chatml_model, "-d", tmp_path / "prompts-ds", "--tools", f"{tool_file}:nope"],
                             [*grpo, "-m", chatml_model, "-d", tmp_path / "prompts-ds", "--tool-timeout", 5]],
                            train_env["env"]) == [
        f"--tools: 4 prompts of {tmp_path / 'text-ds'} are plain text, which no chat template renders with tools; "
        'give them as conversations ({"prompt": [{"role": "user", "content": ...}]})',
        "--tools: the chat template of local/tiny renders no tools (a prompt reads the same with them and without), so "
        "the model would never see them; use a template that does (the model's Instruct version's, or --chat-template "
        "FILE.jinja)",
        f"--tools {tool_file}:nope: {tool_file} defines no function nope",
        "--max-tool-calling-iterations and --tool-timeout are for --tools"]
    common = ["--save-dir", tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml", "--log-freq", 1,
              "--eval-freq", 0, "--ckpt-freq", 0]
    sft = run_script("fsdp1.py", "-e", "sft", "-d", tmp_path / "chats-ds", "-m", chatml_model, *common,
                     "--max-steps", 100, "--lr", 1e-2, "-b", 8, "--seq-length", 1024, env=train_env["env"])
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert losses(tmp_path / "runs" / "sft")[100] < 0.1
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "agent", "-d", tmp_path / "prompts-ds", "-m",
                    tmp_path / "runs" / "sft" / "hf", *common, "--objective", "grpo", "--strategy", "fsdp2",
                    "--num-generations", 2, "-b", 2, "--max-completion-length", 256, "--max-steps", 2,
                    "--reward", f"{tmp_path / 'rewards.py'}:right", "--tools", f"{tool_file}:lookup",
                    env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = events(tmp_path / "runs" / "agent", "train")
    assert len(train) == 2
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
        argv = ["fsdp1.py", "--nproc-per-node", "2", "-e", "p", "-d", tmp_path / "prompts-ds", "-m",
                tmp_path / "runs" / "sft" / "hf", *common, "--objective", "grpo", "--strategy", "fsdp2",
                "--num-generations", 2, "-b", 2, "--max-completion-length", 256, "--max-steps", 2,
                "--reward", f"{tmp_path / 'rewards.py'}:right", "--tools", tmp_path / "preempting.py"]
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
    """examples/tools: its tools load with their schemas, DATA-HF reads its prompts as conversations, and each
    prompt renders with the tools' schemas before it (the prompt blocks the run builds)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from pipeline.config_grpo import GRPOConfig
    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.rl.prompts import build_prompt_blocks

    tools = Tools(str(ROOT / "examples" / "tools" / "tools.py"), 60)
    assert [s["function"]["name"] for s in tools.schemas] == ["add", "multiply"]
    build_dataset(CorpusConfig(ROOT / "examples" / "tools" / "prompts", tmp_path / "ds", num_proc=1))
    tok = AutoTokenizer.from_pretrained(chatml_model)
    # the tiny vocabulary spends about 600 tokens on the two schemas (a real model's about 200)
    blocks = build_prompt_blocks(load_from_disk(str(tmp_path / "ds")), tok, GRPOConfig(max_prompt_length=2048),
                                 "26 Jul 2024", 0.0, 0, tok.eos_token_id, tools.schemas)
    assert blocks.counts["kept"] == 24
    part = blocks.part("train")
    first = tok.decode(part.blocks[0][part.mask[0].astype(bool)])
    assert first.index('"name": "add"') < first.index("<|im_start|>user") and "Use the tools." in first
    with pytest.raises(UserError, match=r"^--tools: 24 prompts are longer than --max-prompt-length 8, and cutting "):
        build_prompt_blocks(load_from_disk(str(tmp_path / "ds")), tok, GRPOConfig(max_prompt_length=8),
                            "26 Jul 2024", 0.0, 0, tok.eos_token_id, tools.schemas)
