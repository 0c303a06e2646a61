"""lm-evaluation-harness, offline: pipeline.evaluate and a run's end score local tasks exactly as
lm_eval.simple_evaluate does when called directly, and every way a task cannot run here is one line, before any
training."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_evaluate, run_python, run_script, torchrun, with_root
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from pipeline.errors import UserError
from pipeline.tools.evaluate import resolve

TASKS = ["--lm-eval-tasks", "corpus_cloze", "--lm-eval-include", "examples/lm_eval"]
"""The bundled example task (a relative data file: every command runs in the project root)."""

DIRECT = """
import json, sys
from pipeline.offline import switch_offline
switch_offline()  # before any Hugging Face import
import lm_eval
from lm_eval.tasks import TaskManager
# the example folder's index alone: corpus_cloze is its task (lm-eval's own 14,684 take 6 s to index here)
tasks = TaskManager(include_path="examples/lm_eval", include_defaults=False)
results = [lm_eval.simple_evaluate(model="hf", model_args=args, tasks=["corpus_cloze"], task_manager=tasks,
                                   log_samples=False)["results"] for args in json.loads(sys.argv[1])]
print(json.dumps(results))
"""

CHECK = """
import json, sys
from pipeline.offline import switch_offline
switch_offline()  # before any Hugging Face import
from pathlib import Path
from pipeline.errors import UserError
from pipeline.eval.harness import Tasks, check_tasks
refusals = {}
for name in sys.argv[2:]:
    try:
        check_tasks(Tasks((name,), Path(sys.argv[1])))
    except UserError as exc:
        refusals[name] = str(exc)
