"""Multi-turn rollouts (--tools): each completion continued through tool turns. The model's turn is parsed for tool
calls; the calls run (pipeline/rl/tools.py) and their results are rendered as the chat template renders tool turns,
appended to the row, and the model generates its next turn after them; until a turn calls no tool, the episode
reaches --max-completion-length, or --max-tool-calling-iterations turns have called tools. The tokens the template
added for the tool turns are the episode's but not the model's: their mask is 0, so no loss reads them.

The suffix of a tool turn is computed as TRL computes it (a short conversation that ends in an assistant turn
calling the tool, rendered with and without the tool messages; the difference), so the episode's tokens are the
prompt's, the model's, and the template's own rendering of each tool turn.

Hazards:
- Under a sharding strategy each forward is a collective, so every rank runs the same number of tool iterations and
  each generation with the same token budget (both all-reduced; a rank whose rows are all done generates one row it
  then drops). A stop signal rides on the same all-reduce, so every rank stops at the same turn; over a replica the
  rollout's caller agrees after.
- Every other rank waits in that all-reduce while a rank's tools run, one call after another: rows x calls x
  --tool-timeout must stay within the process group's timeout (--collective-timeout)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeline.data.chat_render import render
from pipeline.errors import UserError
from pipeline.rl.generation import Sampling, generate, padded
from pipeline.rl.tool_calls import CallReader, Parsed
from pipeline.rl.tools import Result, Tools
from pipeline.signals import Stopped, StopRequest


@dataclass
class Episode:
    """One row's completion continued through its tool turns."""

    ids: list[int]
    """Every token after the prompt: the model's and the template's tool turns."""
    model: list[int]
    """1 where the model wrote the token, 0 where a tool turn's rendering did."""
    messages: list[dict] = field(default_factory=list)
    """The assistant and tool turns, as TRL passes completions to rewards."""
    calls: int = 0
    failures: int = 0
    """Calls that raised, named no tool, took other arguments, or timed out (counted in calls)."""
    parse_failures: int = 0
    """Turns whose tool call did not parse (answered with the error, counted apart from calls)."""
    timeouts: int = 0
    turns: int = 1
    """The model's turns."""
    parsed: Parsed | None = None
    """The calls of the model's last turn, parsed once (what _wants_tools and _answer read)."""
    table: dict = field(default_factory=dict)
    """The tools this episode calls (Tools.table: --tools' functions, its environment instance's methods)."""


