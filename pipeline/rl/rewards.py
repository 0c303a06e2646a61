"""GRPO's rewards: the user's Python functions (TRL's signature) and the built-in checks, loaded once, called in the
training process on each rank's own completions, and every value they return checked before it steers a gradient.

A reward function is `fn(prompts, completions, completion_ids, **columns) -> list[float | None]`: prompts and
completions are strings (standard prompts) or lists of messages (conversational ones), completion_ids the token ids,
and each of the prompt rows' other columns a keyword argument holding one value per completion. None abstains: the
reward is the weighted sum of the values given (TRL's nansum). As TRL does, a function also gets `trainer_state`,
`log_metric(name, value)` (a scalar averaged over the log window and every rank, logged under that name) and
`log_extra(column, values)` (one value per completion, shown with the completions in the samples log).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import time
from dataclasses import dataclass

import torch

from pipeline.errors import UserError
from pipeline.rl import user_code
from pipeline.rl.builtin_rewards import BUILT_IN, RewardFn, text_of
from pipeline.rl.environments import Environment
from pipeline.rl.reward_model import RewardModelFn
from pipeline.rl.reward_specs import RewardSpec, load, named, parse_rewards
from pipeline.signals import Stopped, StopRequest


@dataclass(frozen=True)
class RewardState:
    """What a reward function gets as `trainer_state` (TRL passes its TrainerState): the optimizer steps completed
    when the completions were generated, so a reward shaped by progress is the same on a resumed run."""

    global_step: int
    max_steps: int


FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest reward that is a number in the float32 the advantages are computed in (1e39 is inf there)."""
MAX_TOTAL = 1e15
"""The largest weighted reward: the squares of a group's deviations (up to 4096 of them) then fit float32, so its
std, and every advantage, is a number (a reward of 1e20 made the std inf and every advantage 0)."""


