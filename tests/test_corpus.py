import json
import os
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
from conftest import ROOT, hold_lock, kill_tree, run_script, start_python, with_root

from pipeline.data.dataset import prompt_rows
from pipeline.errors import UserError
from pipeline.prep.corpus import REPORT, CorpusConfig, build_dataset, format_summary
from pipeline.prep.extract import split_paragraphs, strings_in


def write(root: Path, rel: str, content: str | bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")


def rows_by_source(save_dir: Path) -> dict[str, list]:
    """Each source's rows in order: its text, or its messages for a conversation (whose text is empty)."""
    ds = datasets.load_from_disk(str(save_dir))
    assert ds.column_names == ["text", "messages", "source", "chosen", "rejected", "tools", "columns"]
    out: dict[str, list] = {}
    for row in ds:
        assert (row["text"] == "") != (row["messages"] == [])
        out.setdefault(row["source"], []).append(row["text"] or stored(row["messages"]))
    return out


def stored(messages: list[dict]) -> list[dict]:
    """Messages as read back, without the optional fields (None in the dataset) they do not have."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def chat(*turns: str, system: str | None = None) -> list[dict]:
    """Messages alternating user/assistant from the first turn."""
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def test_conversations_in_every_format_and_malformed_ones_counted(tmp_path):
    data = tmp_path / "data"
    openai = {"messages": chat("Hi", "Hello!", "Bye", "Goodbye.", system="Be kind.")}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text",
                                                                                          "text": "parts"}]},
                          {"role": "assistant", "content": "ok"}]}
    share = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                               {"from": "gpt", "value": "A"}]}
    alpaca = {"instruction": "Add them.", "input": "2 and 3", "output": "5"}
    alpaca_no_input = {"instruction": "Name a colour.", "output": "Blue."}
    pc = {"prompt": "Say hi.", "completion": "Hi!"}
    pc_lists = {"prompt": [{"role": "user", "content": "Q?"}], "completion": [{"role": "assistant", "content": "A."}]}
    bad = [
        {"messages": chat("Hi", "Hello") + [{"role": "robot", "content": "beep"}]},  # unknown_role
        {"messages": []},  # empty
        {"messages": chat("Hi", "   ")},  # empty (a blank turn)
        {"messages": chat("Only a question")},  # no_assistant_turn
        {"messages": [{"role": "assistant", "content": "A"}, {"role": "user", "content": "Q"}]},  # not_alternating
        {"messages": chat("Q", "A") + [{"role": "user", "content": "Q2"}, {"role": "user", "content": "Q3"},
                                       {"role": "assistant", "content": "A"}]},  # not_alternating
        {"messages": [{"role": "user"}]},  # malformed_message (no content)
        {"conversations": "not a list"},  # malformed_message
        {"instruction": 3, "output": "x"},  # malformed_message
    ]
    lines = [openai, {"note": "plain text record"}, *bad, parts, alpaca]
    write(data, "chats.jsonl", "\n".join(map(json.dumps, lines[:5])) + "\n{broken\n" +
          "\n".join(map(json.dumps, lines[5:])) + "\n")
    write(data, "share.json", json.dumps([share, pc, {"text": "just text"}]))
    write(data, "single.json", json.dumps(alpaca_no_input))
    write(data, "lists.jsonl", json.dumps(pc_lists) + "\n")
    write(data, "allbad.jsonl", json.dumps({"messages": chat("no answer")}) + "\n")
    report = build(data, tmp_path / "out")
    assert rows_by_source(tmp_path / "out") == {
        "chats.jsonl": [openai["messages"], "plain text record", chat("Two parts", "ok"),
                        chat("Add them.\n\n2 and 3", "5")],
        "lists.jsonl": [chat("Q?", "A.")],
        "share.json": [chat("Q", "A", system="S"), chat("Say hi.", "Hi!"), "just text"],
        "single.json": [chat("Name a colour.", "Blue.")],
    }
    chats = report["conversations"]
    assert chats["rows"] == 7
    assert chats["by_format"] == {"alpaca": 2, "messages": 2, "prompt_completion": 2, "sharegpt": 1}
    assert {r: v["where"] for r, v in chats["skipped"].items()} == {
        "empty": ["chats.jsonl:line 4", "chats.jsonl:line 5"],
        "malformed_message": ["chats.jsonl:line 10", "chats.jsonl:line 11", "chats.jsonl:line 12"],
        "no_assistant_turn": ["allbad.jsonl:line 1", "chats.jsonl:line 7"],
        "not_alternating": ["chats.jsonl:line 8", "chats.jsonl:line 9"],
        "unknown_role": ["chats.jsonl:line 3"],
    }
    assert report["bad_jsonl_lines"] == {"count": 1, "where": ["chats.jsonl:6"]}
    assert report["skipped"] == {"no_valid_conversation": {"count": 1, "paths": ["allbad.jsonl"]}}


def test_tool_calls_and_reasoning_traces_are_kept_as_fields_and_bad_ones_skipped_by_reason(tmp_path):
    """A conversation's tool calls (OpenAI's tool_calls, the older function_call, ShareGPT's function_call and
    observation), tool results, tool schemas and reasoning traces are stored as the template will take them: calls
    as a JSON list with arguments as objects, schemas as a JSON list. A tool result that answers no call, arguments
    that are not a JSON object and a schema that is not one are skipped by reason; a preference pair holding a
    trace is skipped (preference objectives do not train them)."""
    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    thought = {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."}
    lines = [
        {"messages": chat("Weather in Oslo?") + [call, result, {"role": "assistant", "content": "Sunny."}],
         "tools": [weather]},
        {"conversations": [{"from": "human", "value": "Weather?"},
                           {"from": "function_call", "value": "{\"name\": \"weather\", \"arguments\": {}}"},
                           {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "Sunny."}],
         "tools": json.dumps([weather["function"]])},
        {"messages": chat("2+2?") + [thought]},
        {"messages": chat("2+2?") + [{"role": "assistant", "content": "4", "thinking": "easy"}]},
        {"messages": chat("Weather?", "Checking.") + [{"role": "tool", "content": "sunny"}]},
        {"messages": chat("Weather?") + [{**call, "tool_calls": [{"function": {"name": "weather",
                                                                               "arguments": "{city"}}]}]},
        {"messages": chat("Hi", "Hello"), "tools": [{"type": "function", "function": {"description": "no name"}}]},
        {"messages": chat("Hi", "Hello")},
    ]
    write(tmp_path / "data", "chats.jsonl", "\n".join(map(json.dumps, lines)) + "\n")
    pair = {"prompt": chat("2+2?"), "chosen": [thought], "rejected": [{"role": "assistant", "content": "5"}]}
    with_tools = {"prompt": "Weather?", "chosen": "Sunny.", "rejected": "No idea.", "tools": [weather]}
    write(tmp_path / "pairs", "pairs.jsonl", json.dumps(pair) + "\n" + json.dumps(
        {"prompt": chat("2+2?"), "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "5"}]}) + "\n" + json.dumps(with_tools) + "\n")
    report = build(tmp_path / "data", tmp_path / "out", num_proc=1)
    stored_call = {"role": "assistant", "content": "", "tool_calls": json.dumps(
        [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}, "id": "c1"}])}
    sharegpt_call = {"role": "assistant", "content": "", "tool_calls": json.dumps(
        [{"type": "function", "function": {"name": "weather", "arguments": {}}}])}
    assert rows_by_source(tmp_path / "out") == {"chats.jsonl": [
        chat("Weather in Oslo?") + [stored_call, result, {"role": "assistant", "content": "Sunny."}],
        chat("Weather?") + [sharegpt_call, {"role": "tool", "content": "sunny"},
                            {"role": "assistant", "content": "Sunny."}],
        chat("2+2?") + [thought],
        chat("2+2?") + [{"role": "assistant", "content": "4", "reasoning_content": "easy"}],
        chat("Hi", "Hello")]}
    tools = datasets.load_from_disk(str(tmp_path / "out"))["tools"]
    assert tools == [json.dumps([weather]), json.dumps([weather["function"]]), "", "", ""]
    assert {r: v["where"] for r, v in report["conversations"]["skipped"].items()} == {
        "orphan_tool_result": ["chats.jsonl:line 5"], "bad_tool_arguments": ["chats.jsonl:line 6"],
        "bad_tool_schema": ["chats.jsonl:line 7"]}
    prefs = build(tmp_path / "pairs", tmp_path / "out_pairs", num_proc=1)["preferences"]
    assert prefs["rows"] == 1 and {r: v["where"] for r, v in prefs["skipped"].items()} == {
        "reasoning_trace": ["pairs.jsonl:line 1"], "tool_schemas": ["pairs.jsonl:line 3"]}


def test_json_nested_past_the_stack_inside_a_field_skips_that_record_alone(tmp_path):
    """An arguments or tools string nested 5,000 deep (json.loads raises RecursionError) is that record's problem:
    skipped as too_deeply_nested where it is, the rest of the file and folder kept."""
    deep = "[" * 5000 + "]" * 5000
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": deep}}]}
    lines = [{"messages": chat("Hi", "Hello")},
             {"messages": chat("Call it") + [call, {"role": "tool", "content": "ok"},
                                             {"role": "assistant", "content": "Done."}]},
             {"messages": chat("Hi again", "Hello again"), "tools": deep}]
    write(tmp_path / "data", "chats.jsonl", "\n".join(map(json.dumps, lines)) + "\n")
    write(tmp_path / "data", "notes.txt", "a document\n")
    report = build(tmp_path / "data", tmp_path / "out", num_proc=1)
    assert rows_by_source(tmp_path / "out") == {"chats.jsonl": [chat("Hi", "Hello")], "notes.txt": ["a document\n"]}
    assert {r: v["where"] for r, v in report["conversations"]["skipped"].items()} == {
        "too_deeply_nested": ["chats.jsonl:line 2", "chats.jsonl:line 3"]}


def build(data: Path, save: Path, **kw) -> dict:
    return build_dataset(CorpusConfig(data, save, num_proc=kw.pop("num_proc", 2), **kw))


def test_every_format_is_extracted(tmp_path):
    data = tmp_path / "data"
    write(data, "a/plain.txt", "first paragraph\n\nsecond paragraph\n")
    write(data, "a/readme.md", "\ufeff# Title\n\nbody\n")
    write(data, "b/nested.json", json.dumps({"title": "T", "n": 3, "body": {"x": ["one", {"y": "two"}], "z": "three"}}))
    write(data, "b/list.json", json.dumps([{"q": "q1", "a": "a1"}, {"q": "q2"}, 7, {"a": ""}]))
    write(data, "c/chat.jsonl", '{"role": "user", "content": "hi"}\n\n{"content": "there"}\n')  # not a conversation
    write(data, "c/docs.yaml", "title: first\nitems: [a, b]\n---\ntitle: second\n---\n42\n")
    write(data, "c/one.yml", "only: doc\n")
    report = build(data, tmp_path / "out")
    assert rows_by_source(tmp_path / "out") == {
        "a/plain.txt": ["first paragraph\n\nsecond paragraph\n"],
        "a/readme.md": ["# Title\n\nbody\n"],
        "b/list.json": ["q1\na1", "q2"],
        "b/nested.json": ["T\none\ntwo\nthree"],
        "c/chat.jsonl": ["user\nhi", "there"],
        "c/docs.yaml": ["first\na\nb", "second"],
        "c/one.yml": ["doc"],
    }
    assert report["files_by_type"] == {".json": 2, ".jsonl": 1, ".md": 1, ".txt": 1, ".yaml": 1, ".yml": 1}
    assert report["rows"] == 10
    assert report["skipped"] == {}
    assert json.loads((tmp_path / "out" / REPORT).read_text()) == report


def test_the_dataset_is_written_once_in_save_to_disks_layout(tmp_path):
    """The workers' shards become the dataset's files: the folder reads back as save_to_disk's own would (the same
    state keys, info, format and rows), so load_from_disk and every later stage see no difference."""
    data = tmp_path / "data"
    for k in range(6):
        write(data, f"d{k}/f.txt", f"text {k}\n" * 200)
    build(data, tmp_path / "out", num_proc=2)
    ours = datasets.load_from_disk(str(tmp_path / "out"))
    ours.save_to_disk(str(tmp_path / "theirs"))
    theirs = datasets.load_from_disk(str(tmp_path / "theirs"))
    assert sorted(p.name for p in (tmp_path / "out").glob("*.arrow")) == [
        "data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    state, their_state = (json.loads((tmp_path / d / "state.json").read_text()) for d in ("out", "theirs"))
    assert state.keys() == their_state.keys()
    assert len(state["_fingerprint"]) == len(their_state["_fingerprint"])
    info, their_info = (json.loads((tmp_path / d / "dataset_info.json").read_text()) for d in ("out", "theirs"))
    assert info == their_info
    assert ours.features == theirs.features and ours.format == theirs.format
    assert ours.to_dict() == theirs.to_dict()
    assert [r["text"] for r in ours] == [f"text {k}\n" * 200 for k in range(6)]


def test_large_text_is_cut_at_paragraphs():
    paras = [f"paragraph {i} " + "w" * 300 for i in range(10_000)]
    text = "\n\n".join(paras)
    rows = split_paragraphs(text, limit=100_000)
    assert all(len(r) <= 100_000 for r in rows)
    assert "\n\n".join(rows) == text
    assert all(r.startswith("paragraph ") for r in rows)


def test_deep_structures_do_not_recurse():
    deep: object = "bottom"
    for _ in range(100_000):
        deep = {"k": [deep]}
    assert strings_in(deep) == ["bottom"]


def test_bad_files_are_reported_and_good_text_kept(tmp_path):
    data = tmp_path / "data"
    write(data, "good.txt", "keep me\n")
    write(data, "mixed.jsonl", '{"t": "line one"}\n{broken\n{"t": "line three"}\n')
    write(data, "bin.txt", b"\x00\x01\x02binary")
    write(data, "latin.md", "caf\xe9".encode("latin-1"))
    write(data, "broken.json", '{"a": [1,')
    write(data, "broken.yaml", "a: [b\n")
    write(data, "empty.txt", "")
    write(data, "blank.md", "  \n\n")
    write(data, "deep.json", "[" * 100_000 + "]" * 100_000)
    write(data, "deep.yaml", "[" * 100_000 + "]" * 100_000)  # the C loader's stack overflows: SIGSEGV, not skipped
    write(data, "bomb.yaml", BOMB)
    write(data, "numbers.json", "[1, 2, 3]")
    write(data, "allbad.jsonl", "{x\n{y\n")
    write(data, "table.csv", "a,b\n")
    report = build(data, tmp_path / "out")
    assert rows_by_source(tmp_path / "out") == {"good.txt": ["keep me\n"], "mixed.jsonl": ["line one", "line three"]}
    assert {k: v["paths"] for k, v in report["skipped"].items()} == {
        "binary": ["bin.txt"],
        "empty": ["blank.md", "empty.txt"],
        "invalid_json": ["broken.json"],
        "invalid_jsonl": ["allbad.jsonl"],
        "invalid_yaml": ["broken.yaml"],
        "no_text": ["numbers.json"],
        "too_deeply_nested": ["deep.json", "deep.yaml"],
        "alias_expansion": ["bomb.yaml"],
        "undecodable": ["latin.md"],
        "unsupported_type": ["table.csv"],
    }
    assert report["bad_jsonl_lines"] == {"count": 1, "where": ["mixed.jsonl:2"]}


def test_a_name_that_is_not_utf8_and_a_link_loop_stop_nothing(tmp_path):
    data = tmp_path / "data"
    write(data, "good.txt", "keep me\n")
    (data / os.fsdecode(b"caf\xe9.txt")).write_text("latin-1 name\n")
    (data / "x").symlink_to(data / "y")
    (data / "y").symlink_to(data / "x")
    proc = run_script("DATA-HF.py", "--data_folder", data, "--save_dir", tmp_path / "out", "--num_proc", 2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rows_by_source(tmp_path / "out") == {"caf\\xe9.txt": ["latin-1 name\n"], "good.txt": ["keep me\n"]}
    assert "skipped 2 (not_a_regular_file): x, y" in proc.stdout


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))
"""342 bytes of aliases naming aliases: 9^9 (387M) strings once expanded."""


def test_yaml_tags_cannot_run_code(tmp_path):
    marker = tmp_path / "pwned"
    data = tmp_path / "data"
    write(data, "ok.txt", "fine\n")
    write(data, "evil.yaml", f"!!python/object/apply:os.system ['touch {marker}']\n")
    write(data, "evil2.yaml", f"x: !!python/object/apply:subprocess.check_call [['touch', '{marker}']]\n")
    report = build(data, tmp_path / "out")
    assert not marker.exists()
    assert report["skipped"]["invalid_yaml"]["paths"] == ["evil.yaml", "evil2.yaml"]


def test_organize_manifest_is_not_corpus(tmp_path):
    data = tmp_path / "splits"
    write(data, "manifest.jsonl", '{"source": "a.txt"}\n')
    write(data, "split_00/a.txt", "text\n")
    build(data, tmp_path / "out")
    assert rows_by_source(tmp_path / "out") == {"split_00/a.txt": ["text\n"]}


@pytest.mark.parametrize("value", [0.0, float("inf"), float("nan"), 1e308])
def test_a_size_limit_that_is_no_number_of_bytes_is_one_line(tmp_path, value):
    data = tmp_path / "data"
    write(data, "a.txt", "text\n")
    for name in ("max_file_mb", "max_row_mb"):
        with pytest.raises(UserError) as err:
            build(data, tmp_path / "out", **{name: value})
        assert str(err.value) == f"--{name} must be in (0, 1048576] (a TiB), got {value}"
    assert not (tmp_path / "out").exists()


def test_a_mount_point_as_save_dir_is_one_line(tmp_path, small_disk):
    """--overwrite replaces the folder by renaming over it, which a mount point refuses (EBUSY): said before any
    work, with the fix."""
    data = tmp_path / "data"
    write(data, "a.txt", "text\n")
    for overwrite in (False, True):
        with pytest.raises(UserError) as err:
            build(data, small_disk.path, overwrite=overwrite)
        inside = small_disk.path / "dataset"
        assert str(err.value) == (f"--save_dir {small_disk.path} is a mount point, which cannot be replaced as a "
                                  f"whole: write the dataset to a folder inside it (e.g. {inside})")
    build(data, small_disk.path / "dataset")
    assert rows_by_source(small_disk.path / "dataset") == {"a.txt": ["text\n"]}


def test_existing_save_dir_needs_overwrite_and_must_be_a_dataset(tmp_path):
    data = tmp_path / "data"
    write(data, "a.txt", "v1\n")
    build(data, tmp_path / "out")
    with pytest.raises(UserError, match="already exists; pass --overwrite to replace it"):
        build(data, tmp_path / "out")
    write(data, "a.txt", "v2\n")
    build(data, tmp_path / "out", overwrite=True)
    assert rows_by_source(tmp_path / "out") == {"a.txt": ["v2\n"]}
    write(tmp_path, "home/precious.txt", "mine")
    with pytest.raises(UserError, match=r"home holds files DATA-HF.py did not write \(precious.txt\); refusing to "
                                        "write into it: choose a new --save_dir"):
        build(data, tmp_path / "home", overwrite=True)
    assert (tmp_path / "home" / "precious.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "home", "out"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data_folder", "{t}/nope", "--save_dir", "{t}/out"],
         "error: --data_folder {t}/nope does not exist or is not a directory\n"),
        (["--data_folder", "{t}/data", "--save_dir", "{t}/data/out"],
         "error: --save_dir {t}/data/out is inside --data_folder {t}/data; a later run would read the dataset "
         "back as input\n"),
        (["--data_folder", "{t}/data", "--save_dir", "{t}/out", "--num_proc", "0"],
         "error: --num_proc must be at least 1, got 0\n"),
        (["--data_folder", "{t}/empty", "--save_dir", "{t}/out"],
         "error: --data_folder {t}/empty holds no .txt/.md/.json/.jsonl/.yaml/.yml/.parquet files\n"),
        (["--data_folder", "{t}/bad", "--save_dir", "{t}/out"],
         "error: no text extracted from {t}/bad (binary: 1, empty: 1)\n"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, args, message):
    write(tmp_path, "data/a.txt", "a")
    (tmp_path / "empty").mkdir()
    write(tmp_path, "bad/x.txt", b"\x00")
    write(tmp_path, "bad/y.txt", b"")
    proc = run_script("DATA-HF.py", *(a.format(t=tmp_path) for a in args))
    assert proc.returncode == 2
    assert proc.stderr.endswith(message.format(t=tmp_path))  # after the progress bar, if work had started
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))


def test_killed_midway_leaves_nothing_and_rerun_succeeds(tmp_path):
    data = tmp_path / "data"
    for i in range(300):
        # written by hand: PyYAML's pure-Python dumper took 46 s for these 60,000 documents
        write(data, f"f{i:03d}.yaml", "".join(f"---\nk: {f'value {i} {j} ' * 40}\n" for j in range(200)))
    save = tmp_path / "out"
    cmd = [str(ROOT / "DATA-HF.py"), "--data_folder", str(data), "--save_dir", str(save), "--num_proc", "2"]
    proc = start_python(cmd, with_root(), offline=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.partial-*/chunk-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, "finished before it could be interrupted; make the corpus bigger"
        time.sleep(0.01)
    # SIGKILL to it and its pool's workers, returning once every one has exited: the rerun, started warm in under a
    # second, found the lock still held by a worker not yet gone (2026-11-28, the suite on 2 cores)
    kill_tree(proc)
    assert not save.exists()
    assert list(tmp_path.glob(".out.partial-*")), "the kill should have left a partial work folder"
    done = run_script("DATA-HF.py", "--data_folder", data, "--save_dir", save, "--num_proc", 2)
    assert done.returncode == 0, done.stderr
    assert len(datasets.load_from_disk(str(save))) == 300 * 200
    assert not list(tmp_path.glob(".out.partial-*")), "stale partial folders are cleaned by the next run"


def test_cli_prints_summary(tmp_path):
    write(tmp_path, "data/a.txt", "hello\n")
    proc = run_script("DATA-HF.py", "--data_folder", tmp_path / "data", "--save_dir", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"saved 1 rows (6 characters) from 1 files to {tmp_path / 'out'} in ")
    assert f"report: {tmp_path / 'out' / REPORT}" in proc.stdout


def test_a_second_data_hf_on_a_save_dir_being_written_is_refused_and_a_dead_writers_lock_is_taken(tmp_path):
    import socket

    write(tmp_path, "data/a.txt", "hello\n")
    save = tmp_path / "out"
    first = hold_lock(save, "DATA-HF.py")
    refused = run_script("DATA-HF.py", "--data_folder", tmp_path / "data", "--save_dir", save)
    assert refused.returncode == 2
    assert refused.stderr.startswith(f"error: --save_dir {save} is being written by DATA-HF.py (pid {first.pid} on "
                                     f"{socket.gethostname()}, since "), refused.stderr
    assert refused.stderr.endswith("; wait for it to end, or choose another --save_dir\n")
    assert not save.exists()
    first.kill()  # a writer that died: the kernel dropped its lock
    first.wait()
    done = run_script("DATA-HF.py", "--data_folder", tmp_path / "data", "--save_dir", save)
    assert done.returncode == 0, done.stderr
    assert len(datasets.load_from_disk(str(save))) == 1


def test_every_valid_record_is_read(tmp_path):
    """JSONL split on newlines alone (U+2028, U+2029 and U+0085 inside a string are text), CRLF lines, integers of
    any length, UTF-16 and UTF-32 files, and a dataset's own to_json and to_parquet read back to the same rows."""
    data = tmp_path / "data"
    odd = "a\u2028b\u2029c\x85d"
    write(data, "sep.jsonl", json.dumps({"text": odd}, ensure_ascii=False) + "\r\n" + json.dumps({"text": "two"})
          + "\r\n")
    write(data, "big.json", '{"n": ' + "7" * 5000 + ', "text": "a big number"}')
    write(data, "big.jsonl", '{"n": -' + "7" * 5000 + ', "text": "a big line"}\n{"text": "after it"}\n')
    write(data, "big.yaml", "n: " + "7" * 5000 + "\ntext: a big YAML number\n")
    write(data, "u16.txt", "UTF-16 with a BOM\n".encode("utf-16"))
    write(data, "u16le.md", "UTF-16 without one\n".encode("utf-16-le"))
    write(data, "u32.jsonl", (json.dumps({"text": "UTF-32"}) + "\n").encode("utf-32"))
    ours = datasets.Dataset.from_dict({"text": ["a document", ""], "source": ["x.txt", "y.jsonl"],
                                       "messages": [[], chat("Q", "A")]})
    ours.to_json(str(data / "own.jsonl"))
    ours.to_parquet(str(data / "own.parquet"))
    report = build(data, tmp_path / "out")
    own = ["a document", chat("Q", "A")]
    assert rows_by_source(tmp_path / "out") == {
        "big.json": ["a big number"], "big.jsonl": ["a big line", "after it"], "big.yaml": ["a big YAML number"],
        "own.jsonl": own, "own.parquet": own, "sep.jsonl": [odd, "two"], "u16.txt": ["UTF-16 with a BOM\n"],
        "u16le.md": ["UTF-16 without one\n"], "u32.jsonl": ["UTF-32"],
    }
    assert report["bad_jsonl_lines"]["count"] == 0 and report["skipped"] == {}


