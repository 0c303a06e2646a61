"""The token cache: streamed in chunks to the same bytes as the whole corpus cut in memory, resumable after a kill,
and waited for without a collective (so a build longer than the collective timeout does not kill the run)."""

import contextlib
import io
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, kill_tree, run_python, run_script, start_python, start_torchrun, wait_for, with_root
from transformers import AutoTokenizer

from pipeline.data import packing, text_tokens, token_cache
from pipeline.data.dataset import BlockSpec, load_text_dataset


def reference(dataset, model, spec: BlockSpec) -> dict[str, bytes]:
    """What the cache must hold, computed the plain way: every row's ids (a special token's text kept as text unless
    allowed) and EOS concatenated in memory, cut, split, np.save'd whole."""
    tok = AutoTokenizer.from_pretrained(model)
    texts = (load_text_dataset(str(dataset)) if isinstance(dataset, Path) else dataset)["text"]
    rows = [tok(t, add_special_tokens=False, split_special_tokens=not spec.special_tokens_in_data)["input_ids"]
            + [tok.eos_token_id] for t in texts]
    ids = np.concatenate([np.asarray(r, np.uint32) for r in rows])
    n = len(ids) // spec.seq_length
    blocks = ids[: n * spec.seq_length].reshape(n, spec.seq_length)
    train, val = token_cache.split_blocks(n, spec.val_fraction, spec.seed)
    arrays = {"train.npy": blocks[train], "val.npy": blocks[val]}
    if spec.flagged:
        flags = packing.text_flags(blocks, tok.eos_token_id, spec.document_mask)
        arrays.update({"train_flags.npy": flags[train], "val_flags.npy": flags[val]})
    out = {}
    for name, array in arrays.items():
        buf = io.BytesIO()
        np.save(buf, array)
        out[name] = buf.getvalue()
    return out


@pytest.mark.parametrize("document_mask", [False, True])
def test_chunked_build_writes_the_bytes_of_the_whole_corpus_cut_in_memory(tmp_path, train_env, tiny_models,
                                                                          monkeypatch, document_mask):
    monkeypatch.setattr(token_cache, "CHUNK_BYTES", 3000)  # many chunks, most ending inside a block
    monkeypatch.setattr(token_cache, "COPY_BLOCKS", 3)
    monkeypatch.setattr(text_tokens, "TOKENIZE_CHARS", 400)  # rows longer than this are tokenized in pieces
    monkeypatch.setattr(text_tokens, "CHECK_CHARS", 64)
    spec = BlockSpec(64, 0.1, 3, document_mask=document_mask)
    ds = load_text_dataset(str(train_env["dataset"]))
    tok = AutoTokenizer.from_pretrained(tiny_models["tied"])
    out = tmp_path / "cache"
    token_cache.build_blocks(ds, tok, spec, 1, out)
    expected = reference(train_env["dataset"], tiny_models["tied"], spec)
    assert sorted(f.name for f in out.iterdir()) == sorted([*expected, "meta.json"])
    assert {name: (out / name).read_bytes() for name in expected} == expected
    assert not out.with_name("cache.partial").exists()


@pytest.mark.parametrize("allowed", [False, True])
def test_a_special_token_text_in_a_row_stays_text_unless_allowed(tmp_path, tiny_models, allowed):
    import datasets

    row = "first part <|end_of_text|> second part"
    ds = datasets.Dataset.from_dict({"text": [row] * 20})
    spec = BlockSpec(8, 0.0, 0, special_tokens_in_data=allowed)
    tok = AutoTokenizer.from_pretrained(tiny_models["tied"])
    token_cache.build_blocks(ds, tok, spec, 1, tmp_path / "cache")
    expected = reference(ds, tiny_models["tied"], spec)
    assert {name: (tmp_path / "cache" / name).read_bytes() for name in expected} == expected
    ids = np.load(tmp_path / "cache" / "train.npy").ravel()
    ends = np.flatnonzero(ids == tok.eos_token_id)
    per_row = len(tok(row, add_special_tokens=False, split_special_tokens=not allowed)["input_ids"]) + 1
    if allowed:  # the text in each row is an EOS too
        assert len(ends) > len(ids) // per_row
    else:  # the only EOS is each row's own
        assert len(ends) == len(ids) // per_row and ((ends + 1) % per_row == 0).all()


