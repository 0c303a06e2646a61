"""Every folder a stage writes is its own kind: no stage writes into or replaces a folder of another kind or of the
user's, and no output sits inside an input (pipeline/ownership.py). Real run folders and datasets, real refusals."""

import shutil
from pathlib import Path

import pytest
from conftest import ROOT, preflight_errors, run_script, tree_digest

from pipeline.errors import UserError
from pipeline.ownership import OWNER_FILE, kind_of
from pipeline.prep.corpus import CorpusConfig, build_dataset
from pipeline.train.export import check_replaceable


@pytest.fixture(scope="module")
def run_folder(train_env, tmp_path_factory) -> Path:
    """A real run folder: two steps of the tiny model on the demo text."""
    root = tmp_path_factory.mktemp("owned")
    proc = run_script("fsdp1.py", "-e", "r", "-d", train_env["dataset"], "-m", "local/tiny", "--save-dir",
                      root / "runs", "--config", ROOT / "configs" / "demo.yaml", "--max-steps", 2,
                      env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "runs" / "r"


def test_each_stage_marks_its_folders(train_env, run_folder):
    kinds = {run_folder: "run", run_folder / "hf": "export", run_folder.parent / "token_cache": "token_cache",
             train_env["dataset"]: "dataset"}
    assert {folder: kind_of(folder) for folder in kinds} == kinds
    assert all((folder / OWNER_FILE).is_file() for folder in kinds)


def test_data_hf_never_replaces_a_run_nor_writes_inside_one(run_folder, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("text\n")
    before = tree_digest(run_folder)
    with pytest.raises(UserError, match=f"^--save_dir {run_folder} is a training run, not a dataset; refusing to "
                                        "write into it: choose a new --save_dir$"):
        build_dataset(CorpusConfig(tmp_path / "data", run_folder, num_proc=1, overwrite=True))
    with pytest.raises(UserError, match=f"^--save_dir {run_folder / 'ds'} is inside {run_folder}, a training run; "
                                        "put it in a folder of its own$"):
        build_dataset(CorpusConfig(tmp_path / "data", run_folder / "ds", num_proc=1))
    assert tree_digest(run_folder) == before


def test_data_hf_replaces_a_dataset_only_when_nothing_else_is_in_it(train_env, tmp_path):
    """A run a user put inside a dataset (allowed before folders were marked) is not deleted with it."""
    shutil.copytree(train_env["dataset"], tmp_path / "ds")
    (tmp_path / "ds" / "inside").mkdir()
    (tmp_path / "ds" / "inside" / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("text\n")
    with pytest.raises(UserError, match=r"^--save_dir .*/ds holds what DATA-HF.py does not write \(inside/\); "
                                        "refusing to replace it: move those out first, or choose a new --save_dir$"):
        build_dataset(CorpusConfig(tmp_path / "data", tmp_path / "ds", num_proc=1, overwrite=True))
    assert (tmp_path / "ds" / "inside" / "notes.txt").read_text() == "mine"
    with pytest.raises(UserError, match=r"--data_folder .*/ds/inside is inside --save_dir .*/ds; writing the output "
                                        "would overwrite it: move it out first$"):
        build_dataset(CorpusConfig(tmp_path / "ds" / "inside", tmp_path / "ds", num_proc=1, overwrite=True))


def test_fsdp1_takes_no_folder_it_did_not_create_and_no_output_sits_in_an_input(train_env, run_folder, tmp_path):
    ds, env = tmp_path / "ds", train_env["env"]
    shutil.copytree(train_env["dataset"], ds)
    (tmp_path / "S" / "myproj").mkdir(parents=True)
    (tmp_path / "S" / "myproj" / "config.yaml").write_text("mine\n")
    (tmp_path / "nul.yaml").write_text('experiment_name: "a\\0b"\n')
    (tmp_path / "mapping.yaml").write_text("save_dir: {a: 1}\n")
    (tmp_path / "targets.yaml").write_text("adapter: lora\nlora_targets: [q_proj, v_proj]\n")
    hf = run_folder / "hf"
    base = ["-m", "local/tiny", "--max-steps", 1]
    cases = {
        ("-e", "myproj", "--save-dir", tmp_path / "S", "-d", ds):
            f"the run folder {tmp_path / 'S' / 'myproj'} holds files fsdp1.py did not write (config.yaml); refusing "
            "to write into it: give this run another --experiment-name or --save-dir",
        ("-e", "ds", "--save-dir", tmp_path, "-d", ds):
            f"the run folder {ds} is a dataset, not a training run; refusing to write into it: give this run another "
            "--experiment-name or --save-dir",
        ("-e", "inside", "--save-dir", ds, "-d", ds):
            f"the run folder {ds / 'inside'} is inside {ds}, a dataset; put it in a folder of its own",
        ("-e", "r", "--save-dir", run_folder.parent, "-d", ds, "-m", hf):
            f"the model folder {hf} is inside the run folder {run_folder}; writing the output would overwrite it: "
            "move it out first",
        ("-e", "x", "--save-dir", tmp_path / "runs", "-d", ds, "--cache-dir", ds / "cache"):
            f"--cache-dir {ds / 'cache'} is inside {ds}, a dataset; put it in a folder of its own",
        ("-e", "x", "--save-dir", tmp_path / "runs", "-d", ds, "--cache-dir", hf):
            f"--cache-dir {hf} is a model or adapter folder, not a token cache; refusing to write into it: pass "
            "--cache-dir with a folder of its own",
        ("-e", "x" * 300, "-d", ds): "--experiment-name is 300 bytes long; a folder name may have at most 200",
        ("-e", "x", "-d", ds, "--seed", -1): "--seed must be in [0, 4294967295], got -1",
        ("-e", "x", "-d", ds, "--seed", 2**64): "--seed must be in [0, 4294967295], got 18446744073709551616",
        ("-d", ds, "--config", tmp_path / "nul.yaml"): "--experiment-name must not contain a NUL character, got "
                                                       "'a\\x00b'",
        ("-e", "x", "-d", ds, "--config", tmp_path / "mapping.yaml"): "--save-dir must be a single value, got a "
                                                                      "mapping ({'a': 1})",
        ("-e", "x", "--save-dir", tmp_path / "runs", "-d", ds, "--config", tmp_path / "targets.yaml"): "ok",
    }
    got = preflight_errors([[*base, *argv] for argv in cases], env)
    assert dict(zip(cases.values(), got, strict=True)) == {want: want for want in cases.values()}
    assert (tmp_path / "S" / "myproj" / "config.yaml").read_text() == "mine\n"
    # the same refusal from the command, in one line, with nothing written
    before = tree_digest(tmp_path / "S")
    proc = run_script("fsdp1.py", "-e", "myproj", "--save-dir", tmp_path / "S", "-d", ds, *base, env=env)
    assert (proc.returncode, proc.stderr) == (2, f"error: {next(iter(cases.values()))}\n")
    assert tree_digest(tmp_path / "S") == before


def test_an_export_replaces_only_an_export(train_env, run_folder):
    check_replaceable(run_folder / "hf", "--out")  # a previous export: fine
    with pytest.raises(UserError, match=f"^--out {run_folder} is a training run; refusing to replace it: choose a "
                                        "new folder$"):
        check_replaceable(run_folder, "--out")
    with pytest.raises(UserError, match=f"^--out {train_env['dataset'] / 'hf'} is inside {train_env['dataset']}, a "
                                        "dataset; put it in a folder of its own$"):
        check_replaceable(train_env["dataset"] / "hf", "--out")
