from pathlib import Path

import pytest
import yaml

from pipeline.config_merge import PROFILES_DIR, from_flat, load_profile, resolve
from pipeline.errors import UserError
from pipeline.strategies.registry import settle

REQUIRED = ["-e", "x", "-d", "data", "-m", "org/model"]


def test_every_float_flag_refuses_what_is_not_a_finite_number():
    """The property over the whole set: every float field of every section (not a list of the ones we thought of)
    refuses inf, -inf and nan in one line naming its flag, before anything loads."""
    import dataclasses
    from typing import get_type_hints

    from pipeline.config import Config
    from pipeline.config_base import flag, float_fields

    sections = [get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)]
    names = [name for section in sections for name in float_fields(section)]
    assert {"lr", "pref_beta", "simpo_gamma", "orpo_lambda", "loss_scale", "val_fraction"} <= set(names)
    for name in names:
        for value in ("inf", "-inf", "nan"):
            with pytest.raises(UserError) as err:
                resolve([*REQUIRED, f"{flag(name)}={value}"])
            assert str(err.value) == f"{flag(name)} must be a finite number, got {float(value)}", name


def test_precedence_cli_over_file_over_profile_over_defaults(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump({"profile": "cpu_debug", "batch_size": 5, "lr": 1e-3}))
    cfg = resolve([*REQUIRED, "--config", str(cfg_file), "--lr", "5e-4"])
    assert cfg.optim.lr == 5e-4  # CLI
    assert cfg.train.batch_size == 5  # file over profile (2)
    assert cfg.data.seq_length == 128  # profile over default (1024)
    assert cfg.optim.warmup_steps == 0  # default
    assert cfg.run_dir == Path("outputs/x")


def test_a_comma_separated_flag_may_be_a_list_in_a_config_file(tmp_path):
    """As the HF Trainer's users write report_to: [wandb]."""
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("report_to: [mlflow, wandb]\nlm_eval_tasks: [hellaswag, arc_easy]\nlora_targets: [q_proj]\n")
    cfg = resolve([*REQUIRED, "--config", str(cfg_file)])
    assert (cfg.run.report_to, cfg.train.lm_eval_tasks, cfg.model.lora_targets) == ("mlflow,wandb",
                                                                                   "hellaswag,arc_easy", "q_proj")
    cfg_file.write_text("report_to: [mlflow, comet]\n")
    with pytest.raises(UserError) as err:
        resolve([*REQUIRED, "--config", str(cfg_file)])
    assert str(err.value) == ("--report-to: unknown tracker 'comet'; choose from none, tensorboard, mlflow, wandb, "
                              "trackio (comma-separated)")


