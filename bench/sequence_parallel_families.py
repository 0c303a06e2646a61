"""--sequence-parallel 2 over every causal-LM family of the installed transformers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
not a list of ours: each model type's tiny config (bench/all_families.tiny_config), one process's loss and gradients
of a packed batch (a document boundary inside each rank's slice and one at the seam) against the same batch split
over 2 gloo ranks by the sequence-parallel attention, with the suite's list of vouched families lifted so that only
the rules of pipeline/strategies/sequence_parallel.refusal stand. What it shows is which families those rules would
let through and whether each then computes the unsplit model's function. Rewrites the sequence_parallel_families
table of BENCHMARKS.md; raw rows in bench/data/sequence_parallel_families.jsonl.

    .venv/bin/python bench/sequence_parallel_families.py [--only TYPE ...]

Verdicts: equal (loss within 1e-5, gradients within 1e-4 of their largest); wrong (let through, and different);
refused (sequence parallelism's one line); refused at start (the trainer refuses the family anyway); cannot build
(its tiny config or its own forward fails: not a verdict on sequence parallelism); crashed (let through, and the split
forward raised).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import subprocess
import tempfile
from pathlib import Path

from common import ROOT, bench_env, machine, table, torchrun_cmd, update_section

WORKER = ROOT / "bench" / "sequence_parallel_families_worker.py"
RAW = ROOT / "bench" / "data" / "sequence_parallel_families.jsonl"
LAUNCH_SECONDS = 900


def run(types: list[str]) -> list[dict]:
    """Every type's row, in launches of the worker that resume after a type that hung or killed it."""
    rows: list[dict] = []
    while len(rows) < len(types):
        todo = types[len(rows):]
        out = Path(tempfile.mkdtemp()) / "rows.jsonl"
        with contextlib.suppress(subprocess.TimeoutExpired):  # a hang: the rows written so far count
            subprocess.run(torchrun_cmd(2, WORKER, out, *todo), cwd=ROOT, env=bench_env(), capture_output=True,
                           text=True, timeout=LAUNCH_SECONDS)
        done = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        rows += done
        if len(rows) < len(types):  # the next type ended the launch: its row, and on with the rest
            rows.append({"family": types[len(rows)], "verdict": "crashed", "why": "the launch ended (hang or kill)"})
        print(f"{len(rows)}/{len(types)}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = run(types)
    RAW.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = collections.Counter(r["verdict"] for r in rows)
    body = [f"- Machine: {machine()}; transformers {transformers.__version__}: {len(types)} causal-LM model types.",
            "- Command: `.venv/bin/python bench/sequence_parallel_families.py` (worker "
            "`bench/sequence_parallel_families_worker.py`: 2 gloo ranks, fp32, 2 x 40 tokens, packed).",
            "- " + ", ".join(f"{n} {verdict}" for verdict, n in counts.most_common()) + ".", "",
            table(["model type", "verdict", "loss", "gradients apart", "why"],
                  [[r["family"], r["verdict"], f"{r['loss']:.6f}" if "loss" in r else "",
                    f"{r['grad_rel']:.1e}" if "grad_rel" in r else "", r.get("why", "")] for r in rows])]
    update_section("sequence_parallel_families", "\n".join(body))
    print("\n".join(body[:3]))


if __name__ == "__main__":
    main()