class Rewards:
    """The run's reward functions, loaded, and their weighted sum over a batch of completions."""

    def __init__(self, text: str, chat_date: str = "", timeout: float = 0, environment: Environment | None = None):
        self.specs = parse_rewards(text)
        rewarded = environment is not None and environment.rewarded
        if rewarded and environment.name in self.names:
            raise UserError(f"--reward names {environment.name}, which is also the name of --environment's reward "
                            "(its class's get_reward); rename the function")
        if not self.specs and not rewarded:
            raise UserError("--objective grpo needs at least one --reward (FILE.py:FUNCTION[:WEIGHT] or a built-in: "
                            f"{', '.join(BUILT_IN)}), or an --environment whose class has get_reward()")
        loaded = [load(spec, chat_date) for spec in self.specs]
        if rewarded:  # TRL's: a reward of its own, weight 1, named by the class
            self.specs.append(RewardSpec(environment.name, 1.0, environment.path))
            loaded.append((environment.reward_function(), environment.identity))
        if not any(s.weight for s in self.specs):
            raise UserError(f"every --reward has weight 0 ({', '.join(named(s) for s in self.specs)}): every "
                            "completion would get reward 0 and advantage 0, so nothing would train; give at least "
                            "one a non-zero weight")
        self.timeout = timeout
        """Seconds one call of a reward function may take (--reward-timeout; 0: no limit)."""
        self.columns: list[str] = []
        """Every column of the run's prompt rows (check_columns): each function gets them all, None where a row
        has none, as TRL passes a dataset's columns."""
        self.functions = [fn for fn, _ in loaded]
        self.identity = [spec.identity(digest) for spec, (_, digest) in zip(self.specs, loaded, strict=True)]
        """What the run's fingerprint holds: a reward changed on resume is refused in one line."""
        if rewarded:  # the environment's file by its name, not its path: a rerun from another folder is the same
            self.identity[-1] = f"{environment.name}:1.0:{environment.identity}"
        self.weights = torch.tensor([s.weight for s in self.specs], dtype=torch.float32)
        self.metrics: dict[str, list[float]] = {}
        """What the functions passed to log_metric since the last take_metrics()."""
        self.extra: dict[str, list] = {}
        """The last score()'s log_extra columns: one JSON value per completion scored."""

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Load the reward models among the rewards onto this rank's device (the functions need nothing)."""
        for fn in self.functions:
            if isinstance(fn, RewardModelFn):
                fn.place(device, dtype)

    @property
    def model_params(self) -> int:
        """Parameters of the reward models among the rewards (resident on every rank beside the policy)."""
        return sum(fn.num_params for fn in self.functions if isinstance(fn, RewardModelFn))

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def check_columns(self, columns: dict[str, int], rows: int, data: str) -> None:
        """The prompt rows' columns (name: rows holding it, of rows) kept for score(); a built-in that reads a
        column no row has would abstain on every completion: one line."""
        self.columns = sorted(columns)
        if any(s.name == "accuracy" and not s.path and not s.model for s in self.specs) and not columns.get("answer"):
            raise UserError(f"--reward accuracy compares each completion with its prompt's `answer` column, and none "
                            f"of the {rows:,} prompts of {data} has one (their columns: "
                            f"{', '.join(self.columns) or 'none'}); add answers, or use another reward")

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: list[dict],
              state: RewardState | None = None, environments: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards [n], per function [n, F] with NaN where one abstained): the weighted sum of the values given, NaN
        where every function abstained (TRL leaves such a completion out of its group's mean and std). `async def`
        functions are awaited together first, then the others called in turn. Any function that raises or returns a
        wrong count, NaN, inf or a non-number stops the run in one line naming it and the prompt. state: TRL's
        trainer_state argument (None: not passed). environments: each completion's --environment instance (TRL's
        `environments` argument; None: not passed)."""
        # a column named as one of the functions' own arguments cannot reach them (TRL's signature takes them first)
        own = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra", "environments")
        keys = dict.fromkeys([*self.columns, *(k for row in columns for k in row)])
        kwargs = {key: [row.get(key) for row in columns] for key in keys if key not in own}
        if state is not None:  # for rewards shaped by training progress, as TRL passes it
            kwargs["trainer_state"] = state
        if environments is not None:
            kwargs["environments"] = environments
        self.extra = {}
        per = torch.full((len(completions), len(self.functions)), math.nan, dtype=torch.float32)
        args = [{**kwargs, "log_metric": functools.partial(self._log_metric, spec),
                 "log_extra": functools.partial(self._log_extra, spec, len(completions))} for spec in self.specs]
        found = self._awaited(prompts, completions, completion_ids, args)
        for j, (spec, fn) in enumerate(zip(self.specs, self.functions, strict=True)):
            values = found[j] if j in found else self._call(spec, fn, prompts, completions, completion_ids, args[j])
            for i, value in enumerate(self._checked(spec, values, prompts, completions)):
                if value is not None:
                    per[i, j] = float(value)
        total = (per * self.weights).nansum(dim=1)
        if (too := (total.abs() > MAX_TOTAL) | ~torch.isfinite(total)).any():  # NaN is no scorer's: set below
            i = int(too.nonzero()[0])
            raise UserError(f"the weighted reward of the completion {_shown(completions[i])} of prompt "
                            f"{_shown(prompts[i])} is {float(total[i]):g} ({', '.join(self.names)} gave "
                            f"{per[i].tolist()} at weights {self.weights.tolist()}): beyond +-{MAX_TOTAL:g}, its "
                            "group's std overflows float32 and every advantage becomes 0; scale the rewards down")
        total[torch.isnan(per).all(dim=1)] = torch.nan  # no function scored it: unscored, not 0 (as TRL 1.16)
        return total, per

    def take_metrics(self) -> dict[str, list[float]]:
        """The values log_metric got since the last call, by name; then none."""
        out, self.metrics = self.metrics, {}
        return out

    def _log_metric(self, spec: RewardSpec, name: object, value: object) -> None:
        if not isinstance(name, str) or not name:
            raise UserError(f"reward {named(spec)} called log_metric with the name {name!r:.40}; a metric's name is a "
                            "non-empty string")
        if isinstance(value, bool) or not _within(value, math.inf):
            raise UserError(f"reward {named(spec)} logged {value!r:.40} as the metric {name}; log_metric takes a "
                            "finite number")
        self.metrics.setdefault(name, []).append(float(value))

    def _log_extra(self, spec: RewardSpec, count: int, column: object, values: object) -> None:
        if not isinstance(column, str) or not column:
            raise UserError(f"reward {named(spec)} called log_extra with the column {column!r:.40}; a column's name "
                            "is a non-empty string")
        if not isinstance(values, (list, tuple)) or len(values) != count:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise UserError(f"reward {named(spec)} logged {got} values in the column {column} for {count} "
                            "completions; log_extra takes one value per completion")
        self.extra[column] = [_json_value(v) for v in values]

    def _call(self, spec: RewardSpec, fn: RewardFn, prompts: list, completions: list, ids: list,
              kwargs: dict) -> object:
        """What a plain function returned, under user_code's guards; what it raised, one line naming the prompt."""
        try:
            bound = functools.partial(fn, prompts=prompts, completions=completions, completion_ids=ids, **kwargs)
            values = user_code.call(f"reward {named(spec)}", bound, timeout=self.timeout,
                                    late=_late(prompts, completions))
        except (UserError, Stopped):  # a logger's own one line (a bad metric or column), a time limit, a stop
            raise
        except Exception as exc:  # the user's code: named, with the prompt it failed on
            if StopRequest.signum:  # its own handler turned the stop into an error of its own: a stop still
                raise Stopped(f"in reward {named(spec)}") from None
            where = _failing(fn, prompts, completions, ids, kwargs, self.timeout)
            raise UserError(f"reward {named(spec)} raised {type(exc).__name__}: {exc} (prompt {_shown(where)})"
                            ) from None
        return values

    def _awaited(self, prompts: list, completions: list, ids: list, args: list[dict]) -> dict[int, object]:
        """What the `async def` functions returned, by position, awaited together on the process's event loop (as
        TRL gathers them) under one time limit; one that raised is one line naming it and the batch's first
        prompt."""
        chosen = [j for j, fn in enumerate(self.functions) if _is_async(fn)]
        if not chosen:
            return {}
        makers = [functools.partial(self.functions[j], prompts=prompts, completions=completions, completion_ids=ids,
                                    **args[j]) for j in chosen]
        results = user_code.await_all(f"reward {', '.join(named(self.specs[j]) for j in chosen)}", makers,
                                      self.timeout, _late(prompts, completions))
        for j, (raised, result) in zip(chosen, results, strict=True):
            if not raised:
                continue
            what = f"reward {named(self.specs[j])}"
            if isinstance(result, UserError):  # a logger's own one line
                raise result
            if isinstance(result, (SystemExit, KeyboardInterrupt)):
                raise UserError(user_code.exit_line(what, result))
            if StopRequest.signum:  # a stop it turned into an error of its own
                raise Stopped(f"in {what}")
            raise UserError(f"{what} raised {type(result).__name__}: {result} (prompt {_shown(prompts[0])})")
        return {j: result for j, (_, result) in zip(chosen, results, strict=True)}

    def _checked(self, spec: RewardSpec, values: object, prompts: list, completions: list) -> list:
        """A function's values as numbers or None, one per completion, each float32 can hold: else one line."""
        if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy arrays, tensors (TRL's too)
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise UserError(f"reward {named(spec)} returned {count} values for {len(completions)} completions (prompt "
                            f"{_shown(prompts[0])}); it must return one float or None per completion")
        values = [_scalar(v) for v in values]
        for i, value in enumerate(values):
            if value is not None and not _within(value, FLOAT32_MAX):
                raise UserError(f"reward {named(spec)} returned {value!r:.40} for the completion "
                                f"{_shown(completions[i])} of prompt {_shown(prompts[i])}; a reward must be a finite "
                                f"number within float32's +-{FLOAT32_MAX:.3g}, or None to abstain")
        return values


def _is_async(fn: object) -> bool:
    """An `async def` function, or an object whose __call__ is one (TRL's is_async_callable)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _scalar(value: object) -> object:
    """A 0-d tensor or numpy value as the Python number it holds (np.bool_ too); anything else as it is."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", None) == 0 else value