print(json.dumps(refusals))
"""


def offline(env: dict) -> dict:
    return with_root({**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})


def simple_evaluate(env: dict, *models: tuple[Path, Path | None]) -> list[dict]:
    """lm_eval.simple_evaluate called directly on each (model folder, adapter or None), fp32 on CPU, in one process:
    their results."""
    args = [{"pretrained": str(model), "dtype": "float32", "device": "cpu", "batch_size": 8,
             **({"peft": str(adapter)} if adapter else {})} for model, adapter in models]
    proc = run_python(["-c", DIRECT, json.dumps(args)], offline(env), True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def base_folder(tiny_models, tmp_path_factory) -> Path:
    """A copy of the tied tiny model: evaluating an adapter checks its base's weights and records that check in the
    base's folder, which must not be the session's shared tiny model (tests compare its files byte for byte)."""
    return Path(shutil.copytree(tiny_models["tied"], tmp_path_factory.mktemp("lm_eval_base") / "tiny"))


@pytest.fixture(scope="module")
def adapter_folder(base_folder, tmp_path_factory) -> Path:
    """A PEFT LoRA folder on the tiny model whose B matrices are not zero (so the adapter changes every answer's
    likelihood)."""
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_folder),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    folder = tmp_path_factory.mktemp("lm_eval_adapter")
    model.save_pretrained(folder)
    return folder


def test_evaluate_scores_tasks_as_simple_evaluate_does_on_a_model_and_an_adapter(train_env, base_folder,
                                                                                  adapter_folder, tmp_path):
    env = offline(train_env["env"])
    out = tmp_path / "eval.json"
    proc = run_evaluate(env, "local/tiny", "-d", train_env["dataset"], "--config", ROOT / "configs" / "demo.yaml",
                        *TASKS, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["loss"] > 0 and report["tokens"] > 0  # the held-out loss and the tasks, in one report
    direct, direct_adapter = simple_evaluate(env, (base_folder, None), (base_folder, adapter_folder))
    assert report["lm_eval"]["results"] == direct and 0 <= direct["corpus_cloze"]["acc,none"] <= 1
    assert report["lm_eval"]["n-shot"] == {"corpus_cloze": 0} and "|corpus_cloze|" in proc.stdout

    # an adapter folder alone (its base from adapter_config.json), no dataset: the tasks only
    proc = run_evaluate(env, adapter_folder, *TASKS, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with_adapter = json.loads(out.read_text())
    assert "loss" not in with_adapter and with_adapter["adapter"] == str(adapter_folder)
    assert with_adapter["lm_eval"]["results"] == direct_adapter
    assert direct_adapter["corpus_cloze"]["acc_norm,none"] != direct["corpus_cloze"]["acc_norm,none"] or \
        direct_adapter["corpus_cloze"]["acc,none"] != direct["corpus_cloze"]["acc,none"]


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_a_run_ends_with_its_tasks_on_its_export(train_env, tmp_path, adapter):
    """Under torchrun: rank 0 alone runs them after the process group is gone; a LoRA run without a merged export
    scores the base with its adapter/."""
    flags = ["--adapter", "lora", "--merge-export", "off"] if adapter == "lora" else []
    proc = torchrun(2, "fsdp1.py", "-e", "tasks", "--save-dir", tmp_path, "-d", train_env["dataset"], "-m",
                    "local/tiny", "--config", ROOT / "configs" / "demo.yaml", "--max-steps", "2", "--strategy",
                    "ddp", *flags, *TASKS, env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "tasks"
    report = json.loads((run / "lm_eval.json").read_text())
    if adapter == "lora":
        assert report["adapter"] == str(run / "adapter") and not (run / "hf").exists()
        (direct,) = simple_evaluate(train_env["env"], (Path(report["model"]), run / "adapter"))
    else:
        assert report["model"] == str(run / "hf") and report["adapter"] is None
        (direct,) = simple_evaluate(train_env["env"], (run / "hf", None))
    assert report["lm_eval"]["results"] == direct
    assert proc.stdout.count("|corpus_cloze|") == 1  # rank 0 alone scored
    acc = direct["corpus_cloze"]["acc,none"]
    assert f"lm-eval corpus_cloze: acc {acc:.4f}" in (run / "train.log").read_text()


def test_a_task_that_cannot_run_here_is_one_line_before_any_training(train_env, tmp_path):
    env = offline(train_env["env"])
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    common = ("output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{context}}'\n"
              "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n")
    (tasks / "missing.yaml").write_text(f"task: missing_data\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        f"    test: {tmp_path / 'nowhere.jsonl'}\n{common}")
    (tasks / "hub.yaml").write_text(f"task: hub_data\ndataset_path: some-org/not-cached\n{common}")
    cloze = ROOT / "examples" / "lm_eval" / "corpus_cloze.jsonl"
    local = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {cloze}\n"
    (tasks / "type.yaml").write_text(f"task: bad_type\n{local}{common.replace('multiple_choice', 'multiple')}")
    (tasks / "utils.py").write_text("def process(doc, results):\n    raise ValueError('no score for this document')\n")
    (tasks / "late.yaml").write_text(f"task: fails_late\n{local}{common}process_results: !function utils.process\n")
    # a group of the folder's tasks runs; one naming lm-eval's own arc_easy finds it (lm-eval's whole index is read
    # for a group), whose data is on the Hub
    (tasks / "fine.yaml").write_text(f"task: fine\n{local}{common}")
    (tasks / "group.yaml").write_text("group: fine_group\ntask:\n  - fine\n")
    (tasks / "mixed.yaml").write_text("group: mixed_group\ntask:\n  - fine\n  - arc_easy\n")
    expected = {  # each task checked as every command checks it (harness.check_tasks), in one process
        "nope": f"unknown lm-eval task nope: not in {tasks} nor among lm-eval's own tasks (a task's name is its "
                "YAML's `task:`)",
        "missing_data": f"lm-eval task missing_data: its data could not be read on this offline machine (Unable "
                        f"to find '{tmp_path / 'nowhere.jsonl'}'); give the task local files (dataset_path: json with "
                        "dataset_kwargs.data_files, paths from the current folder) or put its dataset in the datasets "
                        "cache",
        "hub_data": "lm-eval task hub_data: its data could not be read on this offline machine (Couldn't reach "
                    "'some-org/not-cached' on the Hub (OfflineModeIsEnabled)); give the task local files",
        "bad_type": "lm-eval task bad_type could not be built (Got invalid output_type 'multiple', must be in ",
        # built, but its results fail on a document: found by the dry run (lm-eval's DummyLM on two documents)
        "fails_late": "lm-eval task fails_late fails on its first documents (no score for this document); fix "
                      "the task (its YAML or the functions it names)",
        "mixed_group": "lm-eval task mixed_group: its data could not be read on this offline machine (",
    }
    proc = run_python(["-c", CHECK, str(tasks), *expected, "fine", "fine_group"], env, True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refusals = json.loads(proc.stdout.splitlines()[-1])
    assert list(refusals) == list(expected)  # fine and fine_group pass
    for task, line in expected.items():
        assert refusals[task].startswith(line) and "\n" not in refusals[task], refusals[task]

    # a command prints it as its one line (lm-eval's whole index read, quietly): pipeline.evaluate, and the run before
    # its process group or its run folder
    proc = run_evaluate(env, "local/tiny", "--lm-eval-tasks", "nope", "--lm-eval-include", tasks)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {refusals['nope']}", proc.stderr[-2000:]
    proc = run_script("fsdp1.py", "-e", "never", "--save-dir", tmp_path / "runs", "-d", train_env["dataset"], "-m",
                      "local/tiny", "--config", ROOT / "configs" / "demo.yaml", "--lm-eval-tasks", "missing_data",
                      "--lm-eval-include", tasks, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == f"error: {expected['missing_data']}"
    assert not (tmp_path / "runs").exists()

    # lm-eval not installed: the make target that installs it
    blocked = ("import sys; sys.modules['lm_eval'] = None; sys.argv[1:] = sys.argv[2:]; "
               "from pipeline.errors import run_cli; from pipeline.tools.evaluate import main; run_cli(main)")
    proc = run_python(["-c", blocked, "-", "local/tiny", *TASKS], with_root(env), offline=True)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --lm-eval-tasks needs lm-evaluation-harness, which is not installed: run `make lm-eval` (pip install "
        "-r requirements-lm-eval.txt)")


def test_lm_eval_flags_are_checked_with_the_config(tmp_path):
    def refused(*argv: object) -> str:
        with pytest.raises(UserError) as err:
            resolve(list(map(str, argv)))
        return str(err.value)

    assert refused("m", "--lm-eval-include", tmp_path) == \
        f"--lm-eval-include {tmp_path} names no task to run; add --lm-eval-tasks T1,T2"
    assert refused("m", "--lm-eval-tasks", "t", "--lm-eval-include", tmp_path / "no") == \
        f"--lm-eval-include {tmp_path / 'no'} is not a folder (of lm-eval task YAMLs)"
    assert refused("m", "--lm-eval-tasks", "t", "--lm-eval-batch-size", "0") == \
        "--lm-eval-batch-size must be at least 1, got 0"
    assert refused("m") == ("nothing to evaluate: give a dataset (-d DATASET, or --config RUN/config.yaml) for the "
                            "held-out loss, or --lm-eval-tasks, or both")
    # an explicitly empty --lm-eval-tasks turns a run config's tasks off, their folder with them
    run_config = tmp_path / "config.yaml"
    run_config.write_text(f"dataset_name: d\nlm_eval_tasks: t\nlm_eval_include: {tmp_path}\n")
    cfg, _, _ = resolve(["m", "--config", str(run_config), "--lm-eval-tasks", ""])
    assert (cfg.train.lm_eval_tasks, cfg.train.lm_eval_include, cfg.data.dataset_name) == ("", "", "d")