def test_records_wrapped_in_an_object_are_records(tmp_path):
    data = tmp_path / "data"
    convs = [{"messages": chat("Hi", "Hello")}, {"messages": chat("Q", "A")}]
    write(data, "wrapped.json", json.dumps({"version": "1.0", "data": convs}))
    write(data, "deeper.json", json.dumps({"meta": {"name": "x"}, "splits": {"train": [{"text": "t1"}, {"q": "q2"}]}}))
    write(data, "wrapped.jsonl", json.dumps({"rows": [convs[0], {"messages": chat("only a question")}]}) + "\n")
    write(data, "list.yaml", "- messages:\n  - {role: user, content: yaml q}\n  - {role: assistant, content: yaml a}\n")
    write(data, "doc.json", json.dumps({"title": "T", "body": {"x": ["one", {"y": "two"}]}}))  # a document, not records
    report = build(data, tmp_path / "out")
    assert rows_by_source(tmp_path / "out") == {
        "deeper.json": ["t1", "q2"], "doc.json": ["T\none\ntwo"], "list.yaml": [chat("yaml q", "yaml a")],
        "wrapped.json": [chat("Hi", "Hello"), chat("Q", "A")], "wrapped.jsonl": [chat("Hi", "Hello")],
    }
    assert report["records_in_wrappers"] == {
        "count": 3, "where": ["deeper.json: splits.train", "wrapped.json: data", "wrapped.jsonl: rows"]}
    assert report["conversations"]["skipped"] == {
        "no_assistant_turn": {"count": 1, "where": ["wrapped.jsonl:line 1 rows[2]"]}}