def _within(value: object, bound: float) -> bool:
    """A real number whose magnitude is finite and at most bound (10**400 overflows float() itself)."""
    try:
        return isinstance(value, numbers.Real) and abs(float(value)) <= bound and math.isfinite(float(value))
    except OverflowError:
        return False


def _failing(fn: RewardFn, prompts: list, completions: list, ids: list, kwargs: dict, timeout: float) -> object:
    """The first prompt whose completion alone makes fn raise (the batch's first if none alone does); what it logs
    meanwhile is dropped (a column of one value would not be the batch's). Each call under the same guards, all of
    them within one time limit."""
    quiet = {"log_metric": _dropped, "log_extra": _dropped}
    deadline = time.monotonic() + timeout  # the whole search within one call's time limit
    for i in range(len(completions)):
        left = deadline - time.monotonic()
        if timeout and left <= 0:
            break
        try:
            alone = {k: v[i:i + 1] if isinstance(v, list) else v for k, v in kwargs.items()} | quiet
            user_code.call("a reward", functools.partial(fn, prompts=prompts[i:i + 1],
                                                         completions=completions[i:i + 1],
                                                         completion_ids=ids[i:i + 1], **alone),
                           timeout=max(left, 1e-3) if timeout else 0)
        except (UserError, Stopped):  # timed out or stopped meanwhile: the batch's first is named
            break
        except Exception:  # the one that fails alone is the one to name
            return prompts[i]
    return prompts[0]


def _dropped(*args: object) -> None:
    return None


def _json_value(value: object) -> object:
    """A log_extra value as the samples log can hold it: a number, a string, a bool or None as it is, else its text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, numbers.Real):
        return float(value) if _within(value, math.inf) else str(value)
    return str(value)


def _late(prompts: list, completions: list) -> str:
    """Where a reward call that ran past its time limit was: its batch."""
    return f" on the {len(completions)} completions of prompt {_shown(prompts[0])}"


def _shown(value: object) -> str:
    text = value if isinstance(value, str) else text_of(value[-1:]) if isinstance(value, list) else str(value)
    return repr(text[:60] + ("..." if len(text) > 60 else ""))