@dataclass(frozen=True)
class Turns:
    """What continues episodes: the tools, the template's rendering and the generation's settings."""

    tools: Tools
    reader: CallReader
    """How the model's calls are read back (tool_calls.call_reader: as its chat template writes them)."""
    tokenizer: object
    chat_date: str
    max_iterations: int
    """Tool-calling turns at most (0: only --max-completion-length bounds the episode)."""
    stops: set[int]
    pad_id: int

    def continue_all(self, head, prompts: list[list[int]], first: list[list[int]], sampling: Sampling,
                     generator: torch.Generator | None, collective: bool, device: torch.device,
                     environments: list | None = None) -> list[Episode]:
        """Each row's episode from the prompt's ids (unpadded) and its first turn's (through its stop token), its
        tools those of its environment instance where it has one. A collective where generation is one: every rank
        calls it, with the same sampling; a stop signal is then Stopped on every rank at the same turn."""
        instances = environments or [None] * len(first)
        episodes = [Episode(list(ids), [1] * len(ids), table=self.tools.table(env))
                    for ids, env in zip(first, instances, strict=True)]
        for e, prompt, ids in zip(episodes, prompts, first, strict=True):
            self._turn(e, prompt, ids)
        limit = sampling.max_tokens
        pending = [i for i, e in enumerate(episodes) if self._wants_tools(e) and len(e.ids) < limit]
        iteration = 0
        while self._agreed(bool(pending), collective) and (not self.max_iterations or iteration < self.max_iterations):
            answers = self._results([episodes[i] for i in pending])
            rows, suffixes = [], []
            for i, results in zip(pending, answers, strict=True):
                suffix = self._answer(episodes[i], results, limit)
                if suffix is not None:
                    rows.append(i)
                    suffixes.append(suffix)
            rooms = [limit - len(episodes[i].ids) - len(s) for i, s in zip(rows, suffixes, strict=True)]
            budget = self._agreed_budget(max(rooms, default=0), collective)
            if budget <= 0:
                break
            inputs = [prompts[i] + episodes[i].ids + s for i, s in zip(rows, suffixes, strict=True)]
            turns = self._generate(head, inputs or [prompts[0]], rooms or [budget],
                                   dataclasses.replace(sampling, max_tokens=budget), generator, collective, device)
            # a rank with no row to continue generated one it drops here (strict=False: turns has it, rows not)
            for i, suffix, room, ids in zip(rows, suffixes, rooms, turns, strict=False):
                ids = ids[:room]  # a row that reached its room has padding after it
                e = episodes[i]
                e.ids += suffix + ids
                e.model += [0] * len(suffix) + [1] * len(ids)
                self._turn(e, prompts[i], ids)
                e.turns += 1
            pending = [i for i in rows if self._wants_tools(episodes[i]) and len(episodes[i].ids) < limit]
            iteration += 1
        return episodes

    def _turn(self, e: Episode, prompt: list[int], ids: list[int]) -> None:
        """The model's turn (the episode's last ids) added to its messages: its text, and its calls where they parse
        (kept parsed). They are read from the turn's text with its special tokens (a template may write a call with
        them), after the text the turn continues."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        before = self.tokenizer.decode(prompt + e.ids[:len(e.ids) - len(ids)], skip_special_tokens=False)
        e.parsed = self.reader.parse(self.tokenizer.decode(ids, skip_special_tokens=False), before)
        message = {"role": "assistant", "content": text}
        if e.parsed.calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in e.parsed.calls]
        e.messages.append(message)

    @staticmethod
    def _wants_tools(e: Episode) -> bool:
        return bool(e.parsed.calls or e.parsed.error)

    def _results(self, episodes: list[Episode]) -> list[list[Result] | None]:
        """The results of the calls of each episode's last turn (the calls that parsed, then the error of the one
        that did not), the async tools of every episode awaited together; None for every episode where a stop signal
        came (no more tools run; the ranks agree on it after)."""
        calls = [(c, e.table) for e in episodes for c in e.parsed.calls]
        try:
            if StopRequest.signum:
                raise Stopped("during tool calls")
            flat = iter(self.tools.run_all(calls))
        except Stopped:
            return [None] * len(episodes)
        out = []
        for e in episodes:
            results = [next(flat) for _ in e.parsed.calls]
            if e.parsed.error:
                results.append(Result("tool_call", f"error: {e.parsed.error}", "parse"))
            out.append(results)
        return out

    def _answer(self, e: Episode, results: list[Result] | None, limit: int) -> list[int] | None:
        """The tool turns answering the episode's last turn with the results, rendered; None where they would not
        fit the episode's length (the episode then ends as it is, as TRL rolls such results back), or where a stop
        signal came (results None)."""
        if results is None:
            return None
        messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        suffix = self._suffix(messages)
        if len(e.ids) + len(suffix) >= limit:
            return None
        e.messages.extend(messages)
        e.parse_failures += sum(r.outcome == "parse" for r in results)
        e.calls += sum(r.outcome != "parse" for r in results)
        e.failures += sum(r.outcome in ("error", "timeout") for r in results)
        e.timeouts += sum(r.outcome == "timeout" for r in results)
        return suffix

    def _suffix(self, messages: list[dict]) -> list[int]:
        """The template's tokens for tool turns after an assistant turn that called the tool, up to the next
        assistant header: a short conversation (as TRL's _get_tool_suffix_ids builds it) rendered with the tool turns
        and the generation prompt, from the end of its assistant turn on. The end is found in that same rendering (a
        template may render a turn otherwise when it is the last one: Qwen 3 adds an empty <think> block), by
        counting the end-of-turn tokens of the conversation before the assistant turn."""
        call = [{"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}]
        user = [{"role": "user", "content": "dummy"}]
        head = [*user, {"role": "assistant", "content": "", "tool_calls": call}]
        before = self._ends_before
        full = self._ids(render(self.tokenizer, head + messages, self.chat_date, add_generation_prompt=True))
        ends = [i for i, t in enumerate(full) if t in self.stops]
        if len(ends) <= before:
            raise UserError("the chat template ends no assistant turn with a stop token (its EOS or an end-of-turn "
                            "token the model's generation_config lists), so a tool turn cannot be placed after one")
        return full[ends[before] + 1:]

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @functools.cached_property
    def _ends_before(self) -> int:
        """The end-of-turn tokens of a one-user-turn conversation, before the assistant turn _suffix places."""
        user = [{"role": "user", "content": "dummy"}]
        return sum(t in self.stops for t in self._ids(render(self.tokenizer, user, self.chat_date)))

    def _generate(self, head, inputs: list[list[int]], rooms: list[int], sampling: Sampling,
                  generator: torch.Generator | None, collective: bool, device: torch.device) -> list[list[int]]:
        """The next turn of each row (left-padded inputs), through its first stop token, at most its room."""
        ids, mask = padded(inputs, self.pad_id, device, left=True)
        completion, cmask = generate(head, ids, mask, sampling, self.stops, self.pad_id, generator, collective,
                                     limits=torch.tensor(rooms, device=device))
        lengths = cmask.sum(-1).tolist()
        return [c[:n] for c, n in zip(completion.tolist(), lengths, strict=True)]

    @staticmethod
    def _agreed(mine: bool, collective: bool) -> bool:
        """Whether any rank has an episode to continue (every rank, where generation is a collective), and a stop
        signal on any rank: then Stopped on every rank alike. Over a replica, this rank's own (a signal ends its
        turns; the rollout's caller agrees with the others after)."""
        if not (collective and dist.is_initialized() and dist.get_world_size() > 1):
            return mine and not StopRequest.signum
        flags = torch.tensor([float(mine), float(StopRequest.signum != 0)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # CPU tensor: gloo on the host, the same on every rank
        if flags[1]:
            raise Stopped("during tool calls")
        return bool(flags[0])

    @staticmethod
    def _agreed_budget(mine: int, collective: bool) -> int:
        """The next turn's token budget, the largest over the ranks where generation is a collective (every rank
        steps the same tokens; each row is cut to its own room after)."""
        if not (collective and dist.is_initialized() and dist.get_world_size() > 1):
            return mine
        budget = torch.tensor([float(mine)])
        dist.all_reduce(budget, op=dist.ReduceOp.MAX)
        return int(budget.item())