def test_a_worker_reads_no_file_or_row_beyond_its_limits(tmp_path, monkeypatch):
    """A sparse 2 GB file is sniffed and skipped unread; a document over --max_file_mb and a row over --max_row_mb
    are skipped by reason; a text file larger than WHOLE_BYTES is streamed to the rows of the whole file."""
    from pipeline.prep import extract

    data = tmp_path / "data"
    data.mkdir()
    with open(data / "sparse.json", "wb") as fh:
        fh.truncate(2**31)
    write(data, "doc.json", json.dumps({"text": "x" * 3 * 2**20}))
    write(data, "rows.jsonl", json.dumps({"text": "y " * 2**20}) + "\n" + json.dumps({"text": "short"}) + "\n")
    write(data, "long.jsonl", json.dumps({"text": "z" * 3 * 2**20}) + "\n")
    paras = [f"paragraph {i} " + "w" * 300 for i in range(10_000)]
    write(data, "stream.txt", "\n\n".join(paras))
    monkeypatch.setattr(extract, "WHOLE_BYTES", 2**20)
    monkeypatch.setattr(extract, "BLOCK_BYTES", 100_000)
    report = build(data, tmp_path / "out", num_proc=1, max_file_mb=2, max_row_mb=1)
    rows = rows_by_source(tmp_path / "out")
    assert rows["rows.jsonl"] == ["short"] and "\n\n".join(rows["stream.txt"]) == "\n\n".join(paras)
    assert rows["stream.txt"] == split_paragraphs("\n\n".join(paras))
    assert {k: v["paths"] for k, v in report["skipped"].items()} == {
        "binary": ["sparse.json"], "no_valid_row": ["long.jsonl"], "too_large": ["doc.json"]}
    assert report["rows_skipped"] == {"row_too_large": {"count": 2, "where": ["long.jsonl:line 1",
                                                                              "rows.jsonl:line 1"]}}


