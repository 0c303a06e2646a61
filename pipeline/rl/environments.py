"""The user's environment (--environment FILE.py:CLASS), with TRL's environment_factory contract so that a TRL user's
file runs unchanged: CLASS (or any callable) makes an instance with no arguments; one instance serves each rollout
(each completion of each prompt), made once and reset for every rollout after (TRL's pool: construct once, reset
often); `reset(**row)` gets the prompt row's columns (and `prompt`) and may return an observation, which is appended
to the prompt's last message; its public methods other than reset and get_reward are the model's tools, bound to
that rollout's instance; `get_reward()` (optional, may be async) is a reward of its own, weight 1, named by the class,
beside the --reward functions, which also get the rollouts' instances as `environments`.

Hazards: the environment's state is the user's. A checkpoint falls between steps, where no episode is open, so a
resumed run repeats the uninterrupted one's episodes exactly only where reset() sets the whole state from its
arguments (as TRL's contract asks): an instance is reused across rollouts, and a resumed run makes fresh ones."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import UserError
from pipeline.rl import user_code
from pipeline.signals import Stopped

OWN = ("reset", "get_reward")
"""The methods the trainer calls itself: never offered to the model."""


class Environment:
    """--environment loaded once per process: its factory, the instances made so far, its tools' names."""

    def __init__(self, spec: str, timeout: float) -> None:
        self.spec, self.timeout = spec, timeout
        cut = spec.rfind(".py:")  # FILE.py:CLASS (a path may hold ':' of its own)
        if cut < 0 or not spec[cut + 4:].strip():
            raise UserError(f"--environment {spec}: give the file and the class, FILE.py:CLASS (TRL's "
                            "environment_factory)")
        path, name = Path(spec[:cut + 3]), spec[cut + 4:].strip()
        self.path = str(path)
        module, digest = user_code.load_file(path, f"--environment {spec}")
        self.factory = getattr(module, name, None)
        if not callable(self.factory):
            raise UserError(f"--environment {spec}: {path} defines no class {name}")
        probe = self._made()
        cls = type(probe)
        members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))  # on the class: properties not run
        if "reset" not in members:
            raise UserError(f"--environment {spec}: {cls.__name__} has no reset method; TRL's contract is "
                            "reset(self, **row) -> str | None, called before each rollout with its prompt row")
        self.methods = [n for n in members if n not in OWN and not n.startswith("_")]
        """The public methods offered to the model as tools, in name order (as TRL lists them)."""
        self.rewarded = "get_reward" in members
        """It scores its rollouts itself (get_reward())."""
        self.name = cls.__name__
        self.pool = [probe]
        """The instances made so far (the first one made at load, to read the class): reused, rollout after rollout."""
        self.identity = f"{path.name}:{name}:{digest}"
        """What the run's fingerprint holds (the file's name, not its path: a rerun from another folder is the same)."""

    def _made(self) -> object:
        what = f"--environment {self.spec}"
        try:
            return user_code.call(what, self.factory, timeout=self.timeout, limit="--tool-timeout")
        except (UserError, Stopped):
            raise
        except Exception as exc:  # the user's constructor
            raise UserError(f"{what}: making an instance raised {type(exc).__name__}: {exc}") from None

    def instances(self, n: int) -> list[object]:
        """One instance per rollout, n of them: the pool's, grown where a batch needs more than were made."""
        while len(self.pool) < n:
            self.pool.append(self._made())
        return self.pool[:n]

    def reset(self, instance: object, row: dict) -> str | None:
        """instance.reset(**row) under --tool-timeout: its observation (a string), or None. What it raises, a
        string it does not return, or a time limit it passes: one line naming the row's prompt (the user's code,
        not the model's mistake)."""
        what = f"--environment {self.spec}: reset"
        late = f" on the prompt {_short(row.get('prompt'))}"
        try:
            observation = user_code.call(what, functools.partial(instance.reset, **row), timeout=self.timeout,
                                         late=late, limit="--tool-timeout")
        except (UserError, Stopped):
            raise
        except Exception as exc:
            raise UserError(f"{what} raised {type(exc).__name__}: {exc}{late}") from None
        if observation is not None and not isinstance(observation, str):
            raise UserError(f"{what} returned a {type(observation).__name__}{late}; it returns the observation "
                            "appended to the prompt (a string) or None")
        return observation

    def reward_function(self) -> Callable:
        """get_reward() as a reward function (TRL's: one value per rollout, from its instance), async where it is."""
        if inspect.iscoroutinefunction(self.pool[0].get_reward):
            async def get_reward(environments: list, **kwargs: object) -> list:
                return [await e.get_reward() for e in environments]
        else:
            def get_reward(environments: list, **kwargs: object) -> list:
                return [e.get_reward() for e in environments]
        return get_reward


def _short(prompt: object) -> str:
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) if prompt else ""
    return repr(text[:60] + ("..." if len(text) > 60 else ""))