def test_a_null_in_a_config_file_is_the_default_not_the_text_none(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("profile: cpu_debug\nchat_template: null\nseq_length:\nlr: ~\n")
    cfg = resolve([*REQUIRED, "--config", str(cfg_file)])
    assert (cfg.data.chat_template, cfg.data.seq_length, cfg.optim.lr) == ("", 1024, resolve(REQUIRED).optim.lr)


def test_on_off_flags_and_profile_flag():
    cfg = resolve([*REQUIRED, "--profile", "multi_node", "--compile", "off", "--cpu-offload", "on"])
    assert (cfg.model.sharding, cfg.model.compile, cfg.model.cpu_offload) == ("HYBRID_SHARD", False, True)


@pytest.mark.parametrize("name", sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
def test_every_shipped_profile_parses(name):
    values = load_profile(name)
    cfg = from_flat({**values, "experiment_name": "x", "dataset_name": "d", "model_name": "m"})
    assert cfg.flat()["experiment_name"] == "x"


def test_shipped_profiles_are_the_four_documented():
    assert sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")) == ["cpu_debug", "large_scale", "multi_node",
                                                                   "single_node"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile", "huge"], "unknown profile 'huge'; known profiles: cpu_debug, large_scale, multi_node, "
         "single_node"),
        (["--keep-last", "1"], "--keep-last must be at least 2, got 1"),
        (["--ckpt-minutes", "-1"], "--ckpt-minutes must be >= 0, got -1"),
        (["--memory-gb", "-1"], "--memory-gb must be >= 0, got -1.0"),
        (["--lr", "0"], "--lr must be a positive number, got 0.0"),
        (["--objective", "dpo", "--pref-beta", "1e308"], "--pref-beta must be in [1e-06, 1000], got 1e+308"),
        (["--objective", "simpo", "--pref-beta", "1e-320"], "--pref-beta must be in [1e-06, 1000], got 9.99989e-321"),
        (["--objective", "simpo", "--simpo-gamma", "1e308"], "--simpo-gamma must be in [0, 1000], got 1e+308"),
        (["--objective", "orpo", "--orpo-lambda", "1e308"], "--orpo-lambda must be in [1e-06, 1000], got 1e+308"),
        (["--precision", "fp16", "--loss-scale", "1e308"], "--loss-scale must be at most 2^64 (1.845e+19), got 1e+308"),
        (["--collective-timeout-s", "1e308"], "--collective-timeout-s must be in (0, 3.1536e+07], got 1e+308"),
        (["--peer-timeout-s", "1e308"], "--peer-timeout-s must be 0 (off) or in [2, 3.1536e+07], got 1e+308"),
        (["--ckpt-minutes", "1e308"], "--ckpt-minutes must be at most 525600 (a year), got 1e+308"),
        (["--lora-alpha", "1e308"], "--lora-alpha must be in (0, 10000], got 1e+308"),
        (["--batch-size", "two"], "--batch-size must be an int, got 'two'"),
        (["--compile", "maybe"], "--compile must be on or off, got 'maybe'"),
        (["--val-fraction", "0.7"], "--val-fraction must be in [0, 0.5), got 0.7"),
        (["--precision", "fp16", "--loss-scale", "0.5"], "--loss-scale must be at least 1, got 0.5"),
        (["--max-overflow-steps", "0"], "--max-overflow-steps must be at least 1, got 0"),
        (["--experiment-name", "a/b"], "--experiment-name must be a plain folder name, got 'a/b'"),
        (["--vocab-parallel", "on", "--sharding", "NO_SHARD"],
         "--vocab-parallel on needs --sharding FULL_SHARD or SHARD_GRAD_OP, got NO_SHARD"),
        (["--vocab-parallel", "on", "--cpu-offload"],
         "--vocab-parallel on cannot be combined with --cpu-offload (the head would stay on the GPU)"),
        (["--strategy", "ddp", "--sharding", "HYBRID_SHARD"], "--strategy ddp replicates the whole model on every "
         "rank; --sharding HYBRID_SHARD needs --strategy fsdp2 or fsdp1"),
        (["--strategy", "manual", "--sharding", "SHARD_GRAD_OP"], "--strategy manual is ZeRO-3 (FULL_SHARD); "
         "--sharding SHARD_GRAD_OP needs --strategy fsdp2 or fsdp1"),
        (["--strategy", "ddp", "--cpu-offload"], "--strategy ddp cannot offload to the CPU; --cpu-offload needs "
         "--strategy fsdp2 or fsdp1"),
        (["--strategy", "fsdp1", "--vocab-parallel", "on"], "--vocab-parallel on needs --strategy fsdp2, got "
         "--strategy fsdp1"),
        (["--strategy", "ddp", "--sharding", "NO_SHARD", "--vocab-parallel", "on"], "--vocab-parallel on needs "
         "--strategy fsdp2, got --strategy ddp"),  # the strategy first: its sharding is not what to change
        (["--strategy", "manual", "--compile"], "--strategy manual does not support --compile yet; use --strategy "
         "fsdp2"),
        (["--strategy", "manual", "--selective-checkpointing"], "--strategy manual does not support "
         "--selective-checkpointing yet; use --strategy fsdp2"),
        (["--activation-checkpointing", "--selective-checkpointing", "on"], "--activation-checkpointing recomputes "
         "whole layers and --selective-checkpointing the cheap part of each: turn one of them off"),
        (["--compile", "--selective-checkpointing"], "--selective-checkpointing does not take --compile yet; use "
         "--activation-checkpointing with --compile"),
        (["--adapter", "lora", "--strategy", "fsdp1"], "--strategy fsdp1 does not train adapters; --adapter lora "
         "needs --strategy fsdp2 or ddp"),
        (["--adapter", "dora", "--strategy", "manual"], "--strategy manual does not train adapters; --adapter dora "
         "needs --strategy fsdp2 or ddp"),
        (["--adapter", "qlora", "--strategy", "fsdp2", "--cpu-offload"], "--adapter qlora does not take "
         "--cpu-offload (its base is already 4-bit, and NF4 weights are not moved between host and device); use "
         "--adapter lora with --cpu-offload"),
        (["--lora-rank", "0"], "--lora-rank must be at least 1, got 0"),
        (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1), got 1.0"),
        (["--lora-targets", "q_proj,,v_proj"], "--lora-targets must be a comma-separated list of module names, got "
         "'q_proj,,v_proj'"),
        (["--strategy", "fsdp1", "--use-orig-params", "off", "--compile"],
         "--compile under --strategy fsdp1 needs --use-orig-params on"),
        (["--strategy", "fsdp1", "--use-orig-params", "off", "--weight-decay", "0.1"],
         "--use-orig-params off gives the optimizer one flat parameter per FSDP unit, so --weight-decay cannot "
         "skip norms and biases; use --weight-decay 0 or --use-orig-params on"),
    ],
)
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(UserError) as err:
        settle(resolve([*REQUIRED, *argv]))  # a field's own checks run in resolve, its strategy's in settle
    assert str(err.value) == message


