"""Model families: the trainer's first loss against transformers' own, on 2 ranks, for every family the suite trains
(tiny random models of pipeline/prep/tiny.FAMILIES, saved as save_pretrained saves them) under each strategy with
its defaults. Rewrites the family_losses table of BENCHMARKS.md; raw results in bench/data/family_losses.json.

    .venv/bin/python bench/family_losses.py [--workdir .bench/families]

The worker is bench/family_worker.py: one fixed batch of 2 x 64 tokens, fp32, the same rows on every rank; after one
AdamW step, the export read back against the trained model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from common import ROOT, bench_env, machine, table, torchrun_cmd, update_section

WORKER = ROOT / "bench" / "family_worker.py"
RAW = ROOT / "bench" / "data" / "family_losses.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "families")
    args = p.parse_args()
    from pipeline.prep.tiny import FAMILIES, build_family

    args.workdir.mkdir(parents=True, exist_ok=True)
    folders = {f: build_family(args.workdir / f, f) for f in FAMILIES}
    cmd = torchrun_cmd(2, WORKER, RAW, args.workdir, *(f"{f}={d}" for f, d in folders.items()))
    done = subprocess.run(cmd, cwd=ROOT, env=bench_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    results = json.loads(RAW.read_text())
    rows = [[r["family"], r["strategy"], r["attn"], "on" if r["vocab_parallel"] else "off", f"{r['ours']:.7f}",
             f"{r['theirs']:.7f}", f"{abs(r['ours'] - r['theirs']):.1e}", f"{r['export_tensor_diff']:.1e}",
             f"{r['export_loss_diff']:.1e}"] for r in results]
    assert not any(r["export_missing"] for r in results), [r for r in results if r["export_missing"]]
    body = "\n".join([
        f"- Machine: {machine()}.",
        "- Command: `.venv/bin/python bench/family_losses.py`; worker `bench/family_worker.py` (2 ranks, fp32, one "
        "batch of 2 x 64 tokens, each strategy with its defaults: fsdp2's --vocab-parallel auto).",
        "",
        table(["family", "strategy", "attention", "vocab-parallel head", "trainer's loss", "transformers' loss",
               "|diff|", "export after a step: largest tensor |diff|", "export's loss |diff|"], rows),
        "",
        f"Largest difference of the first loss: {max(abs(r['ours'] - r['theirs']) for r in results):.1e}; of an "
        f"exported tensor: {max(r['export_tensor_diff'] for r in results):.1e}; of the export's loss: "
        f"{max(r['export_loss_diff'] for r in results):.1e}.",
    ])
    update_section("family_losses", body)
    print(body)


if __name__ == "__main__":
    main()
