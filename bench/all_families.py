"""Every causal-LM family of the installed transformers, from its own registry (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
not from a list of ours: a tiny config derived from each config class's own defaults (tiny_config), its model saved as
save_pretrained saves it with its persistent buffers set away from their initial values, then on 2 ranks under fsdp2
and ddp (bench/all_families_worker.py): every parameter and buffer after our load against from_pretrained's, the
trainer's first loss against the model's own forward, one AdamW step, and the export read back against the trained
model; and whether the model's logits before the last position move when only the last token changes (a causal
LM's do not). Each family is one launch under a time limit, so a family that crashes or hangs costs its own row only.
Rewrites the all_families table of BENCHMARKS.md; raw results in bench/data/all_families.json.

    .venv/bin/python bench/all_families.py [--workdir .bench/all_families] [--only TYPE ...]

Verdicts: right (every check passed under both strategies); refused (our one-line error, exit 2: the family is not
trained); cannot build (its tiny config or model cannot be made from its defaults: not a verdict on the pipeline);
wrong (a check failed: trained or exported silently wrong, the goal is none; or transformers' own model attends
to later tokens, which the trainer would train as it is); crashed (a traceback, not one line).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from common import ROOT, bench_env, machine, table, torchrun_cmd, update_section

WORKER = ROOT / "bench" / "all_families_worker.py"
RAW = ROOT / "bench" / "data" / "all_families.json"
MAX_PARAMS = 30_000_000
"""A tiny config still holding more parameters than this kept a size we did not shrink: not built (2 cores)."""
LAUNCH_SECONDS = 300

SIZES = {
    64: ("hidden_size", "n_embd", "d_model", "embedding_size", "attention_hidden_size"),
    128: ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "decoder_ffn_dim", "encoder_ffn_dim", "dff",
          "dim_ff", "intermediate_size_mlp", "dense_intermediate_size", "shared_intermediate_size"),
    2: ("num_experts_per_tok", "moe_topk", "moe_k", "n_group", "index_n_heads"),
    4: ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
        "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "linear_num_key_heads",
        "mamba_n_heads", "swa_num_attention_heads"),
    16: ("head_dim", "attention_head_dim", "kv_channels", "dim_head", "qk_head_dim", "v_head_dim", "swa_head_dim",
         "linear_head_dim", "mamba_d_head", "index_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
         "hidden_size_per_layer_input", "mamba_d_state", "state_size", "ssm_state_size", "mamba_chunk_size",
         "chunk_size", "global_head_dim"),
    32: ("moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
         "expert_ffn_hidden_size", "kv_lora_rank", "o_lora_rank"),
    48: ("q_lora_rank",),
    8: ("linear_key_head_dim", "linear_value_head_dim", "sliding_window", "sliding_window_size", "rotary_dim",
        "attention_chunk_size", "window_size", "local_attention_window_len", "linear_num_value_heads", "index_topk"),
    512: ("vocab_size", "vocab_size_per_layer_input"),
    1: ("first_k_dense_replace", "topk_group"),
}
"""Each size of the miniature and the config fields (as named by some family) that take it: hidden 64, 4 heads of
16 (2 KV heads where the family groups them), 4 experts of which 2 per token, 512 tokens. The number of layers is the
family's own: its per-layer lists (layer kinds, sizes, per-layer configs) stay valid, and 128 layers of hidden 64
are still small."""
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def shrink(values: dict) -> dict:
    """A config's dict with every size of SIZES set (in nested configs and per-layer lists too), dropout and a router's
    jitter noise off (the trainer's loss, is compared with the model's own in training mode), token ids
    outside the vocabulary moved into it."""
    out = {}
    for key, value in values.items():
        size = next((size for size, keys in SIZES.items() if key in keys), None)
        if isinstance(value, dict):
            out[key] = shrink(value)
        elif isinstance(value, bool) or value is None:
            out[key] = value
        elif isinstance(value, float) and any(word in key for word in ("dropout", "pdrop", "jitter")):
            out[key] = 0.0
        elif key in TOKEN_IDS and isinstance(value, int) and value >= 512:
            out[key] = TOKEN_IDS[key]
        elif key in ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num") and \
                isinstance(value, int):
            out[key] = min(value, 2)
        elif key == "n_group" and values.get("topk_group") is None:  # no grouped routing: the family's own value
            out[key] = value
        elif size is not None and isinstance(value, int):
            out[key] = size
        elif size is not None and isinstance(value, list) and all(isinstance(v, int) for v in value):
            out[key] = [size] * len(value)
        else:
            out[key] = value
    if "kv_lora_rank" in values and "num_key_value_heads" in values:  # MLA: a key and a value per query head
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
    return out


def tiny_config(model_type: str):
    """The family's config class built from its defaults, shrunk, in fp32."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    config = config_class.from_dict(shrink(config_class().to_dict()))
    config.dtype = "float32"
    return config


