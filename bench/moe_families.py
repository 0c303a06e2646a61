"""Expert parallelism on every mixture-of-experts family of the installed transformers, from its registry
(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, the model types whose tiny config has routed experts), not from a list of ours:
the tiny model of bench/all_families.py (4 experts of which 2 per token) trained --steps steps on 2 ranks with
--expert-parallel 2 (batch 2 per rank) and in one process (batch 4: the same blocks each step), fp32; every step's
loss and gradient norm must agree within 1e-5. Each run is one launch under a time limit, so a family that crashes
or hangs costs its own row only.

Verdicts: equal (every step within 1e-5); as fsdp2 (further apart, but no more than 3x as far as fsdp2 on the
same 2 ranks without expert parallelism is from the same one process: a family whose own figures move with the
reduction order, e.g. routing near ties in a tiny random model; both figures in the row); refused (our one-line
error, exit 2, on the expert-parallel run: the family is not split); cannot build (its tiny config or model cannot
be made from its defaults); other error (the one-process run fails: the family's own trouble, bench/all_families.py's
row says which); wrong (trained, not equal); crashed (the expert-parallel run fails with a traceback where one process
trains). Rewrites the moe_families table of BENCHMARKS.md; raw results in bench/data/moe_families.json.

    .venv/bin/python bench/moe_families.py [--only TYPE ...] [--steps 3] [--fresh]
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

from all_families import build, first_line, tiny_config
from common import ROOT, bench_env, demo_dataset, machine, table, update_section

RAW = ROOT / "bench" / "data" / "moe_families.json"
LAUNCH_SECONDS = 300


@functools.cache
def moe_types() -> list[str]:
    """The causal-LM model types whose tiny config routes tokens to experts."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pipeline.model.modeling import moe_shape

    found = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            if moe_shape(tiny_config(model_type))[0]:
                found.append(model_type)
        except Exception:  # noqa: BLE001,S112 (a config that cannot be made is all_families' row, not ours)
            continue
    return found


def train(runs: Path, name: str, model: Path, data: Path, nproc: int, *flags: object, steps: int) -> tuple[int, str]:
    shutil.rmtree(runs / name, ignore_errors=True)
    args = ["-e", name, "--save-dir", runs, "-d", data, "-m", model, "--precision", "fp32", "--strategy", "fsdp2",
            "--eval-freq", 0, "--ckpt-freq", 0, "--log-freq", 1, "--max-steps", steps, "--seq-length", 32,
            "--lr", 1e-3, "--warmup-steps", 0, "--num-proc", 1, *flags]
    # fsdp1.py's own launcher: its preflight's one-line refusals exit 2 (under torchrun any worker's failure is 1)
    cmd = [sys.executable, str(ROOT / "fsdp1.py"), "--nproc-per-node", str(nproc), *map(str, args)]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=LAUNCH_SECONDS)
    except subprocess.TimeoutExpired:
        return -1, f"no result in {LAUNCH_SECONDS} s (a hang)"
    output = done.stdout + done.stderr
    lines = [x for x in output.splitlines() if "error: " in x or "Error" in x]
    return done.returncode, first_line(lines[-1].split("error: ", 1)[-1] if lines else output[-400:])


@functools.cache
def tokenizer():
    """The bench tokenizer with the tiny configs' 512-token vocabulary."""
    from pipeline.prep.tiny import DEFAULT_CORPUS, corpus_texts, train_tokenizer

    return train_tokenizer(corpus_texts(DEFAULT_CORPUS), 512)


def figures(run: Path) -> dict[int, tuple[float, float]]:
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: (e["loss"], e["grad_norm"]) for e in events if e.get("event") == "train"}