def llama3_style(tok):
    """tok's vocabulary behind Llama 3's pre-tokenizer (its split pattern, then byte-level without a regex)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tok.eos_token)


def metaspace_style(tok):
    """tok's vocabulary behind SentencePiece's pre-tokenizer (spaces become word markers, one before the input)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tok.eos_token)


def prefixed(tok):
    """tok with a space put before every input, as Llama 2's normalizer puts its word marker: a piece would gain one
    that the whole row does not have, so no cut may be kept."""
    from tokenizers import Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Prepend(" ")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tok.eos_token)


@pytest.mark.parametrize("style", ["gpt2", "llama3", "metaspace", "prefixed"])
def test_long_rows_are_tokenized_in_pieces_to_the_ids_of_the_whole_row(tiny_models, monkeypatch, style):
    """A row of the repository's own sources and docs (code, prose, numbers, punctuation before line ends, runs of
    spaces and blank lines) tokenized in pieces of at most 2,000 characters gives exactly the whole row's ids, with
    each pre-tokenizer family; a tokenizer that prefixes every input is never cut."""
    monkeypatch.setattr(text_tokens, "TOKENIZE_CHARS", 2000)
    monkeypatch.setattr(text_tokens, "CHECK_CHARS", 256)
    styles = {"gpt2": lambda t: t, "llama3": llama3_style, "metaspace": metaspace_style, "prefixed": prefixed}
    tok = styles[style](AutoTokenizer.from_pretrained(tiny_models["tied"]))
    sources = [ROOT / "README.md", *sorted((ROOT / "pipeline").glob("*.py"))]
    text = "".join(p.read_text(encoding="utf-8") for p in sources)
    rows = [text, "short row", text[: len(text) // 3]]
    pieces = [piece for row in rows for piece in text_tokens._pieces(row, tok, True)]
    assert "".join(p for p, _ in pieces) == "".join(rows) and [p for p, last in pieces if last][1] == "short row"
    if style == "prefixed":
        assert pieces == [(row, True) for row in rows]
    elif style != "metaspace":  # SentencePiece's marker keeps the cuts before a space only, which is fine
        assert len(pieces) > len(text) // 2000 and max(len(p) for p, _ in pieces) <= 2000
    got = text_tokens.tokenize_rows({"text": rows}, tok, tok.eos_token_id, split_special=True)["input_ids"][0]
    whole = [i for row in rows
             for i in [*tok(row, add_special_tokens=False, split_special_tokens=True)["input_ids"], tok.eos_token_id]]
    assert got.tolist() == whole


def test_a_row_without_whitespace_is_tokenized_in_bounded_pieces(tiny_models, monkeypatch, caplog):
    """A base64 blob is cut where its characters change class, to the whole row's ids; a run of one letter (one
    pre-token: no cut keeps the ids) is cut hard at MAX_PIECE_CHARS, and the log says so: no row, however long, costs
    the tokenizer more than a piece (8 M characters in one piece took 1.9 GB, BENCHMARKS.md section 19)."""
    import base64
    import random

    monkeypatch.setattr(text_tokens, "TOKENIZE_CHARS", 2000)
    monkeypatch.setattr(text_tokens, "CHECK_CHARS", 256)
    monkeypatch.setattr(text_tokens, "MAX_PIECE_CHARS", 8000)
    tok = AutoTokenizer.from_pretrained(tiny_models["tied"])
    blob = base64.b64encode(random.Random(0).randbytes(30_000)).decode()
    pieces = text_tokens._pieces(blob, tok, True)
    assert "".join(p for p, _ in pieces) == blob and max(len(p) for p, _ in pieces) <= 2000
    got = text_tokens.tokenize_rows({"text": [blob]}, tok, tok.eos_token_id, split_special=True)["input_ids"][0]
    assert got.tolist() == tok(blob, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    run = "a" * 20_000
    assert [len(p) for p, _ in text_tokens._pieces(run, tok, True)] == [8000, 8000, 4000]
    assert ("a row of 20000 characters has no place where a cut keeps its ids: tokenized in pieces of at most 8000 "
            "characters, cut 2 times") in caplog.text


def test_a_cache_folder_deleted_during_its_build_is_one_line(tmp_path, train_env):
    """`rm -rf` of the cache folder while --prepare-only builds it: the build's next write says so and how to go on."""
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    (tmp_path / "text").mkdir()
    words = [f"w{i}x" for i in range(3000)]
    for k in range(8):
        (tmp_path / "text" / f"{k}.txt").write_text(" ".join(words[(i * 7 + k) % 3000] for i in range(150_000)))
    build_dataset(CorpusConfig(tmp_path / "text", tmp_path / "ds", num_proc=1))
    cache = tmp_path / "cache"
    cmd = [str(ROOT / "fsdp1.py"), "-e", "p", "-d", str(tmp_path / "ds"), "-m", "local/tiny",
           "--save-dir", str(tmp_path / "runs"), "--cache-dir", str(cache), "--prepare-only", "--num-proc", "1"]
    proc = start_python(cmd, with_root(train_env["env"]), offline=True)
    wait_for(lambda: any(cache.glob("*.partial")), proc)
    cache.rename(tmp_path / "gone")  # the folder is gone from where the build writes, at once (rm -rf races it)
    shutil.rmtree(tmp_path / "gone", ignore_errors=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    line = err.splitlines()[-1]
    assert line.startswith(f"error: {cache}/") and line.endswith(
        f" was being built (was the folder {cache} deleted?); rerun the same command to build it again"), line
    assert "Traceback" not in err
    assert run_script(*cmd, env=train_env["env"]).returncode == 0


def test_a_killed_build_resumes_from_its_finished_chunks(tmp_path, train_env, tiny_models):
    out = tmp_path / "cache"
    cmd = [str(ROOT / "tests" / "helpers" / "build_cache.py"), str(train_env["dataset"]), str(tiny_models["tied"]),
           str(out), "20000"]  # 20 KB chunks: a few rows each
    env = with_root()
    proc = start_python(cmd, env, offline=False, stderr=subprocess.STDOUT)
    first = out.with_name("cache.partial") / "chunk-00001.npy"
    wait_for(first.exists, proc)
    kill_tree(proc)
    chunks = sorted(out.with_name("cache.partial").glob("chunk-?????.npy"))
    assert not out.exists() and 2 <= len(chunks) < len(load_text_dataset(str(train_env["dataset"])))

    again = run_python(cmd, env, offline=False, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming, {len(chunks)} of " in again.stderr  # those chunks were read back, not tokenized again
    expected = reference(train_env["dataset"], tiny_models["tied"], BlockSpec(64, 0.1, 0))
    assert {name: (out / name).read_bytes() for name in expected} == expected
    assert not out.with_name("cache.partial").exists()


def test_a_stop_signal_ends_the_build_before_its_next_chunk_and_the_rerun_resumes(tmp_path, train_env):
    """SIGTERM while a run's builder tokenizes (20 KB chunks: dozens): it stops before its next chunk, in one line
    saying how many are done and kept, exit 143, instead of building on past a scheduler's grace period; the same
    command then resumes from those chunks."""
    import signal

    args = [str(ROOT / "tests" / "helpers" / "build_run_cache.py"), "20000", "-e", "r", "-d",
            str(train_env["dataset"]), "-m", "local/tiny", "--save-dir", str(tmp_path), "--seq-length", "64"]
    env = with_root(train_env["env"])
    proc = start_python(args, env, offline=True, stderr=subprocess.STDOUT)
    partial = tmp_path / "token_cache"
    wait_for(lambda: any(partial.glob("*.partial/chunk-00001.npy")), proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    (work,) = partial.glob("*.partial")
    kept = sorted(work.glob("chunk-?????.npy"))
    assert f"stopped by signal after {len(kept)} of " in output and "chunks (kept in " in output, output[-3000:]
    assert output.rstrip().endswith("rerun the same command to resume") and "Traceback" not in output
    total = int(output.split(f"after {len(kept)} of ")[1].split()[0])
    assert 2 <= len(kept) < total and not any(partial.glob("*/meta.json"))
    again = run_python(args, env, offline=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming, {len(kept)} of {total} chunks already tokenized" in again.stdout + again.stderr
    assert len(list(partial.glob("*/meta.json"))) == 1


def lock_args(train_env: dict, tmp_path: Path) -> list[str]:
    """A short fsdp1.py run on the demo corpus, for the tests that hold its cache's build lock."""
    return ["-e", "r", "-d", str(train_env["dataset"]), "-m", "local/tiny", "--save-dir", str(tmp_path),
            "--seq-length", "64", "--max-steps", "2", "--ckpt-freq", "0", "--eval-freq", "0"]


@contextlib.contextmanager
def lock_held(args: list[str], env: dict) -> Iterator[subprocess.Popen]:
    """The token cache build lock of fsdp1.py's args held by another process (as a --prepare-only job on the node
    would) until a line reaches its stdin or the block ends."""
    holder = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "hold_cache_lock.py"), *args],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().startswith("locked ")
        yield holder
    finally:
        kill_tree(holder)


def test_a_stop_signal_ends_the_wait_for_another_processs_build(tmp_path, train_env):
    """Both ranks wait for a build another process holds the lock of (rank 0 for the lock, rank 1 for the cache):
    SIGTERM ends the wait on each at its next poll, with the stop line and no traceback, while the lock is still
    held, instead of waiting for a build that may outlast a scheduler's grace period."""
    import os
    import signal

    args, env = lock_args(train_env, tmp_path), with_root(train_env["env"])
    log = tmp_path / "r" / "train.log"
    with lock_held(args, env) as holder, open(tmp_path / "out.log", "w") as out:
        run = start_torchrun(2, ROOT / "fsdp1.py", *args, env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: log.exists() and "another process is building the token cache" in log.read_text(), run)
        os.kill(run.pid, signal.SIGTERM)  # the launcher forwards it to the workers
        run.wait(timeout=60)
        assert holder.poll() is None  # the build it waited for never finished
    logged = log.read_text()  # each rank's own line: neither was killed by the launcher's grace period
    assert "[rank=0] WARNING stopped by signal while waiting for another process's build of the token cache " in \
        logged, logged[-3000:]
    assert "[rank=1] INFO stopped by signal while waiting for the token cache " in logged, logged[-3000:]
    assert "Traceback" not in logged and not list((tmp_path / "token_cache").glob("*/meta.json"))


def test_ranks_wait_out_a_build_longer_than_the_collective_timeout(tmp_path, train_env):
    """The cache's lock is held (as a --prepare-only job on the node would) for three collective timeouts: rank 0
    waits on the lock and rank 1 polls for the cache, neither inside a collective, and the run then trains."""
    args, env = lock_args(train_env, tmp_path), with_root(train_env["env"])
    with lock_held(args, env) as holder:
        run = start_torchrun(2, ROOT / "fsdp1.py", *args, "--collective-timeout-s", "4", env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        log = tmp_path / "r" / "train.log"
        wait_for(lambda: log.exists() and "another process is building the token cache" in log.read_text(), run)
        with pytest.raises(subprocess.TimeoutExpired):
            run.wait(timeout=12)  # three collective timeouts with both ranks waiting
        holder.stdin.write("release\n")
        holder.stdin.flush()
        output, _ = run.communicate(timeout=300)
    assert run.returncode == 0, output[-3000:]
    assert "building token cache" in output and "token cache built" in output


def test_a_full_disk_during_the_block_write_is_one_line_and_the_rerun_finishes(tmp_path, train_env, small_disk):
    """The blocks are written through memory maps: a full disk there was a SIGBUS (exit 135, nothing printed)."""
    from conftest import tree_digest

    def prepare(cache: Path) -> subprocess.CompletedProcess:
        return run_script("fsdp1.py", "-e", "c", "-d", train_env["chats"], "-m", "local/tiny", "--save-dir",
                          tmp_path / "runs", "--seq-length", "512", "--prepare-only", "--cache-dir", cache,
                          env=train_env["env"])

    small_disk.resize(256 * 2**10)  # room for the tokenized conversations, not for their blocks as well
    full = prepare(small_disk.path)
    assert full.returncode == 2, full.stderr[-2000:]
    (partial,) = small_disk.path.glob("*.partial")
    line = full.stderr.splitlines()[-1]
    assert line.startswith(f"error: cannot write {partial}/blocks/train.npy: no space left on device (its file "
                           "system has "), line
    assert line.endswith("free now); fix it or choose another output folder, then rerun the same command (what is "
                         "finished is kept)")
    assert "Traceback" not in full.stderr
    small_disk.resize(2**20)
    assert prepare(small_disk.path).returncode == 0
    assert prepare(tmp_path / "reference").returncode == 0
    (built,) = (p for p in small_disk.path.iterdir() if p.is_dir())
    assert tree_digest(built) == tree_digest(tmp_path / "reference" / built.name)
