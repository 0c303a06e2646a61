"""Flags, a YAML config file and its profile merged into a Config (pipeline/config.py).

Precedence: command line > `--config FILE.yaml` > the profile that file names (`profile: NAME` ->
configs/profiles/NAME.yaml) > the defaults. The resolved config is written to the run directory as config.yaml.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_origin, get_type_hints

import yaml

from pipeline.config import SECTIONS, Config
from pipeline.config_base import choices, flag
from pipeline.data.sources import joined
from pipeline.errors import ArgumentParser, UserError
from pipeline.fsutil import read_yaml, write_text_atomic

PROFILES_DIR = Path(__file__).resolve().parents[1] / "configs" / "profiles"
LIST_KEYS = ("lora_targets", "report_to", "lm_eval_tasks", "reward")
"""String keys a YAML file may give as a list (joined with commas, as the flag takes them)."""
REPEATED = ("reward",)
"""Flags that may be given more than once, each time adding to the list."""
SHORT_FLAGS = {"experiment_name": "-e", "dataset_name": "-d", "model_name": "-m", "batch_size": "-b"}


@cache
def _module_classes(path: str) -> dict[str, ast.ClassDef]:
    """The top-level classes of one source file, parsed once: inspect.getsource parses the whole file again for each
    class it finds (0.05 s a section with torch and transformers imported, in every process that builds the parser)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal under each field), used as --help text."""
    body = _module_classes(inspect.getsourcefile(cls))[cls.__name__].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Flat key -> (section, field)."""
    return {f.name: (section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


@cache
def kinds(cls: type) -> dict[str, type]:
    """The type each field of a config section holds, from its resolved type hints (a Literal's values are str)."""
    hints = get_type_hints(cls)
    return {f.name: str if get_origin(hints[f.name]) is Literal else hints[f.name] for f in dataclasses.fields(cls)}


def _convert(key: str, kind: type, value: Any) -> Any:
    """Coerce a YAML or CLI value to the field's type, with one clear line when it cannot be."""
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("on", "true", "yes", "1"):
                return True
            if text in ("off", "false", "no", "0"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
        if key in LIST_KEYS and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        if key == "dataset_name" and isinstance(value, list):  # a mixture: [{path, weight}, ...]
            value = joined(value)
        if isinstance(value, (list, dict)):
            shape = "list" if isinstance(value, list) else "mapping"
            raise UserError(f"{flag(key)} must be a single value, got a {shape} ({value!r:.80})")
        if "\0" in str(value):
            raise UserError(f"{flag(key)} must not contain a NUL character, got {str(value)!r:.80}")
        return str(value)
    except (TypeError, ValueError):
        expected = "on or off" if kind is bool else f"a{'n' if kind is int else ''} {kind.__name__}"
        raise UserError(f"{flag(key)} must be {expected}, got {value!r}") from None


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    data = read_yaml(path, what) or {}
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} must be a mapping of keys to values")
    unknown = sorted(set(data) - set(_fields()) - {"profile"})
    if unknown:
        raise UserError(f"{what} {path} has unknown key{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    return data


def load_profile(name: str) -> dict[str, Any]:
    path = PROFILES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
        raise UserError(f"unknown profile {name!r}; known profiles: {known}")
    data = _read_yaml(path, "profile")
    data.pop("profile", None)
    return data


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description="Fine-tune a causal LM with FSDP2. Rerun the same command to resume. "
                       "--nproc-per-node N starts N processes on this node (one per GPU), as torchrun would.",
                       argument_default=argparse.SUPPRESS)
    add_config_arguments(p)
    return p


def add_config_arguments(p: argparse.ArgumentParser, leave_out: frozenset[str] = frozenset()) -> None:
    """--config, --profile and a flag per config key but those left out, each absent from the parsed namespace unless
    given (p's argument_default must be SUPPRESS): what merge() takes."""
    p.add_argument("--config", type=Path, help="YAML file of the same keys (snake_case); may name a profile")
    p.add_argument("--profile", help="named profile from configs/profiles/")
    for key, (section, f) in _fields().items():
        if key in leave_out:
            continue
        flags = [SHORT_FLAGS[key]] if key in SHORT_FLAGS else []
        flags.append(flag(key))
        doc = field_docs(SECTIONS[section]).get(key, "")
        default = "" if f.default in ("", dataclasses.MISSING) else f" (default: {_show(f.default)})"
        allowed = choices(SECTIONS[section]).get(key)
        if kinds(SECTIONS[section])[key] is bool:  # `--flag on|off`, or the bare `--flag` for on
            p.add_argument(*flags, dest=key, help=doc + default, metavar="on|off", nargs="?", const="on")
        elif key in REPEATED:
            p.add_argument(*flags, dest=key, help=doc + " (repeatable)", action="append")
        else:  # choices shown as argparse shows them, checked by the section (one line, not argparse's usage block)
            metavar = "{" + ",".join(allowed) + "}" if allowed else None
            p.add_argument(*flags, dest=key, help=doc + default, metavar=metavar)


def _show(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def resolve(argv: list[str] | None = None) -> Config:
    """fsdp1.py's config: the command line merged over the config file, its profile and the defaults."""
    return require_dataset(merge(vars(build_parser().parse_args(argv))))


def require_dataset(cfg: Config) -> Config:
    """cfg, for a training run: it needs a dataset (pipeline.evaluate may do without, for lm-eval tasks only)."""
    if not cfg.data.dataset_name:
        raise UserError("--dataset-name (-d) is required")
    return cfg


def merge(cli: dict[str, Any]) -> Config:
    """Flags as parsed (config keys, and `config` and `profile`) over the config file they name, its profile and the
    defaults."""
    cli = dict(cli)
    if not str(cli.get("lm_eval_tasks", "x")).strip(" ,") and "lm_eval_include" not in cli:
        cli["lm_eval_include"] = ""  # `--lm-eval-tasks ""` turns a config file's tasks off, and their folder with them
    config_path = cli.pop("config", None)
    file_values = _read_yaml(config_path, "--config") if config_path is not None else {}
    profile = cli.pop("profile", None) or file_values.pop("profile", None)
    file_values.pop("profile", None)
    merged = {**(load_profile(profile) if profile else {}), **file_values, **cli}
    return from_flat(merged)


def from_flat(values: dict[str, Any]) -> Config:
    """Build a Config from flat keys (unknown keys refused, a None value left at its default); the checks of every
    section run here."""
    fields = _fields()
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise UserError(f"unknown config key{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in values.items():
        if value is None:  # YAML's null (`key:` or `key: null`): no value here, so the default (not the text 'None')
            continue
        section, f = fields[key]
        per_section[section][key] = _convert(key, kinds(SECTIONS[section])[key], value)
    return Config(**{s: SECTIONS[s](**kw) for s, kw in per_section.items()})


def save(cfg: Config, path: Path) -> None:
    write_text_atomic(path, yaml.safe_dump(cfg.flat(), sort_keys=False))
