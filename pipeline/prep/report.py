"""DATA-HF's report (prep_report.json, saved inside the dataset) in parts, and the summary printed from it: what was
kept of each kind of record, by form, and what was skipped, by reason with where."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

REPORT = "prep_report.json"


def kind_report(kept: list[Counter], bad: list[list[tuple[str, str]]], by: str) -> dict:
    """Records of one kind kept (by input form or format) and skipped (by reason, with the first 1000 places of
    each)."""
    total = sum(kept, Counter())
    return {"rows": total.total(), by: dict(sorted(total.items())), "skipped": by_reason(bad)}


def by_reason(places: Iterable[list[tuple[str, str]]]) -> dict:
    """(reason, where) pairs as {reason: {count, where: the first 1000}}."""
    skipped: dict[str, list[str]] = defaultdict(list)
    for pairs in places:
        for reason, where in pairs:
            skipped[reason].append(where)
    return {r: {"count": len(w), "where": w[:1000]} for r, w in sorted(skipped.items())}


def _kind_lines(part: dict, kept: str, skipped: str, by: str) -> list[str]:
    """The summary's lines for conversations, preference pairs or prompts: how many were kept by form, and the records
    skipped by reason with where the first were."""
    if not part["rows"] and not part["skipped"]:
        return []
    forms = ", ".join(f"{k} {v}" for k, v in part[by].items()) or "none kept"
    lines = [f"  {kept}: {part['rows']:,} ({forms})"]
    for reason, info in part["skipped"].items():
        where = info["where"]
        lines.append(f"  skipped {info['count']} {skipped} ({reason}): {', '.join(where[:3])}"
                     f"{' ...' if len(where) > 3 else ''}")
    return lines


def format_summary(report: dict) -> str:
    lines = [
        f"saved {report['rows']:,} rows ({report['characters']:,} characters) from {report['files_read']} files "
        f"to {report['save_dir']} in {report['seconds']:.1f}s",
        "  files by type: " + ", ".join(f"{k} {v}" for k, v in report["files_by_type"].items()),
    ]
    for reason, info in report["skipped"].items():
        paths = info["paths"]
        lines.append(f"  skipped {info['count']} ({reason}): {', '.join(paths[:5])}{' ...' if len(paths) > 5 else ''}")
    if report["bad_jsonl_lines"]["count"]:
        lines.append(f"  unparsable .jsonl lines skipped: {report['bad_jsonl_lines']['count']}")
    for reason, info in report["rows_skipped"].items():
        lines.append(f"  skipped {info['count']} rows ({reason}, limit --max_row_mb {report['limits']['max_row_mb']:g})"
                     f": {', '.join(info['where'][:3])}{' ...' if len(info['where']) > 3 else ''}")
    if wrapped := report["records_in_wrappers"]["count"]:
        where = report["records_in_wrappers"]["where"]
        lines.append(f"  lists of records read from inside an object: {wrapped} ({', '.join(where[:3])}"
                     f"{' ...' if len(where) > 3 else ''}; the object's other values are not text)")
    unpaired = report["preferences"]["by_form"].get("unpaired", 0)
    kept = "preference records" if unpaired else "preference pairs"  # KTO's unpaired records are no pairs
    lines += _kind_lines(report["preferences"], kept, "preference records", "by_form")
    lines += _kind_lines(report["conversations"], "conversations", "conversations", "by_format")
    lines += _kind_lines(report["prompts"], "prompts", "prompt records", "by_form")
    lines.append(f"  report: {Path(report['save_dir']) / REPORT}")
    return "\n".join(lines)