def test_config_file_with_unknown_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_sise: 4\n")
    with pytest.raises(UserError) as err:
        resolve([*REQUIRED, "--config", str(bad)])
    assert str(err.value) == f"--config {bad} has unknown key: batch_sise"


def test_missing_required():
    with pytest.raises(UserError) as err:
        resolve(["-d", "data", "-m", "m"])
    assert str(err.value) == "--experiment-name (-e) is required"
    with pytest.raises(UserError) as err:  # a run's requirement (pipeline.evaluate may go without: lm-eval only)
        resolve(["-e", "x", "-m", "m"])
    assert str(err.value) == "--dataset-name (-d) is required"


def test_no_two_sections_define_the_same_key():
    import dataclasses

    from pipeline.config import SECTIONS

    keys = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    assert "profile" not in keys and "config" not in keys  # the two file-level keys


def test_choices_come_from_the_type_hints_and_are_checked_once():
    from pipeline.config import ModelConfig, RunConfig
    from pipeline.config_base import choices

    assert choices(ModelConfig) == {"precision": ("auto", "bf16", "fp16", "fp32"),
                                    "strategy": ("fsdp2", "fsdp1", "ddp", "manual", "auto"),
                                    "sharding": ("auto", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"),
                                    "auto_wrap": ("transformer", "size"),
                                    "backward_prefetch": ("BACKWARD_PRE", "BACKWARD_POST", "NONE"),
                                    "vocab_parallel": ("auto", "on", "off"),
                                    "attn_implementation": ("auto", "sdpa", "eager", "flex_attention",
                                                            "flash_attention_2"),
                                    "adapter": ("none", "lora", "dora", "qlora"), "offload_activations": ("on", "off"),
                                    "tiled_mlp": ("on", "off")}
    assert choices(RunConfig) == {"async_ckpt": ("auto", "on", "off"), "export_dtype": ("auto", "bf16", "fp16",
                                                                                         "fp32")}
    with pytest.raises(UserError, match=r"^--sharding must be one of auto, FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
                                        r"HYBRID_SHARD, got 'ZERO3'$"):
        ModelConfig(model_name="m", sharding="ZERO3")  # a YAML value, not only a flag, is checked


def test_every_flag_with_choices_refuses_another_value_in_one_line_without_a_usage_block():
    """Every Literal field of every section (not a list of the ones we thought of), GRPO's included: a value outside
    its choices is one line naming the flag, its choices and the value, from the section's own check (argparse's
    choice check printed its 70-line usage block first); --help shows the choices as argparse did."""
    from pipeline.config import SECTIONS
    from pipeline.config_base import choices, flag
    from pipeline.config_merge import build_parser

    allowed = {key: values for cls in SECTIONS.values() for key, values in choices(cls).items()}
    assert {"loss_type", "strategy", "precision", "adapter", "objective", "export_dtype"} <= set(allowed)
    actions = [a for a in build_parser()._actions if a.option_strings]
    assert not [a.dest for a in actions if a.choices]  # none left to argparse
    assert {a.dest: a.metavar for a in actions if a.metavar and a.metavar.startswith("{")} == {
        key: "{" + ",".join(values) + "}" for key, values in allowed.items()}
    for key, values in allowed.items():
        for value in ("unknown", values[0].upper() if values[0].upper() not in values else values[0].lower(), ""):
            with pytest.raises(UserError) as err:
                resolve([*REQUIRED, flag(key), value])
            assert str(err.value) == f"{flag(key)} must be one of {', '.join(values)}, got {value!r}", key


@pytest.mark.parametrize("argv", [["--loss-type", "unknown"], ["--nproc-per-node", "2", "--strategy", "unknown"],
                                  ["--objective=unknown"]])
def test_fsdp1_says_an_invalid_choice_in_one_line_and_exits_2(argv, tmp_path):
    """The whole output: the one line (a launcher of workers refuses it before starting any)."""
    from conftest import run_script

    from pipeline.config import SECTIONS
    from pipeline.config_base import choices

    allowed = {key: values for cls in SECTIONS.values() for key, values in choices(cls).items()}
    name = argv[-2] if len(argv) % 2 == 0 else argv[-1].split("=")[0]
    proc = run_script("fsdp1.py", "-e", "x", "-d", tmp_path / "data", "-m", "org/model", "--save-dir", tmp_path,
                      *argv)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2, "", f"error: {name} must be one of {', '.join(allowed[name[2:].replace('-', '_')])}, got 'unknown'\n")
    assert not list(tmp_path.iterdir())


