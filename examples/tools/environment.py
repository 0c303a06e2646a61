"""An environment for `fsdp1.py --objective grpo --environment examples/tools/environment.py:Calculator` (TRL's
environment_factory contract, so the same file serves TRL's GRPOTrainer): one instance per rollout, reset with the
prompt row's columns before it, its public methods the model's tools (type hints and an Args: docstring each, as for
--tools), get_reward() its own reward: whether the tools computed the row's answer."""


class Calculator:
    """Two tools whose results the instance keeps, and the answer the row expects."""

    def __init__(self) -> None:
        self.answer, self.results = "", []

    def reset(self, answer: str, **row) -> None:
        """Called before each rollout with its prompt row (`prompt` and the other columns). Sets the whole state:
        the instance serves one rollout after another. A string returned here would be appended to the prompt."""
        self.answer, self.results = str(answer), []

    def add(self, a: int, b: int) -> int:
        """The sum of two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        self.results.append(a + b)
        return a + b

    def multiply(self, a: int, b: int) -> int:
        """The product of two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        self.results.append(a * b)
        return a * b

    def get_reward(self) -> float:
        """1 where a tool call computed the answer (the rollout's reward beside --reward's, logged as
        rewards/Calculator)."""
        return float(self.answer in map(str, self.results))
