import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import hub_env, preflight_errors, run_python, run_script
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pipeline.prep.hub import verify
from pipeline.prep.tiny import build_tiny

RESOLVE = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
name = sys.argv[1]
cfg = AutoConfig.from_pretrained(name)
tok = AutoTokenizer.from_pretrained(name)
model = AutoModelForCausalLM.from_pretrained(name)
ids = tok("The gardener measured the wet soil.", return_tensors="pt").input_ids
print(json.dumps({"tied": model.lm_head.weight is model.model.embed_tokens.weight,
                  "cfg_tied": cfg.tie_word_embeddings, "bos": ids[0, 0].item() == tok.bos_token_id,
                  "logits": model(ids).logits[0, -1, :5].tolist()}))
"""


def import_model(source: Path, name: str, hf_home: Path) -> subprocess.CompletedProcess:
    return run_script("MODEL_DOWNLOAD.py", "--model-name", name, "--source", source, env=hub_env(hf_home))


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_import_then_resolve_offline_by_hub_id(tmp_path, tiny_models, kind):
    proc = import_model(tiny_models[kind], f"local/tiny-{kind}", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "parameters:  " in proc.stdout and "LlamaForCausalLM" in proc.stdout
    out = run_python(["-c", RESOLVE, f"local/tiny-{kind}"], hub_env(tmp_path / "hf"), offline=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["tied"] is got["cfg_tied"] is (kind == "tied")
    assert got["bos"]
    ref = AutoModelForCausalLM.from_pretrained(tiny_models[kind])
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_models[kind])("The gardener measured the wet soil.",
                                                           return_tensors="pt").input_ids
    assert got["logits"] == ref(ids).logits[0, -1, :5].tolist()


def test_reimport_is_idempotent_and_skips_duplicate_formats(tmp_path, tiny_models):
    src = aged_copy(tiny_models["tied"], tmp_path / "src")  # the record of its check is then final at once
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"pth")
    (src / "pytorch_model.bin").write_bytes(b"bin")
    # what other tokenizers load besides tokenizer.json: all kept, as a tokenizer may need any of them
    for name in ("vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json", "chat_template.json",
                 "tokenizer.model"):
        (src / name).write_text("{}")
    first = import_model(src, "local/tiny", tmp_path / "hf")
    assert first.returncode == 0, first.stderr
    assert "left out (not needed for training): original/consolidated.00.pth, pytorch_model.bin" in first.stdout
    assert "chat template: chat_template.jinja, chat_template.json" in first.stdout
    repo = tmp_path / "hf" / "hub" / "models--local--tiny"
    before = {p.relative_to(repo).as_posix(): p.lstat().st_mtime_ns for p in repo.rglob("*")}
    (snapshot,) = (repo / "snapshots").iterdir()
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "added_tokens.json", "chat_template.jinja", "chat_template.json", "config.json", "generation_config.json",
        "merges.txt", "model.safetensors", "special_tokens_map.json", "tokenizer.json", "tokenizer.model",
        "tokenizer_config.json", "vocab.json"]
    again = import_model(src, "local/tiny", tmp_path / "hf")
    assert again.returncode == 0, again.stderr
    assert {p.relative_to(repo).as_posix(): p.lstat().st_mtime_ns for p in repo.rglob("*")} == before
    assert (repo / "refs" / "main").read_text() == snapshot.name


def corrupt_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
         "error: tensor model.layers.1.mlp.up_proj.weight is missing from the weights in {src}\n"),
        (lambda t: t.__setitem__("model.norm.weight", torch.ones(65)),
         "error: tensor model.norm.weight has shape [65] in the weights but the config implies [64]\n"),
        (lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.float16)),
         "error: tensor model.norm.weight is float16 in the weights but the config says float32\n"),
    ],
)
def test_broken_models_are_refused_and_not_imported(tmp_path, tiny_models, edit, message):
    src = corrupt_copy(tiny_models["untied"], tmp_path / "src", edit)
    proc = import_model(src, "local/broken", tmp_path / "hf")
    assert (proc.returncode, proc.stderr) == (2, message.format(src=src))
    assert not (tmp_path / "hf" / "hub" / "models--local--broken").exists()


def test_index_naming_a_missing_shard_is_refused(tmp_path):
    src = build_tiny(tmp_path / "src", tied=False, hidden=64)
    model = AutoModelForCausalLM.from_pretrained(src)
    for f in src.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(src, max_shard_size="200KB")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1 and (src / "model.safetensors.index.json").exists()
    assert verify(src).num_params == sum(p.numel() for p in model.parameters())
    shards[-1].unlink()
    proc = import_model(src, "local/sharded", tmp_path / "hf")
    assert proc.returncode == 2
    assert proc.stderr == (f"error: shard {shards[-1].name} is named in model.safetensors.index.json but missing "
                           f"from {src}\n")


def test_truncated_weights_are_named(tmp_path, tiny_models):
    src = tmp_path / "src"
    shutil.copytree(tiny_models["tied"], src)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    proc = import_model(src, "local/cut", tmp_path / "hf")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: weight file {src / 'model.safetensors'} is truncated or corrupt (")


def test_snapshot_download_offline_uses_the_cache_and_explains_a_miss(tmp_path, tiny_models):
    assert import_model(tiny_models["tied"], "local/tiny", tmp_path / "hf").returncode == 0
    hit = run_script("MODEL_DOWNLOAD.py", "--model-name", "local/tiny", env=hub_env(tmp_path / "hf"))
    assert hit.returncode == 0, hit.stderr
    assert "parameters:  154,944 (float32)" in hit.stdout
    miss = run_script("MODEL_DOWNLOAD.py", "--model-name", "local/absent", env=hub_env(tmp_path / "hf"))
    assert (miss.returncode, miss.stderr) == (2, (
        f"error: local/absent (revision main) is not in the cache at {tmp_path / 'hf' / 'hub'} and the hub cannot "
        "be reached; on an air-gapped machine import a copy: python MODEL_DOWNLOAD.py --model-name local/absent "
        "--source DIR\n"))


@pytest.fixture(scope="module")
def cli_hf_home(tmp_path_factory) -> Path:
    """One HF_HOME for the refusals, which never reach the cache: their runs share one warm launcher."""
    return tmp_path_factory.mktemp("cli-hf")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model-name", "not a/valid id!"], "error: --model-name 'not a/valid id!' is not a hub id like org/name\n"),
        (["--model-name", "a/b", "--source", "{t}/nope"], "error: --source {t}/nope does not exist or is not a "
         "directory\n"),
        (["--model-name", "a/b", "--source", "{t}"], "error: --source {t} is not a model directory: it needs "
         "config.json and *.safetensors weights (as saved by save_pretrained or downloaded from the hub)\n"),
    ],
)
def test_cli_errors(tmp_path, args, message, cli_hf_home):
    (tmp_path / "notes.txt").write_text("not a model")
    proc = run_script("MODEL_DOWNLOAD.py", *(a.format(t=tmp_path) for a in args), env=hub_env(cli_hf_home))
    assert (proc.returncode, proc.stderr) == (2, message.format(t=tmp_path))


def test_tiny_model_is_deterministic(tmp_path, tiny_models):
    again = build_tiny(tmp_path / "again", tied=True)
    for f in sorted(p.name for p in tiny_models["tied"].iterdir()):
        assert (again / f).read_bytes() == (tiny_models["tied"] / f).read_bytes(), f


def test_not_enough_disk_is_refused_with_the_numbers(tmp_path):
    from pipeline.errors import UserError
    from pipeline.prep.hub import check_disk

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(UserError) as err:
        check_disk(tmp_path, free + 2**40)
    assert str(err.value) == (f"not enough disk space in {tmp_path}: the model needs {(free + 2**40) / 2**30:.2f} "
                              f"GiB more, {free / 2**30:.2f} GiB free; free some space or pass --cache-dir on a "
                              "larger disk")


def aged_copy(src: Path, dst: Path) -> Path:
    """A copy of a model whose files were last written a day ago (as a real download is, long before its check)."""
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        os.utime(f, (f.stat().st_atime - 86400, f.stat().st_mtime - 86400))
    return dst


def flip(path: Path, at: int, n: int = 64) -> None:
    """n bytes inverted in place, size unchanged (what a bad disk or a bad copy does)."""
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def test_damaged_blob_is_refused_by_training_and_repaired_by_import(tmp_path, tiny_models, train_env):
    src = aged_copy(tiny_models["tied"], tmp_path / "src")
    hf = tmp_path / "hf"
    first = import_model(src, "local/tiny", hf)
    assert first.returncode == 0, first.stderr
    assert "checked 1 of 1 weight files by content" in first.stdout
    (snapshot,) = (hf / "hub" / "models--local--tiny" / "snapshots").iterdir()
    blob = (snapshot / "model.safetensors").resolve()
    flip(blob, blob.stat().st_size - 200)
    found = hashlib.sha256(blob.read_bytes()).hexdigest()
    argv = ["-e", "r", "--save-dir", tmp_path / "out", "-d", train_env["dataset"], "-m", "local/tiny"]
    assert preflight_errors([argv], hub_env(hf)) == [
        f"weight file {snapshot / 'model.safetensors'} is damaged: its SHA-256 is {found[:16]}..., the hub's is "
        f"{blob.name[:16]}...; repair it with python MODEL_DOWNLOAD.py --model-name local/tiny (add --source DIR to "
        "import it again from a copy)"]
    again = import_model(src, "local/tiny", hf)
    assert again.returncode == 0, again.stderr
    assert "repaired 1 damaged weight file(s): removed and imported again" in again.stdout
    assert blob.read_bytes() == (src / "model.safetensors").read_bytes()
    assert preflight_errors([argv], hub_env(hf)) == ["ok"]


def test_verify_rereads_blobs_whose_stamp_is_unchanged(tmp_path, tiny_models):
    src = aged_copy(tiny_models["tied"], tmp_path / "src")
    hf = tmp_path / "hf"
    assert import_model(src, "local/tiny", hf).returncode == 0
    (snapshot,) = (hf / "hub" / "models--local--tiny" / "snapshots").iterdir()
    blob = (snapshot / "model.safetensors").resolve()
    st = blob.stat()
    flip(blob, st.st_size - 200)
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot: size and time as they were
    plain = run_script("MODEL_DOWNLOAD.py", "--model-name", "local/tiny", env=hub_env(hf))
    assert plain.returncode == 0 and "checked 0 of 1 weight files by content" in plain.stdout
    offline = run_script("MODEL_DOWNLOAD.py", "--model-name", "local/tiny", "--verify", env=hub_env(hf))
    assert offline.returncode == 2
    assert offline.stderr.startswith(f"error: weight file {snapshot / 'model.safetensors'} is damaged: its SHA-256 is ")
    fix = ("; it is not in the cache now, and the hub cannot be reached to fetch it: import a copy with python "
           "MODEL_DOWNLOAD.py --model-name local/tiny --source DIR\n")
    assert offline.stderr.endswith(fix)
    gone = run_script("MODEL_DOWNLOAD.py", "--model-name", "local/tiny", env=hub_env(hf))  # the same, offline again
    assert (gone.returncode, gone.stderr) == (2, f"error: weight file {snapshot / 'model.safetensors'} is missing "
                                                 f"(its blob {blob.name[:16]}... is not in the cache){fix}")
    repaired = run_script("MODEL_DOWNLOAD.py", "--model-name", "local/tiny", "--source", src, "--verify",
                          env=hub_env(hf))
    assert repaired.returncode == 0, repaired.stderr
    assert blob.read_bytes() == (src / "model.safetensors").read_bytes()


def test_model_folder_changes_are_refused_until_accepted(tmp_path, tiny_models, train_env):
    folder = aged_copy(tiny_models["tied"], tmp_path / "model")
    argv = ["-e", "r", "--save-dir", tmp_path / "out", "-d", train_env["dataset"], "-m", folder]
    assert preflight_errors([argv], train_env["env"]) == ["ok"]  # the first check records the folder's hashes
    before = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    flip(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size - 200)
    after = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert preflight_errors([argv, argv], train_env["env"]) == [
        f"weight file {folder / 'model.safetensors'} changed since it was checked (SHA-256 {before[:16]}... then, "
        f"{after[:16]}... now); restore it, or if you changed it on purpose accept it with python MODEL_DOWNLOAD.py "
        f"--model-name {folder}"] * 2  # refused again: a refusal records nothing
    accept = run_script("MODEL_DOWNLOAD.py", "--model-name", folder, env=train_env["env"])
    assert accept.returncode == 0, accept.stderr
    assert f"{folder / 'model.safetensors'} changed since its last check: its new content is now the reference" \
        in accept.stdout
    assert preflight_errors([argv], train_env["env"]) == ["ok"]