def build(model_type: str, out: Path) -> str | None:
    """Save the family's tiny model to out; None, or why it cannot be built."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.prep.tiny import random_buffers

    try:
        config = tiny_config(model_type)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        if (n := sum(p.numel() for p in meta.parameters())) > MAX_PARAMS:
            return f"its tiny config still has {n / 1e6:.0f}M parameters (a size field of its own not shrunk)"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        random_buffers(model)
        model.save_pretrained(out)
    except Exception as exc:  # noqa: BLE001 (any failure of transformers' own classes is this family's row)
        return f"{type(exc).__name__}: {first_line(str(exc))}"
    return None


def first_line(text: str, width: int = 240) -> str:
    """An error's text on one line (a validator's reason is on its second), at most width characters."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[:width - 3] + "..."


def run_family(model_type: str, workdir: Path) -> dict:
    """One family's row: cannot build, or the worker's checks under fsdp2 and ddp (crashed where it gave none)."""
    folder = workdir / model_type
    if (why := build(model_type, folder)) is not None:
        return {"family": model_type, "verdict": "cannot build", "why": why}
    out = workdir / f"{model_type}.json"
    out.unlink(missing_ok=True)
    try:
        done = subprocess.run(torchrun_cmd(2, WORKER, out, folder, workdir / "scratch"), cwd=ROOT, env=bench_env(),
                              capture_output=True, text=True, timeout=LAUNCH_SECONDS)
    except subprocess.TimeoutExpired:
        return {"family": model_type, "verdict": "crashed", "why": f"no result in {LAUNCH_SECONDS} s (a hang)"}
    if not out.exists():
        errors = [x for x in done.stderr.splitlines() if "Error" in x or "error:" in x]
        return {"family": model_type, "verdict": "crashed", "why": first_line(errors[-1] if errors else done.stderr)}
    return {"family": model_type, **verdict(json.loads(out.read_text()))}


def verdict(checks: list[dict]) -> dict:
    """A family's verdict from its checks: the worst of them; where every strategy refuses it, refused (nothing is
    trained, so what its own model does, attending to later tokens, is moot)."""
    strategies = [c for c in checks if c["strategy"] != "-"]
    counted = strategies if strategies and all(c["verdict"] == "refused" for c in strategies) else checks
    for kind in ("wrong", "crashed", "refused", "cannot build"):
        if bad := [c for c in counted if c["verdict"] == kind]:
            why = "; ".join(f"{c['strategy']}: {c['why']}" if c["strategy"] != "-" else c["why"] for c in bad)
            return {"verdict": kind, "why": why, "checks": checks}
    return {"verdict": "right", "why": "", "checks": checks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "all_families")
    p.add_argument("--only", nargs="*", default=None,
                   help="these model types only: their rows replaced in the last results, the table rewritten")
    args = p.parse_args()
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for model_type in args.only or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        rows.append(run_family(model_type, args.workdir))
        rows[-1]["why"] = rows[-1]["why"].replace(f"{args.workdir}/", "")  # the scratch folder says nothing
        print(f"{model_type}: {rows[-1]['verdict']} {rows[-1]['why']}", flush=True)
    if args.only:
        fresh = {r["family"]: r for r in rows}
        rows = [fresh.pop(r["family"], r) for r in json.loads(RAW.read_text())] + list(fresh.values())
    RAW.write_text(json.dumps(rows, indent=1))
    update_section("all_families", report(rows, __version__))


def report(rows: list[dict], version: str) -> str:
    counts = {kind: sum(r["verdict"] == kind for r in rows) for kind in
              ("right", "refused", "cannot build", "wrong", "crashed")}
    worst = {r["family"]: max((c.get("loss_diff", 0.0) for c in r.get("checks", [])), default=0.0) for r in rows}
    lines = [[r["family"], r["verdict"], f"{worst[r['family']]:.1e}" if r["verdict"] == "right" else "",
              r["why"].replace("|", "/")] for r in rows]
    return "\n".join([
        f"- Machine: {machine()}; transformers {version}: {len(rows)} causal-LM model types in its registry.",
        "- Command: `.venv/bin/python bench/all_families.py` (worker `bench/all_families_worker.py`: 2 ranks, fp32, "
        "fsdp2 and ddp, one batch of 2 x 32 tokens, one AdamW step).",
        "- " + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ".",
        "",
        table(["model type", "verdict", "largest |loss diff| (fsdp2, ddp)", "why"], lines),
    ])


if __name__ == "__main__":
    main()
