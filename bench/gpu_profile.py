"""BENCHMARKS.md's gpu_profile section: the profiles make gpu-check keeps (pipeline/train/profiling.py's summaries)
side by side, ours against the Hugging Face Trainer on the same shape, and QLoRA's memory broken down."""

from __future__ import annotations

from common import table

SHOWN = 10
"""Kernels listed per system."""


def cell(part: dict | None) -> str:
    return f"{part['ms_per_step']:.1f} ({part['share']:.0%})" if part else "-"


def split_table(ours: dict, hf: dict) -> tuple[str, list[str]]:
    """Kinds of work per step, both systems, and the kinds where ours spends more (ms per step, largest first)."""
    kinds = list(dict.fromkeys([*ours["split"], *hf["split"]]))
    rows, more = [], []
    for kind in kinds:
        a, b = ours["split"].get(kind), hf["split"].get(kind)
        diff = (a["ms_per_step"] if a else 0.0) - (b["ms_per_step"] if b else 0.0)
        rows.append([kind, cell(a), cell(b), f"{diff:+.1f}"])
        if diff >= 0.5:
            more.append((diff, kind))
    rows.append(["whole step (wall)", f"{ours['step_ms']:.1f}", f"{hf['step_ms']:.1f}",
                 f"{ours['step_ms'] - hf['step_ms']:+.1f}"])
    more.sort(reverse=True)
    return (table(["kind of work", "ours: ms per step (share)", "HF Trainer: ms per step (share)", "ours - HF, ms"],
                  rows), [f"{kind} (+{diff:.1f} ms)" for diff, kind in more])


def kernel_table(ours: dict, hf: dict) -> str:
    rows = []
    for i in range(min(SHOWN, max(len(ours["top"]), len(hf["top"])))):
        row = [i + 1]
        for prof in (ours, hf):
            k = prof["top"][i] if i < len(prof["top"]) else None
            row += [f"`{k['name'][:70]}`" if k else "-", k["kind"] if k else "-",
                    f"{k['calls']:g}" if k else "-", f"{k['ms_per_step']:.2f} ({k['share']:.0%})" if k else "-"]
        rows.append(row)
    return table(["#", "ours: kernel", "kind", "calls", "ms per step (share)", "HF: kernel", "kind", "calls",
                  "ms per step (share)"], rows)


def memory_table(profile: dict) -> str | None:
    mem = profile.get("memory")
    if not mem or "parts_gib" not in mem or "peak_allocated_gib" not in mem:
        return None
    parts = mem["parts_gib"]
    named = {"nf4_base": "4-bit (NF4) base weights", "embedding_and_head": "embedding and output layer",
             "frozen_other": "other frozen weights (norms)", "trained_and_states": "adapters, their gradients and "
                                                                                   "AdamW states"}
    rows = [[named[k], f"{v:.2f}"] for k, v in parts.items()]
    rows.append(["anything else held at the step's start", f"{mem['allocated_gib'] - sum(parts.values()):.2f}"])
    rows.append(["activations and transients (peak - start)", f"{mem['activations_and_transients_gib']:.2f}"])
    rows.append(["**peak allocated**", f"**{mem['peak_allocated_gib']:.2f}**"])
    return table(["part", "GiB"], rows)


def report(results: list[dict], command: str) -> str | None:
    """The section's body from the results' latest profiled full_speed pair and QLoRA profile, or None without."""
    latest = {(r["part"], r["system"]): r for r in results if r.get("profile")}
    ours, hf = latest.get(("full_speed", "ours")), latest.get(("full_speed", "hf"))
    lines = []
    if ours and hf:
        split, more = split_table(ours["profile"], hf["profile"])
        p = ours["profile"]
        lines += [f"- Machine: {ours['machine']}; command: {command}.",
                  f"- `{ours['variant']}` against `{hf['variant']}`: {ours['preset']}'s shape, batch {ours['batch']} "
                  f"x {ours['seq']}, {p['steps']} steps profiled after {ours['steps']} measured (torch.profiler, "
                  "device kernels' self time; host waits: the wall time no kernel ran).", "", split, "",
                  "Where ours spends time the Trainer does not: " + (", ".join(more) or "nowhere, by more than "
                                                                     "0.5 ms a step") + ".", "",
                  kernel_table(ours["profile"], hf["profile"])]
    qlora = latest.get(("adapters", "ours"))
    if qlora and (mem := memory_table(qlora["profile"])):
        lines += ["", f"QLoRA's memory (`{qlora['variant']}`, {qlora['preset']}'s shape, batch {qlora['batch']} x "
                      f"{qlora['seq']}, at the first profiled step):", "", mem]
    return "\n".join(lines) if lines else None