def test_every_data_kind_reads_back_from_its_own_to_json_and_to_parquet(tmp_path):
    """What DATA-HF writes reads back through DATA-HF: a dataset of text, conversations, tool calls with results and
    schemas and reasoning traces, one of preference pairs, one of KTO's unpaired records and one of prompts with
    their other keys (each standard and conversational), each exported with datasets' own to_json and to_parquet,
    gives every row back as it was (its source is the file it was read from)."""
    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]}
    chats = [{"messages": chat("Hi", "Hello")},
             {"messages": chat("Weather in Oslo?") + [call, {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                                                      {"role": "assistant", "content": "Sunny."}], "tools": [weather]},
             {"messages": chat("2+2?") + [{"role": "assistant", "content": "4", "reasoning_content": "2 and 2."}]}]
    pairs = [{"prompt": "2+2?", "chosen": "4", "rejected": "5"},
             {"prompt": chat("3+3?"), "chosen": [{"role": "assistant", "content": "6"}],
              "rejected": [{"role": "assistant", "content": "7"}]}]
    write(tmp_path / "sft", "notes.txt", "a document\n")
    write(tmp_path / "sft", "chats.jsonl", "\n".join(map(json.dumps, chats)) + "\n")
    unpaired = [{"prompt": "2+2?", "completion": "4", "label": True},
                {"prompt": chat("3+3?"), "completion": [{"role": "assistant", "content": "7"}], "label": False}]
    write(tmp_path / "pairs", "pairs.jsonl", "\n".join(map(json.dumps, pairs)) + "\n")
    write(tmp_path / "kto", "feedback.jsonl", "\n".join(map(json.dumps, unpaired)) + "\n")
    prompts = [{"prompt": "Ünïcode 2+2?", **COLUMNS}, {"prompt": "Nothing else."},
               {"prompt": chat("Weather in Oslo?", system="Be brief."), "tools": [weather], "answer": {"c": 21}}]
    write(tmp_path / "grpo", "prompts.jsonl", "\n".join(json.dumps(r, ensure_ascii=False) for r in prompts) + "\n")
    for kind, rows in (("sft", 4), ("pairs", 2), ("kto", 2), ("grpo", 3)):
        build(tmp_path / kind, tmp_path / f"{kind}-ds", num_proc=1)
        first = datasets.load_from_disk(str(tmp_path / f"{kind}-ds"))
        assert len(first) == rows
        for fmt in ("json", "parquet"):
            again = tmp_path / f"{kind}-{fmt}"
            again.mkdir()
            getattr(first, f"to_{fmt}")(str(again / f"rows.{'jsonl' if fmt == 'json' else fmt}"))
            report = build(again, tmp_path / f"{kind}-{fmt}-ds", num_proc=1)
            back = datasets.load_from_disk(str(tmp_path / f"{kind}-{fmt}-ds"))
            assert [{k: v for k, v in r.items() if k != "source"} for r in back] == [
                {k: v for k, v in r.items() if k != "source"} for r in first], (kind, fmt)
            assert not any(report[part]["skipped"] for part in ("conversations", "preferences", "prompts"))
            assert report["prompts"]["rows"] == (rows if kind == "grpo" else 0)


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
COLUMNS = {"answer": "42", "tests": ["assert f() == 42", "assert f(1) == 43"], "n": -7, "ratio": 0.25, "ok": True,
           "none": None, "meta": {"level": 2, "tags": ["añadir", "加法"], "deep": {"list": [1, [2, {"x": "y"}]]}}}
"""A prompt record's other keys: nested values, unicode and numbers, each to come back as it was."""


def test_prompt_records_in_both_forms_keep_their_other_keys_and_bad_ones_are_skipped_by_reason(tmp_path):
    """TRL's prompt-only records (for GRPO) are prompt rows: a standard prompt's text or a conversational one's
    messages (an agent's turn so far, up to a tool result, included), its tool schemas in tools, and every other key
    as it was in columns ("{}" when none); a record that cannot be a prompt is skipped by reason, never text."""
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]}
    agent = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"}, call,
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    good = [{"prompt": "What is 17 + 25?", **COLUMNS},
            {"prompt": "Say hi."},
            {"prompt": agent, "tools": [WEATHER], "id": 7},
            {"prompt": chat("2+2?", "<think>")}]  # the assistant's text begun: the model continues it (TRL's way)
    deep = "[" * 5000 + "]" * 5000

    def calling(arguments: str, name: str = "weather") -> list[dict]:
        return chat("Q") + [{**call, "tool_calls": [{"function": {"name": name, "arguments": arguments}}]}]

    bad = {"malformed_prompt": {"prompt": 42}, "malformed_message": {"prompt": [{"role": "user"}]},
           "unknown_role": {"prompt": [{"role": "robot", "content": "beep"}]},
           "malformed_tool_call": {"prompt": calling("{}", name="") + [{"role": "tool", "content": "r"}]},
           "bad_tool_arguments": {"prompt": calling("[1]") + [{"role": "tool", "content": "r"}]},
           "empty_prompt": {"prompt": "  ", "answer": "1"},
           "ends_with_tool_call": {"prompt": calling('{"city": "Oslo"}')},
           "orphan_tool_result": {"prompt": chat("Q") + [{"role": "tool", "content": "r"}]},
           "not_alternating": {"prompt": chat("Q") + chat("Q again")},
           "bad_tool_schema": {"prompt": "Q", "tools": [{"function": {"description": "no name"}}]},
           "bad_columns": {"text": "Q", "messages": [], "columns": "[1]"},  # a row of ours, columns no object
           "too_deeply_nested": {"prompt": "Q", "tools": deep}}
    data = tmp_path / "data"
    write(data, "prompts.jsonl", "\n".join(json.dumps(r, ensure_ascii=False) for r in [*good, *bad.values()]) + "\n")
    write(data, "more.yaml", "prompt: In YAML?\nanswer: 3\n---\nprompt: When?\ndate: 2024-01-01\n")  # a date: no JSON
    write(data, "allbad.jsonl", json.dumps({"prompt": []}) + "\n")
    report = build(data, tmp_path / "out", num_proc=1)
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    assert [(r["source"], r["text"], stored(r["messages"]), r["tools"], json.loads(r["columns"])) for r in ds] == [
        ("more.yaml", "In YAML?", [], "", {"answer": 3}),
        ("prompts.jsonl", "What is 17 + 25?", [], "", COLUMNS),
        ("prompts.jsonl", "Say hi.", [], "", {}),
        ("prompts.jsonl", "", agent[:2] + [{"role": "assistant", "content": "", "tool_calls": json.dumps(
            [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}, "id": "c1"}])},
            agent[3]], json.dumps([WEATHER]), {"id": 7}),
        ("prompts.jsonl", "", chat("2+2?", "<think>"), "", {})]
    assert ds["columns"][2] == "{}" and prompt_rows(ds) == 5 == report["rows"]
    assert prompt_rows(datasets.Dataset.from_dict({"text": ["from before columns"], "messages": [[]]})) == 0
    assert report["prompts"]["by_form"] == {"conversational": 2, "standard": 3}
    assert {r: v["where"] for r, v in report["prompts"]["skipped"].items()} == {
        **{reason: [f"prompts.jsonl:line {i}"] for i, reason in enumerate(bad, len(good) + 1)},
        "bad_columns": ["more.yaml:document 2", f"prompts.jsonl:line {len(good) + 11}"],
        "empty_prompt": ["allbad.jsonl:line 1", f"prompts.jsonl:line {len(good) + 6}"]}
    assert report["skipped"] == {"no_valid_prompt": {"count": 1, "paths": ["allbad.jsonl"]}}
    assert not report["conversations"]["rows"] and not report["conversations"]["skipped"]
    summary = format_summary(report)
    assert "\n  prompts: 5 (conversational 2, standard 3)\n" in summary
    assert "\n  skipped 2 prompt records (bad_columns): more.yaml:document 2, prompts.jsonl:line 15\n" in summary