def test_pipeline_tiny_says_an_invalid_preset_or_family_in_one_line_and_exits_2(tmp_path, capsys):
    """pipeline.tiny's flags with choices, as fsdp1.py's: one line naming the choices, nothing built; --help shows
    them as argparse did."""
    import subprocess
    import sys

    from conftest import ROOT, with_root

    from pipeline.prep import tiny

    allowed = {"--preset": sorted(tiny.PRESETS), "--family": list(tiny.FAMILIES)}
    for name, values in allowed.items():
        for value in ("unknown", values[0].upper(), ""):
            with pytest.raises(UserError) as err:
                tiny.main(["--out", str(tmp_path / "out"), name, value])
            assert str(err.value) == f"{name} must be one of {', '.join(values)}, got {value!r}"
    proc = subprocess.run([sys.executable, "-m", "pipeline.tiny", "--out", str(tmp_path / "out"), "--family", "gpt2",
                           "--seed", "1"], cwd=ROOT, env=with_root(), capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2, "", f"error: --family must be one of {', '.join(tiny.FAMILIES)}, got 'gpt2'\n")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        tiny.main(["--help"])
    usage = capsys.readouterr().out
    assert "[--preset {llama-3.1-8b,llama-3.2-1b,smollm2-135m}]" in usage
    assert "[--family {" + ",".join(tiny.FAMILIES) + "}]" in usage


def parsers():
    from pipeline import config_merge
    from pipeline.prep import corpus, hub, organize
    from pipeline.train import export

    return {"fsdp1.py": (config_merge.build_parser(), ["--save-dir", "out", "--max-bad-steps", "5"]),
            "ORGANIZE_DATA.py": (organize.build_parser(), ["--src-dir", "raw", "--dst-root", "s", "--num-dirs", "3"]),
            "DATA-HF.py": (corpus.build_parser(), ["--data-folder", "splits", "--save-dir", "data", "--num-proc", "2"]),
            "MODEL_DOWNLOAD.py": (hub.build_parser(), ["--model-name", "org/m", "--cache-dir", "cache"]),
            "export": (export.build_parser(), ["--checkpoint", "c", "--out", "o", "--export-dtype", "bf16"])}


@pytest.mark.parametrize("script", ["fsdp1.py", "ORGANIZE_DATA.py", "DATA-HF.py", "MODEL_DOWNLOAD.py", "export"])
def test_every_flag_takes_kebab_and_snake_case(script):
    parser, kebab = parsers()[script]
    snake = ["--" + a[2:].replace("-", "_") if a.startswith("--") else a for a in kebab]
    mixed = [f"{a}={b}" for a, b in zip(snake[::2], kebab[1::2], strict=True)]  # --flag=value too
    expected = vars(parser.parse_args(kebab))
    assert vars(parser.parse_args(snake)) == expected == vars(parser.parse_args(mixed))
    assert any(v not in (None, False) for v in expected.values())


def test_settling_a_config_returns_a_new_one_and_changes_nothing_given():
    import dataclasses

    cfg = from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": "m", "strategy": "ddp"})
    assert cfg.model.sharding == "auto"  # validation never rewrites a value
    settled = settle(cfg)
    assert settled.model.sharding == "NO_SHARD" and cfg.model.sharding == "auto"
    assert settle(settled) == settled
    assert dataclasses.replace(settled.model, strategy="fsdp1").sharding == "NO_SHARD"  # no check rewrites it back
    auto = from_flat({"experiment_name": "x", "dataset_name": "d", "model_name": "m", "strategy": "auto"})
    assert settle(auto) == auto  # auto waits for the model's shape (strategies/auto.plan_memory)


