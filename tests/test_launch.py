"""`python fsdp1.py --nproc-per-node N`: one command that owns its workers and speaks in one line, as a user meets it
(real processes, the exact text and exit code): checks before any worker, a worker's error once, a stop signal as
the workers' stop line and 128 + the signal, nothing of the launcher's own; and a chat with what it trained."""

import os
import signal

from conftest import ROOT, events, losses, run_module, run_script, start_python, wait_for, with_root


def command(train_env, root, *extra) -> list[str]:
    return ["fsdp1.py", "--nproc-per-node", "2", "-e", "r", "-d", str(train_env["dataset"]), "-m", "local/tiny",
            "--save-dir", str(root), "--config", str(ROOT / "configs" / "demo.yaml"), *map(str, extra)]


def test_mistakes_are_one_line_before_or_after_the_workers_start(train_env, tmp_path):
    no_cache = {k: v for k, v in train_env["env"].items() if k != "HF_HOME"}
    no_cache["HF_HOME"] = str(tmp_path / "empty")
    before = run_script(*command(train_env, tmp_path, "--max-steps", 2), env=no_cache)
    assert (before.returncode, before.stderr) == (2, (
        f"error: model local/tiny is not in the offline cache at {tmp_path / 'empty' / 'hub'} (HF_HOME or "
        "HF_HUB_CACHE choose it; set them as when the model was put there); on this machine run: python "
        "MODEL_DOWNLOAD.py --model-name local/tiny (add --source DIR if offline)\n"))
    assert not (tmp_path / "r").exists()  # no worker, no run folder
    after = run_script(*command(train_env, tmp_path, "--max-steps", 2, "-b", 5000), env=train_env["env"])
    *notes, line = after.stderr.splitlines()  # a first start may say what checking the weights cost, nothing else
    assert (after.returncode, line) == (2, (
        "error: the dataset gives 649 training blocks of 128 tokens, fewer than one global batch (2 processes x batch "
        "5000 x grad accum 1 = 10000); use more data or a smaller --seq-length, --batch-size or --grad-accum"))
    assert all(n.startswith("checked 1 of 1 weight files by content") for n in notes), notes
    nested = run_script("fsdp1.py", "--nproc-per-node", "2", *command(train_env, tmp_path)[3:],
                        env={**train_env["env"], "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "1",
                             "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (nested.returncode, nested.stderr) == (2, "error: --nproc-per-node starts its own workers: run it as a "
                                                     "plain command, not under torchrun (which starts them already)\n")


def test_a_stop_signal_is_the_stop_line_and_its_exit_code_and_the_rerun_finishes(train_env, tmp_path):
    proc = start_python(command(train_env, tmp_path, "--max-steps", 100_000, "--ckpt-freq", 1000),
                        with_root(train_env["env"]), offline=True)
    wait_for(lambda: max(losses(tmp_path / "r"), default=0) >= 20, proc)
    proc.send_signal(signal.SIGINT)  # as Ctrl-C does: to the launcher, which passes it on to its workers
    out, err = proc.communicate(timeout=300)
    stopped = events(tmp_path / "r", "checkpoint")[-1]["step"]
    line = (f"[rank=0] stopped by signal at step {stopped}; checkpoint {tmp_path / 'r' / 'checkpoints'}/"
            f"step-{stopped:08d} saved; rerun the same command to resume")
    assert (proc.returncode, err, out.count("stopped by signal")) == (128 + signal.SIGINT, "", 1), (err, out[-2000:])
    assert line in out.splitlines()
    rerun = run_script(*command(train_env, tmp_path, "--max-steps", stopped + 2), env=train_env["env"])
    assert (rerun.returncode, rerun.stderr) == (0, "")  # no warning, no progress bar: stderr is not a terminal
    assert f"resumed from {tmp_path / 'r' / 'checkpoints'}/step-{stopped:08d}" in rerun.stdout
    assert "Token indices sequence length" not in rerun.stdout + out


def test_a_model_trained_on_text_continues_text_in_chat(train_env, tmp_path):
    """The export of a text run: its mark says so; pipeline.chat says it in one line and continues the prompt."""
    done = run_script(*command(train_env, tmp_path, "--max-steps", 4), env=train_env["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    chat = run_module("pipeline.chat", tmp_path / "r" / "hf", "--prompt", "The baker", "--max-new-tokens", 8,
                      env=train_env["env"])
    assert (chat.returncode, chat.stderr) == (0, (
        f"note: {tmp_path / 'r' / 'hf'} was fine-tuned on plain text, not conversations: each message is continued "
        "as text (--mode chat uses its chat template anyway)\n"))
    assert chat.stdout.strip()  # a continuation, where the chat template gave an empty line
    as_chat = run_module("pipeline.chat", tmp_path / "r" / "hf", "--prompt", "Hi", "--max-new-tokens", 4, "--mode",
                         "chat", env=train_env["env"])
    assert as_chat.returncode == 0 and as_chat.stderr in ("", (  # 4 text steps: it may end its turn at once
        "note: an empty reply: the model ended its turn at once, so it has not learned to answer in chat turns yet "
        "(train it more, or on conversations); --mode text continues the message as text\n"))
    os.remove(tmp_path / "r" / "hf" / "chat_template.jinja")
    no_template = run_module("pipeline.chat", tmp_path / "r" / "hf", "--prompt", "Hi", "--max-new-tokens", 4,
                             "--mode", "chat", env=train_env["env"])
    assert (no_template.returncode, no_template.stderr.splitlines()[-1]) == (2, (
        f"error: {tmp_path / 'r' / 'hf'} has no chat template; train with --chat-template FILE.jinja (it is exported "
        "with the model), use an Instruct model, or drop --mode chat to continue text"))