def test_the_bundled_grpo_prompts_build_to_240_arithmetic_prompts_with_2_skipped(tmp_path):
    bundled = ROOT / "examples" / "grpo" / "prompts" / "prompts.jsonl"
    assert bundled.stat().st_size < 30_000
    report = build(bundled.parent, tmp_path / "out", num_proc=1)
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    assert len(ds) == prompt_rows(ds) == report["prompts"]["by_form"]["standard"] == 240
    assert len(set(ds["text"])) == 240
    for text, columns in zip(ds["text"], ds["columns"], strict=True):
        a, op, b = text.removeprefix("What is ").removesuffix("? Answer with the number.").split(" ")
        assert json.loads(columns) == {"answer": str({"+": int.__add__, "-": int.__sub__,
                                                      "*": int.__mul__}[op](int(a), int(b)))}
    assert {r: v["count"] for r, v in report["prompts"]["skipped"].items()} == {"empty_prompt": 1,
                                                                               "ends_with_tool_call": 1}


def test_a_folder_mixing_prompt_records_with_other_kinds_is_refused_in_one_line(tmp_path):
    """GRPO reads prompts alone, and a prompt holds no answer another objective could train: a folder of both is
    refused, saying how many of each and where the fewer kind is."""
    prompts = [{"prompt": "2+2?", "answer": "4"}, {"prompt": chat("3+3?"), "answer": "6"}]
    write(tmp_path / "a", "prompts.jsonl", "\n".join(map(json.dumps, prompts)) + "\n")
    write(tmp_path / "a", "notes.txt", "a document\n")
    write(tmp_path / "a", "pairs.jsonl", "\n".join(json.dumps({"prompt": f"{i}+{i}?", "chosen": str(2 * i),
                                                               "rejected": "0"}) for i in range(1, 4)) + "\n")
    write(tmp_path / "b", "prompts.jsonl", "\n".join(map(json.dumps, prompts * 2)) + "\n")
    write(tmp_path / "b", "chat.jsonl", json.dumps({"messages": chat("Hi", "Hello")}) + "\n")
    fix = ("a run trains on one kind (GRPO on prompts, or SFT or a preference objective); convert them from separate "
           "folders into separate datasets")
    for folder, line in (
            ("a", "mixes 2 prompt records with 3 preference records and 1 text or conversation rows (the prompts are "
                  f"in prompts.jsonl (2 rows)): {fix}"),
            ("b", f"mixes 4 prompt records with 1 text or conversation rows (the others are in chat.jsonl (1 row)): "
                  f"{fix}")):
        with pytest.raises(UserError) as err:
            build(tmp_path / folder, tmp_path / f"{folder}-out", num_proc=1)
        assert str(err.value) == f"{tmp_path / folder} {line}"
        assert not (tmp_path / f"{folder}-out").exists()


