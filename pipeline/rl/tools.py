"""The user's tools (--tools FILE.py[:NAME,...], and --environment's methods): plain Python functions with type hints
and a docstring, offered to the model through the chat template's tools (their JSON schema as transformers'
get_json_schema derives it, TRL's rule, so a TRL user's tool file runs unchanged), and the model's calls of them parsed
and run: plain ones in turn, `async def` ones awaited together on the process's event loop.

A call is the model's to get right: one that does not parse, names no tool, passes arguments the function does not
take, raises, or runs past --tool-timeout is answered with an error message as the tool's result (counted), and the
episode goes on. SystemExit or a stop signal inside a tool is the run's (one line; a stop).

Hazards: a plain tool's time limit is user_code's watchdog signal to the main thread (a tool on another thread has
none), an async tool's asyncio's (one that never awaits cannot be stopped by it); a tool that hangs in C code holding
the GIL cannot be stopped."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError
from pipeline.rl import user_code
from pipeline.rl.environments import Environment
from pipeline.rl.tool_calls import Call, CallReader
from pipeline.signals import SignalInUserCode, Stopped, StopRequest


@dataclass(frozen=True)
class Result:
    name: str
    content: str
    outcome: str
    """ok, error (the tool raised, or the call was wrong) or timeout."""


class Tools:
    """The tools of a run, loaded once per process: the functions of --tools and the methods of --environment (bound
    to each rollout's instance), with their schemas and identity."""

    def __init__(self, spec: str, timeout: float, environment: Environment | None = None) -> None:
        self.spec, self.timeout, self.environment = spec, timeout, environment
        self.functions: dict[str, Callable] = {}
        """The functions of --tools (none without it)."""
        self.identity = ""
        """--tools' file name, functions and content hash ("" without it): the run's fingerprint holds it."""
        self.reader: CallReader | None = None
        """How the model's calls are read back: chosen once, by preflight (grpo_plan.plan_tools), where there are
        tools to call."""
        if spec:
            cut = spec.rfind(".py:")  # FILE.py:NAME,NAME (a path may hold ':' of its own)
            path, names = (spec[:cut + 3], spec[cut + 4:]) if cut >= 0 else (spec, "")
            path, names = Path(path), [n.strip() for n in names.split(",") if n.strip()]
            module, digest = user_code.load_file(path, f"--tools {spec}")
            self.functions = self._chosen(module, names, path)
            # the file's name, not its path: a rerun from another folder names the same file otherwise
            self.identity = f"{path.name}:{','.join(self.functions)}:{digest}"
        methods = environment.methods if environment else []
        if twice := sorted(set(methods) & set(self.functions)):
            raise UserError(f"--tools {spec} and --environment {environment.spec} both offer a tool {twice[0]}; the "
                            "model calls a tool by its name, so rename one")
        self.schemas = [self._schema(name, fn) for name, fn in self.functions.items()] + [
            self._schema(name, getattr(environment.pool[0], name), f"--environment {environment.spec}")
            for name in methods]

    def table(self, instance: object | None = None) -> dict[str, Callable]:
        """The tools one rollout calls: --tools' functions and its environment instance's methods (none without
        one: a padding row's)."""
        methods = self.environment.methods if self.environment and instance is not None else []
        return {**self.functions, **{name: getattr(instance, name) for name in methods}}

    def _chosen(self, module, names: list[str], path: Path) -> dict[str, Callable]:
        """The functions named, or every public function the file defines."""
        if not names:
            names = [n for n, obj in vars(module).items() if inspect.isfunction(obj) and not n.startswith("_")
                     and obj.__module__ == module.__name__]
            if not names:
                raise UserError(f"--tools {self.spec}: the file defines no public function to offer as a tool")
        chosen = {}
        for name in names:
            fn = getattr(module, name, None)
            if not callable(fn):
                raise UserError(f"--tools {self.spec}: {path} defines no function {name}")
            chosen[name] = fn
        return chosen

    def _schema(self, name: str, fn: Callable, what: str = "") -> dict:
        from transformers.utils import get_json_schema

        try:
            return get_json_schema(fn)
        except Exception as exc:  # transformers' TypeHintParsingException, DocstringParsingException
            raise UserError(f"{what or f'--tools {self.spec}'}: {name} cannot be offered as a tool: {exc} (a tool "
                            "needs a type hint on every argument and a docstring with an Args: section describing "
                            "each, as transformers' get_json_schema reads them)") from None

    def run_all(self, calls: list[tuple[Call, dict[str, Callable]]]) -> list[Result]:
        """Each call's answer, as text, from the table of tools it was made with (Tools.table): the tool's return
        value (str() of it), or the error the model made or met. Plain functions run in turn, each under
        --tool-timeout; `async def` ones (TRL's async tools) are awaited together, each under its own --tool-timeout.
        A stop signal interrupts them (Stopped); SystemExit from one is one line."""
        results: list[Result | None] = [None] * len(calls)
        waiting = []
        for i, (call, table) in enumerate(calls):
            fn = table.get(call.name)
            if fn is None:
                results[i] = Result(call.name, f"error: there is no tool {call.name!r}; the tools are "
                                    f"{', '.join(table)}", "error")
            elif inspect.iscoroutinefunction(fn):
                waiting.append(i)
            else:
                results[i] = self._run(call, fn)
        for i, result in zip(waiting, self._awaited([calls[i] for i in waiting]), strict=True):
            results[i] = result
        return results

    def _run(self, call: Call, fn: Callable) -> Result:
        try:
            with user_code.time_limit(self.timeout), StopRequest.interrupting():
                value = fn(**call.arguments)
        except SignalInUserCode:
            raise Stopped(f"in the tool {call.name}") from None
        except user_code.TimedOut:
            return self._late(call)
        except (SystemExit, KeyboardInterrupt) as exc:
            raise UserError(user_code.exit_line(f"the tool {call.name}", exc)) from None
        except Exception as exc:  # the tool's own failure, or arguments it does not take: the model's to read
            return Result(call.name, f"error: {type(exc).__name__}: {exc}", "error")
        return Result(call.name, str(value), "ok")  # as TRL gives a tool's value to the template

    def _awaited(self, calls: list[tuple[Call, dict[str, Callable]]]) -> list[Result]:
        """The async tools' answers, awaited together on the process's event loop (user_code.await_all)."""
        if not calls:
            return []

        def maker(call: Call, fn: Callable) -> Callable[[], Awaitable]:
            return lambda: asyncio.wait_for(fn(**call.arguments), self.timeout or None)

        names = ", ".join(dict.fromkeys(c.name for c, _ in calls))
        outcomes = user_code.await_all(f"the tools {names}", [maker(c, t[c.name]) for c, t in calls])
        results = []
        for (call, _), (raised, value) in zip(calls, outcomes, strict=True):
            if not raised:
                results.append(Result(call.name, str(value), "ok"))
            elif isinstance(value, TimeoutError):
                results.append(self._late(call))
            elif isinstance(value, (SystemExit, KeyboardInterrupt)):
                raise UserError(user_code.exit_line(f"the tool {call.name}", value))
            elif StopRequest.signum:  # a stop it turned into an error of its own: a stop still
                raise Stopped(f"in the tool {call.name}")
            elif isinstance(value, Exception):
                results.append(Result(call.name, f"error: {type(value).__name__}: {value}", "error"))
            else:  # asyncio.CancelledError and the like: the run's, not the model's
                raise UserError(f"the tool {call.name} raised {type(value).__name__}: {value}")
        return results

    def _late(self, call: Call) -> Result:
        return Result(call.name, f"error: {call.name} did not return within {self.timeout:g} s", "timeout")
