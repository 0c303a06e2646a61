"""The architecture as the code states it: no import circles in pipeline/, and the public surface of dependencies."""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "pipeline"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """pipeline modules imported anywhere in the file (module level or inside functions: a lazy import is still a
    dependency)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pipeline"))
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [*path, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles_in_pipeline():
    edges = graph()
    assert {"pipeline.train.trainer", "pipeline.strategies.fsdp2", "pipeline.model.weights"} <= set(edges)
    assert "pipeline.model.weight_files" in edges["pipeline.prep.hub"]  # imported in a function: lazy ones count
    assert find_cycle(edges) is None, find_cycle(edges)


def test_the_trainer_reaches_the_model_only_through_the_strategy():
    trainer = imports_of(PACKAGE / "train" / "trainer.py")
    assert "pipeline.strategies.fsdp2" not in trainer
    assert not any(m.startswith(("pipeline.model.weights", "pipeline.model.vocab_parallel")) for m in trainer)
    source = (PACKAGE / "train" / "trainer.py").read_text()
    for private in ("fully_shard", "FSDPModule", "get_state_dict", "set_requires_gradient_sync"):
        assert private not in source, private


def test_the_strategies_import_no_objective_and_no_online_rl():
    """Strategies and the memory estimate sit below the objectives: what they count of an objective comes to them as
    a workload, never by reaching up into objectives/ or rl/."""
    edges = graph()
    up = {name: sorted(m for m in deps if m.startswith(("pipeline.rl", "pipeline.objectives", "pipeline.train")))
          for name, deps in edges.items() if name.startswith(("pipeline.strategies", "pipeline.model"))}
    assert {name: deps for name, deps in up.items() if deps} == {}


def test_the_trainer_preflight_the_strategies_and_evaluate_name_no_objective():
    """Every objective is a component (pipeline/objectives/kinds.py, plans.py): the modules that run any of them hold
    no objective's name in their code (docstrings and comments may name one as an example), and every objective the
    config offers has its component."""
    from typing import get_args

    from pipeline.config import Objective
    from pipeline.objectives.kinds import KINDS

    names = set(get_args(Objective))
    assert set(KINDS) == names
    files = [PACKAGE / "train" / "trainer.py", PACKAGE / "train" / "preflight.py", PACKAGE / "tools" / "evaluate.py",
             *sorted((PACKAGE / "strategies").glob("*.py"))]
    for path in files:
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        named = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and id(node) not in docstrings and node.value in names}
        attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in names}
        assert not named and not attributes, (path.name, named, attributes)


def test_no_module_imports_a_private_module_of_a_dependency():
    """A private module (a dotted path with a part starting with "_") may move in any release: pipeline/ reaches its
    dependencies through their public API only."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {n}" for n in names
                      if any(part.startswith("_") and part != "__future__" for part in n.split("."))]
    assert found == []


def test_every_room_is_a_package_and_no_module_is_over_500_lines():
    rooms = {p.parent for p in PACKAGE.rglob("*.py")} - {PACKAGE}
    assert {r.name for r in rooms} == {"prep", "data", "model", "distributed", "strategies", "objectives", "train",
                                         "rl", "eval", "tools"}
    assert all((r / "__init__.py").exists() for r in rooms)
    long = {p.relative_to(PACKAGE).as_posix(): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_light_commands_do_not_load_the_distributed_wrappers():
    """The experiments harness loads no torch, and MODEL_DOWNLOAD's module no FSDP or DCP, until they need them."""
    import subprocess
    import sys

    code = ("import sys, pipeline.tools.experiments; assert 'torch' not in sys.modules; "
            "import pipeline.prep.hub, pipeline.data.dataset; "
            "assert not {'torch.distributed.fsdp', 'torch.distributed.checkpoint'} & set(sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