def test_pipeline_tiny_trains_its_tokenizer_on_the_text_of_pairs_kto_records_and_prompts(tmp_path):
    """`python -m pipeline.tiny --corpus` on a folder of preference pairs, of KTO records or of prompts (a traceback
    before): the tokenizer is trained on every text those records hold, each field's word learnt whole (a word only
    a rejected answer, an undesirable completion or a prompt's reference answer holds too); a folder whose records
    are all skipped is one line."""
    from transformers import AutoTokenizer

    from pipeline.prep.tiny import corpus_texts, train_tokenizer

    def words(field: str) -> str:
        return " ".join([f"{field}glyph"] * 3)

    def say(role: str, field: str) -> dict:
        return {"role": role, "content": words(field)}

    kinds = {
        "pairs": [{"prompt": words("quokka"), "chosen": words("zebra"), "rejected": words("wombat")},
                  {"prompt": [say("user", "ibex")], "chosen": [say("assistant", "heron")],
                   "rejected": [say("assistant", "marmot")]},
                  {"chosen": [say("user", "okapi"), say("assistant", "tapir")],
                   "rejected": [say("user", "okapi"), say("assistant", "vole")]}],
        "kto": [{"prompt": words("quokka"), "completion": words("kiwi"), "label": True},
                {"prompt": words("quokka"), "completion": words("yak"), "label": False},
                {"prompt": [say("user", "ibex")], "completion": [say("assistant", "lynx")], "label": False}],
        "prompts": [{"prompt": words("quokka"), "answer": words("bison"), "id": 3},
                    {"prompt": [say("system", "dingo"), say("user", "ibex")], "answer": words("gecko")}],
        "skipped": [{"prompt": "x", "completion": "y", "label": "true"}, {"prompt": "x", "chosen": "y",
                                                                            "rejected": "y"}],
    }
    learnt = {"pairs": ("quokka", "zebra", "wombat", "ibex", "heron", "marmot", "okapi", "tapir", "vole"),
              "kto": ("quokka", "kiwi", "yak", "ibex", "lynx"),
              "prompts": ("quokka", "bison", "ibex", "dingo", "gecko")}

    def whole(tokenizer, fields: tuple[str, ...]) -> dict[str, list[str]]:
        return {field: tokenizer.tokenize(f" {field}glyph") for field in fields}

    for kind, records in kinds.items():
        write(tmp_path / kind, "records.jsonl", "\n".join(json.dumps(r) for r in records * 20) + "\n")
        write(tmp_path / "all", f"{kind}.jsonl", "\n".join(json.dumps(r) for r in records * 20) + "\n")
    for kind, fields in learnt.items():
        tokenizer = train_tokenizer(corpus_texts(tmp_path / kind), 1024)
        assert whole(tokenizer, fields) == {field: [f"\u0120{field}glyph"] for field in fields}, kind
    with pytest.raises(UserError) as err:
        corpus_texts(tmp_path / "skipped")
    assert str(err.value) == f"--corpus {tmp_path / 'skipped'} holds no usable text to train a tokenizer on"
    # the command itself, on a folder of the three kinds (and records it skips)
    out = tmp_path / "model"
    proc = subprocess.run([sys.executable, "-m", "pipeline.tiny", "--out", str(out), "--corpus", str(tmp_path / "all")],
                          cwd=ROOT, env=with_root(), capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0, f"tiny Llama (tied, 2 layers, hidden 64, random weights) written to {out}\n", ""), proc.stderr[-3000:]
    fields = tuple(dict.fromkeys(f for fs in learnt.values() for f in fs))
    assert whole(AutoTokenizer.from_pretrained(out), fields) == {field: [f"\u0120{field}glyph"] for field in fields}