def test_the_resume_guard_covers_every_field_of_the_fingerprint(tmp_path):
    from pipeline.train.preflight import check_fingerprint

    saved = {"model_name": "m", "seq_length": 128, "a_field_added_later": 1}
    check_fingerprint(tmp_path, saved, dict(saved))
    for key in saved:
        with pytest.raises(UserError) as err:
            check_fingerprint(tmp_path, saved, {**saved, key: "changed"})
        assert str(err.value).startswith(f"refusing to resume {tmp_path}: {key} was ")
    with pytest.raises(UserError, match="a_field_added_later was 1 and is now None"):
        check_fingerprint(tmp_path, saved, {"model_name": "m", "seq_length": 128})


@pytest.mark.parametrize(("text", "why"), [
    ("lr: " + "[" * 100_000 + "]" * 100_000, "it is nested deeper than 100 levels"),
    ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)),
     "it expands to more than 2,000,000 nodes through its aliases"),
])
def test_a_hostile_config_file_is_one_line_before_the_loader_sees_it(tmp_path, text, why):
    """A depth-100,000 config was a 2,997-line RecursionError, an alias bomb 4 GB of memory in 88 s."""
    hostile = tmp_path / "hostile.yaml"
    hostile.write_text(text)
    with pytest.raises(UserError) as err:
        resolve([*REQUIRED, "--config", str(hostile)])
    assert str(err.value) == f"--config {hostile} is refused: {why}"


STAGE = '''
import atexit, logging, sys
from pipeline.errors import UserError, run_cli

def main():
    logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
    logging.info("logged")
    print("printed")  # to a pipe: block-buffered until flushed
    atexit.register(print, "finalized")
    kind = sys.argv[1]
    if kind == "refused":
        raise UserError("refused")
    if kind == "crash":
        raise RuntimeError("crash")
    if kind == "interrupted":
        raise KeyboardInterrupt
    return 0

run_cli(main, finalize=False)
print("not reached")
'''


@pytest.mark.parametrize("kind, code, stderr", [("ok", 0, ""), ("refused", 2, "error: refused\n"),
                                                ("interrupted", 130, "interrupted\n"), ("crash", 1, None)])
def test_a_stage_in_a_process_group_leaves_with_its_code_and_all_it_wrote_but_no_interpreter_teardown(
        tmp_path, kind, code, stderr):
    """fsdp1.py's exit (errors.leave): every line printed and logged reaches its file, the exit code is the stage's,
    and nothing registered for the interpreter's teardown runs (where gloo's threads abort or hang a process)."""
    import subprocess
    import sys

    from conftest import ROOT, with_root

    (tmp_path / "stage.py").write_text(STAGE)
    proc = subprocess.run([sys.executable, str(tmp_path / "stage.py"), kind, str(tmp_path / "log")], cwd=ROOT,
                          capture_output=True, text=True, env=with_root(), timeout=60)
    assert (proc.returncode, proc.stdout) == (code, "printed\n"), proc.stderr
    if stderr is None:
        assert proc.stderr.startswith("Traceback (most recent call last):\n") and proc.stderr.endswith(
            "RuntimeError: crash\n"), proc.stderr
    else:
        assert proc.stderr == stderr
    assert (tmp_path / "log").read_text() == "INFO:root:logged\n"


def test_every_other_commands_flag_with_choices_refuses_another_value_in_one_line(tmp_path):
    """ORGANIZE_DATA, pipeline.chat, pipeline.evaluate and pipeline.export: a value outside a flag's choices is one
    line naming them, exit 2, through errors.ArgumentParser's hook on argparse's private _check_value (checked here
    to exist: argparse has no public hook for it)."""
    import argparse

    from conftest import run_module, run_script

    assert callable(getattr(argparse.ArgumentParser, "_check_value", None))
    for proc, line in (
            (run_script("ORGANIZE_DATA.py", "--src_dir", tmp_path, "--dst_dir", tmp_path / "x", "--mode", "bad"),
             "--mode must be one of copy, hardlink, symlink, got 'bad'"),
            (run_module("pipeline.chat", tmp_path, "--mode", "bad"),
             "--mode must be one of auto, chat, text, got 'bad'"),
            (run_module("pipeline.evaluate", tmp_path, "--split", "bad"), "--split must be one of val, all, got 'bad'"),
            (run_module("pipeline.export", tmp_path, "--export-dtype", "bad"),
             "--export-dtype must be one of auto, bf16, fp16, fp32, got 'bad'")):
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"error: {line}\n")