def run_family(model_type: str, workdir: Path, data: Path, steps: int) -> dict:
    folder = workdir / model_type
    if not (folder / "config.json").exists() and (why := build(model_type, folder)) is not None:
        return {"family": model_type, "verdict": "cannot build", "why": why}
    if not (folder / "tokenizer.json").exists():  # all_families' worker needs none; fsdp1.py reads the text with one
        tokenizer().save_pretrained(folder)
    runs = workdir / "runs"
    code, why = train(runs, f"{model_type}-ep", folder, data, 2, "--expert-parallel", 2, "-b", 2, steps=steps)
    one, one_why = train(runs, f"{model_type}-one", folder, data, 1, "-b", 4, steps=steps)
    if code != 0 and one != 0:  # the family fails without expert parallelism too: not this bench's verdict
        return {"family": model_type, "verdict": "other error", "why": f"one process too: {one_why}"}
    if code != 0:
        verdict = "refused" if code == 2 and "Traceback" not in why else "crashed"
        return {"family": model_type, "verdict": verdict, "why": why}
    if one != 0:
        return {"family": model_type, "verdict": "other error", "why": f"one process: {one_why}"}
    one = figures(runs / f"{model_type}-one")
    diff = apart(figures(runs / f"{model_type}-ep"), one)
    if diff <= 1e-5:
        return {"family": model_type, "verdict": "equal", "why": "", "rel_diff": diff}
    # the control: fsdp2 on the same 2 ranks without expert parallelism, against the same one process
    code, why = train(runs, f"{model_type}-gathered", folder, data, 2, "--expert-parallel", 1, "-b", 2, steps=steps)
    spread = apart(figures(runs / f"{model_type}-gathered"), one) if code == 0 else float("inf")
    if spread > 1e-5 and diff <= 3 * spread:
        return {"family": model_type, "verdict": "as fsdp2", "rel_diff": diff,
                "why": f"2 ranks without expert parallelism are {spread:.1e} from one process too"}
    return {"family": model_type, "verdict": "wrong", "rel_diff": diff,
            "why": f"2 ranks without expert parallelism: {spread:.1e} from one process"}


def apart(ours: dict[int, tuple[float, float]], theirs: dict[int, tuple[float, float]]) -> float:
    """The largest relative difference of loss or gradient norm at any step (inf where the steps differ)."""
    if sorted(ours) != sorted(theirs):
        return float("inf")
    return max(max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours[s], theirs[s], strict=True)) for s in theirs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "moe_families")
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fresh", action="store_true", help="measure every family again (else those measured are kept)")
    args = p.parse_args()
    from transformers import __version__

    args.workdir.mkdir(parents=True, exist_ok=True)
    data = demo_dataset(args.workdir / "dataset")
    # the rows of earlier runs are kept: a family already measured is skipped unless named with --only or --fresh
    done = {} if args.fresh or not RAW.exists() else {r["family"]: r for r in json.loads(RAW.read_text())}
    for model_type in args.only or [t for t in moe_types() if t not in done]:
        row = run_family(model_type, args.workdir, data, args.steps)
        done[model_type] = row | {"why": row["why"].replace(f"{args.workdir}/", "")}
        print(f"{model_type}: {row['verdict']} {row.get('rel_diff', '')} {row['why']}", flush=True)
        RAW.parent.mkdir(parents=True, exist_ok=True)
        RAW.write_text(json.dumps(list(done.values()), indent=1))  # after each family: a stopped run keeps its rows
        write_table(list(done.values()), args, __version__)


def write_table(rows: list[dict], args: argparse.Namespace, version: str) -> None:
    kinds = ("equal", "as fsdp2", "refused", "cannot build", "other error", "wrong", "crashed")
    counts = {kind: sum(r["verdict"] == kind for r in rows) for kind in kinds}
    update_section("moe_families", "\n".join([
        f"- Machine: {machine()}. {len(rows)} of the {len(moe_types())} mixture-of-experts model types in "
        f"transformers {version}'s registry (those whose tiny config routes tokens to experts).",
        f"- Command: `.venv/bin/python bench/moe_families.py --steps {args.steps}`"
        " (2 ranks with --expert-parallel 2, batch 2 each, against one process, batch 4; fp32, 32-token blocks).",
        "- " + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ".",
        "",
        table(["model type", "verdict", "largest relative diff (loss, grad norm)", "why"],
              [[r["family"], r["verdict"], f"{r['rel_diff']:.1e}" if "rel_diff" in r else "",
                r["why"].replace("|", "/")] for r in rows]),
    ]))


if __name__ == "__main__":
    main()
