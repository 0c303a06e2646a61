"""Tools for `fsdp1.py --objective grpo --tools examples/tools/tools.py`: plain functions with type hints and a
docstring whose Args: section describes each argument (TRL's rule: the JSON schema the chat template shows the model
is transformers' get_json_schema of each). A tool's return value reaches the model as str() of it."""


def add(a: int, b: int) -> int:
    """The sum of two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """The product of two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a * b
