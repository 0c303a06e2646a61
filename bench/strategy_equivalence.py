"""Strategy equivalence: the four strategies on 2 ranks, and the hand-written ZeRO-3 on 1, 2, 3 and 4 ranks, on the
same global batches (the seed-003 table, measured on our model). Rewrites the strategy_equivalence table of
BENCHMARKS.md.

    .venv/bin/python bench/strategy_equivalence.py [--workdir .bench/strategies]

The worker is the test suite's (tests/helpers/strategy_steps.py): 3 AdamW steps at the default lr (2e-5, weight
decay 0.1, clipping 1.0), 24 blocks of 16 tokens per step split over the ranks, 2 micro-steps of accumulation, fp32.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np
from common import ROOT, bench_env, machine, table, torchrun_cmd, update_section

WORKER = ROOT / "tests" / "helpers" / "strategy_steps.py"
STRATEGIES = ("fsdp2", "fsdp1", "ddp", "manual")


def run(model: Path, out: Path, world: int, *names: str) -> tuple[dict, dict]:
    done = subprocess.run(torchrun_cmd(world, WORKER, model, out, *names), cwd=ROOT, env=bench_env(),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    params = np.load(out.with_suffix(".npz"))
    return json.loads(out.with_suffix(".json").read_text()), {k: params[k] for k in params.files}


def worst(a: dict, b: dict, prefix_a: str, prefix_b: str) -> float:
    return max(float(np.abs(a[k] - b[k.replace(prefix_a, prefix_b, 1)]).max()) for k in a if k.startswith(prefix_a))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "strategies")
    args = p.parse_args()
    from pipeline.prep.tiny import build_tiny

    args.workdir.mkdir(parents=True, exist_ok=True)
    sections = []
    for kind in ("tied", "untied"):
        model = args.workdir / kind
        if not (model / "config.json").exists():
            build_tiny(model, tied=kind == "tied")
        two, two_params = run(model, args.workdir / f"{kind}-2", 2, *STRATEGIES)
        ref = two["fsdp2"]
        rows = [[name, " / ".join(f"{x:.7f}" for x in r["loss"]),
                 f"{max(abs(x - y) for x, y in zip(r['loss'], ref['loss'], strict=True)):.1e}",
                 f"{max(abs(x - y) for x, y in zip(r['grad_norm'], ref['grad_norm'], strict=True)):.1e}",
                 f"{worst(two_params, two_params, f'{name}/', 'fsdp2/'):.1e}"] for name, r in two.items()]
        per_world = {2: (two, two_params)}
        for world in (1, 3, 4):
            per_world[world] = run(model, args.workdir / f"{kind}-{world}", world, "manual")
        one, one_params = per_world[1]
        ranks = [[world, " / ".join(f"{x:.7f}" for x in r["manual"]["loss"]),
                  f"{max(abs(x - y) for x, y in zip(r['manual']['loss'], one['manual']['loss'], strict=True)):.1e}",
                  f"{worst(params, one_params, 'manual/', 'manual/'):.1e}",
                  f"{max(r['manual']['padding'] or [0.0]):.1e}"] for world, (r, params) in sorted(per_world.items())]
        sections.append(f"**{kind} embeddings**, 2 ranks, against fsdp2:\n\n" + table(
            ["strategy", "loss, steps 1-3", "max loss diff", "max grad-norm diff", "max parameter diff"], rows))
        sections.append(f"**{kind} embeddings**, `manual` on W ranks, against 1 rank:\n\n" + table(
            ["ranks", "loss, steps 1-3", "max loss diff", "max parameter diff", "largest padding value"], ranks))
    body = "\n".join([f"- Machine: {machine()}.",
                      "- Command: `.venv/bin/python bench/strategy_equivalence.py`; worker "
                      "`tests/helpers/strategy_steps.py` (3 AdamW steps, lr 2e-5, weight decay 0.1, clipping 1.0, "
                      "24 blocks x 16 tokens per step, 2 micro-steps, fp32, the bundled tiny model).", "",
                      "\n\n".join(sections)])
    update_section("strategy_equivalence", body)
    print(body)


if __name__ == "__main__":
    main()
