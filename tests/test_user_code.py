"""The user's own code inside training (GRPO's reward functions and their files): what it returns as TRL accepts it,
what it must not do (exit, hang, fail on one rank, return what float32 cannot hold) stopped in one line, a stop signal
that cuts it (or a long generation) short within seconds, and the rerun that resumes as if nothing happened."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.errors import UserError
from pipeline.rl.rewards import Rewards
from pipeline.signals import Stopped, StopRequest

REWARDS = '''
import os
import signal
import sys
import time
from pathlib import Path


def as_numpy(prompts, completions, completion_ids, **columns):
    import numpy as np
    return np.array([float(len(c)) for c in completions])


def as_tensor(prompts, completions, completion_ids, **columns):
    import torch
    return torch.tensor([float(len(c)) for c in completions])


def numpy_scalars(prompts, completions, completion_ids, **columns):
    import numpy as np
    return [np.float32(len(c)) for c in completions]


def beyond_float32(prompts, completions, completion_ids, **columns):
    return [-1e39] * len(completions)


def reads_answer(prompts, completions, completion_ids, answer, **columns):
    return [None if a is None else float(a) for a in answer]


def exits(prompts, completions, completion_ids, **columns):
    sys.exit()


def exits_with_code(prompts, completions, completion_ids, **columns):
    sys.exit(3)


def interrupts(prompts, completions, completion_ids, **columns):
    raise KeyboardInterrupt


def sleeps(prompts, completions, completion_ids, **columns):
    time.sleep(3600)


def spins(prompts, completions, completion_ids, **columns):
    while True:
        try:
            pass
        except Exception:  # a reward that swallows every error does not swallow a stop or a time limit
            pass


def signalled(prompts, completions, completion_ids, **columns):
    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption lands while the reward runs
    time.sleep(3600)


def hangs_on_step_2(prompts, completions, completion_ids, trainer_state, **columns):
    if trainer_state.global_step == 1 and os.environ["RANK"] == "0":  # rank 1 waits for it in the rollout's agreement
        Path(os.environ["REWARD_MARK"]).touch()
        while True:
            time.sleep(1)
    return [float(len(ids) % 2) for ids in completion_ids]


def parity_preempted_in_step_2(prompts, completions, completion_ids, trainer_state, **columns):
    mark = os.environ.get("PREEMPT_MARK")
    if mark and trainer_state.global_step == 1 and os.environ["RANK"] == "0" and not Path(mark).exists():
        Path(mark).write_text(repr(time.time()))
        os.kill(os.getppid(), signal.SIGTERM)  # to the launcher, as a scheduler's preemption, which passes it on
    return [float(len(ids) % 2) for ids in completion_ids]


def fails_on_rank(prompts, completions, completion_ids, **columns):
    if os.environ["RANK"] == os.environ["FAILING_RANK"]:
        raise ValueError("only here")
    return [1.0] * len(completions)


def short_on_rank(prompts, completions, completion_ids, **columns):
    return [1.0] * (len(completions) - (os.environ["RANK"] == os.environ["FAILING_RANK"]))


class Exiting(float):
    def __float__(self):
        sys.exit(0)


def exits_when_read(prompts, completions, completion_ids, **columns):
    return [Exiting(1.0) for _ in completions]


def zero_d(prompts, completions, completion_ids, **columns):
    import numpy as np
    import torch
    return [torch.tensor(1.5), np.bool_(True)][:len(completions)]


def beyond_float(prompts, completions, completion_ids, **columns):
    return [10 ** 400] * len(completions)


def large(prompts, completions, completion_ids, **columns):
    return [1e20] * len(completions)


def alarm_user(prompts, completions, completion_ids, **columns):
    signal.alarm(30)  # as math_verify's timeout decorator: its own alarm, cancelled in its finally
    signal.alarm(0)
    time.sleep(3600)


def converts_stops(prompts, completions, completion_ids, **columns):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3600)
    except BaseException as exc:  # a reward with a handler of its own, turning everything into its error
        raise RuntimeError("my reward failed") from exc


import asyncio

BOTH_WAITING = {}


async def waits_for_its_partner(prompts, completions, completion_ids, **columns):
    BOTH_WAITING.setdefault("a", asyncio.Event()).set()
    await BOTH_WAITING.setdefault("b", asyncio.Event()).wait()  # set by its partner only if both run together
    return [1.0] * len(completions)


async def its_partner(prompts, completions, completion_ids, **columns):
    BOTH_WAITING.setdefault("b", asyncio.Event()).set()
    await BOTH_WAITING.setdefault("a", asyncio.Event()).wait()
    return [2.0] * len(completions)


async def async_fails(prompts, completions, completion_ids, **columns):
    raise ValueError("async trouble")


async def async_sleeps(prompts, completions, completion_ids, **columns):
    await asyncio.sleep(3600)


async def async_spins(prompts, completions, completion_ids, **columns):
    started = time.monotonic()
    while time.monotonic() < started + 5:  # work that never awaits (ending, so as not to hold the test's process)
        pass


async def async_in_a_thread(prompts, completions, completion_ids, **columns):
    await asyncio.to_thread(time.sleep, 5)  # a call to a judge that does not answer in time


async def async_signalled(prompts, completions, completion_ids, **columns):
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(3600)


async def async_narrow(prompts, completions):  # TRL's signature it is not
    return [1.0] * len(completions)


LOOPS = []


async def async_same_loop(prompts, completions, completion_ids, **columns):
    LOOPS.append(asyncio.get_running_loop())  # a client made at the first call is bound to this loop
    return [float(len(LOOPS))] * len(completions)


def parity(prompts, completions, completion_ids, **columns):
    return [float(len(ids) % 2) for ids in completion_ids]
'''


def reward_file(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rewards.py"
    path.write_text(REWARDS)
    return path


def one_line(spec: str, **kwargs) -> str:
    with pytest.raises(UserError) as caught:
        Rewards(spec, **kwargs).score(["p", "q"], ["a", "bb"], [[1], [2, 3]], [{}, {}])
    return str(caught.value)


def test_rewards_come_back_as_trl_takes_them_and_values_float32_cannot_hold_are_one_line(tmp_path):
    """numpy arrays, tensors and numpy scalars are rewards (TRL's _calculate_rewards takes them); -1e39, finite in
    Python, is -inf in the float32 advantages: refused naming the completion; a column some rows lack is None for
    them, and one no row of the batch has is still passed (every prompt column of the run, as TRL passes a
    dataset's), whatever its name."""
    path = reward_file(tmp_path)
    for name in ("as_numpy", "as_tensor", "numpy_scalars"):
        total, per = Rewards(f"{path}:{name}").score(["p", "q"], ["a", "bb"], [[1], [2, 3]], [{}, {}])
        assert total.tolist() == [1.0, 2.0] and per.dtype == torch.float32, name
    assert one_line(f"{path}:beyond_float32") == (
        f"reward {path}:beyond_float32 returned -1e+39 for the completion 'a' of prompt 'p'; a reward must be a finite "
        "number within float32's +-3.4e+38, or None to abstain")
    answers = Rewards(f"{path}:reads_answer")
    answers.check_columns({"answer": 1, "source": 2}, 2, "prompts")
    total, _ = answers.score(["p", "q"], ["a", "b"], [[1], [2]], [{"source": "x"}, {"source": "y"}])
    assert torch.isnan(total).all()  # no row of this batch has an answer: the function was called, and abstained
    total, _ = answers.score(["p", "q"], ["a", "b"], [[1], [2]], [{"answer": "3"}, {}])
    assert total[0] == 3 and torch.isnan(total[1])
    # columns named as the guard's own parameters (fn, timeout, late, what) reach the function as any other
    named = [{"answer": "4", "fn": 1, "timeout": 2, "late": 3, "what": 4}]
    assert answers.score(["p"], ["a"], [[1]], named)[0].tolist() == [4.0]
    with pytest.raises(UserError) as caught:
        Rewards("accuracy,think_format").check_columns({"question": 5}, 5, "data/prompts")
    assert str(caught.value) == (
        "--reward accuracy compares each completion with its prompt's `answer` column, and none of the 5 prompts of "
        "data/prompts has one (their columns: question); add answers, or use another reward")
    Rewards("accuracy").check_columns({"answer": 1}, 5, "data/prompts")  # some rows with one: the others abstain


def test_async_rewards_are_awaited_together_beside_plain_ones_under_the_same_guards(tmp_path):
    """`async def` rewards (TRL's) are awaited concurrently (two that each wait for the other finish: run one after the
    other, they would wait forever), beside a plain one; one that raises is one line naming it; past the time limit,
    one line naming them."""
    path = reward_file(tmp_path)
    total, per = Rewards(f"{path}:waits_for_its_partner,{path}:parity,{path}:its_partner", timeout=60).score(
        ["p", "q"], ["a", "bb"], [[1], [2, 3]], [{}, {}])
    assert per.tolist() == [[1.0, 1.0, 2.0], [1.0, 0.0, 2.0]] and total.tolist() == [4.0, 3.0]
    assert one_line(f"{path}:parity,{path}:async_fails") == (
        f"reward {path}:async_fails raised ValueError: async trouble (prompt 'p')")
    assert one_line(f"{path}:async_sleeps,{path}:waits_for_its_partner", timeout=0.3).startswith(
        f"reward {path}:async_sleeps, {path}:waits_for_its_partner did not return within 0.3 s on the 2 completions")


def test_async_rewards_that_hang_spin_are_stopped_or_mistyped_are_one_line_and_run_on_one_loop(tmp_path):
    """An async reward that never awaits, or waits on a thread that never returns, is stopped by the time limit
    (the run does not wait for the thread); a stop signal inside one is a stop; one whose signature is not TRL's is
    one line as a plain function's is; every call runs on the same event loop (a client made at the first call works
    at the next, as under TRL's one loop)."""
    path = reward_file(tmp_path)
    for name in ("async_spins", "async_in_a_thread"):
        started = time.monotonic()
        assert one_line(f"{path}:{name}", timeout=0.3).startswith(f"reward {path}:{name} did not return within 0.3 s")
        assert time.monotonic() - started < 4, name  # not waiting for the work (5 s) to end
    assert one_line(f"{path}:async_narrow").startswith(
        f"reward {path}:async_narrow raised TypeError: async_narrow() got an unexpected keyword argument")
    same = Rewards(f"{path}:async_same_loop")
    assert [same.score(["p"], ["a"], [[1]], [{}])[0].item() for _ in range(2)] == [1.0, 2.0]
    module = sys.modules[same.functions[0].__module__]
    assert module.LOOPS[0] is module.LOOPS[1] and module.LOOPS[0].is_running()
    StopRequest.install()
    try:
        with pytest.raises(Stopped, match=f"^in reward {path}:async_signalled$"):
            Rewards(f"{path}:async_signalled").score(["p"], ["a"], [[1]], [{}])
    finally:
        StopRequest.uninstall()
        StopRequest.signum = 0


def test_zero_d_values_are_numbers_and_what_float32_statistics_cannot_hold_is_one_line(tmp_path):
    """0-d tensors and numpy booleans are numbers; 10**400 (past float() itself) is refused as 1e39 is; a reward of
    1e20, or two weighted rewards summing past float32, would make the group's std overflow and every advantage 0:
    one line naming the completion, the values and the weights."""
    path = reward_file(tmp_path)
    assert Rewards(f"{path}:zero_d").score(["p", "q"], ["a", "b"], [[1], [2]], [{}, {}])[0].tolist() == [1.5, 1.0]
    assert one_line(f"{path}:beyond_float").startswith(f"reward {path}:beyond_float returned 1000000000000000")
    assert one_line(f"{path}:large") == (
        "the weighted reward of the completion 'a' of prompt 'p' is 1e+20 (large gave [1.0000000200408773e+20] at "
        "weights [1.0]): beyond +-1e+15, its group's std overflows float32 and every advantage becomes 0; scale the "
        "rewards down")
    assert Rewards(f"{path}:large:1e-6").score(["p"], ["a"], [[1]], [{}])[0].item() == pytest.approx(1e14, rel=1e-6)


def test_reward_entries_are_read_whole_and_a_bad_one_says_what_is_wrong_with_it(tmp_path):
    """A path holding ':' and ',' is read as the path (the entry reads whole only with it); functions named nan and inf
    are functions; a weight that is not a number says so; every weight 0 trains nothing: one line each."""
    odd = reward_file(tmp_path / "a,b:c")
    entries = Rewards(f"accuracy,{odd}:parity:2,{odd}:as_numpy")
    assert [(s.name, s.weight, s.path) for s in entries.specs] == [
        ("accuracy", 1.0, ""), ("parity", 2.0, str(odd)), ("as_numpy", 1.0, str(odd))]
    for spec, said in (
            (f"{odd}:nan", f"--reward {odd}:nan: the file defines no function nan"),
            (f"{odd}:inf:2", f"--reward {odd}:inf: the file defines no function inf"),
            (f"{odd}:parity:abc", f"--reward {odd}:parity:abc: its weight 'abc' is not a number "
                                  "(FILE.py:FUNCTION:WEIGHT, e.g. :0.5)"),
            (f"{odd}:parity:nan", f"--reward {odd}:parity:nan: the weight must be a finite number within +-1e6, got "
                                  "nan"),
            ("accuracy:1e308", "--reward accuracy:1e308: the weight must be a finite number within +-1e6, got 1e308"),
            (f"accuracy:0,{odd}:parity:0.0", f"every --reward has weight 0 (accuracy, {odd}:parity): every completion "
                                             "would get reward 0 and advantage 0, so nothing would train; give at "
                                             "least one a non-zero weight"),
            # a comma joins pieces only into something that exists: a misspelt built-in stays the mistake it is
            (f"acuracy,{odd}:parity", "--reward acuracy is neither FILE.py:FUNCTION[:WEIGHT], a built-in reward "
                                      "(accuracy, think_format) nor a reward model folder, each with an optional "
                                      ":WEIGHT")):
        with pytest.raises(UserError) as caught:
            Rewards(spec)
        assert str(caught.value) == said, spec
    from pipeline.rl.reward_specs import parse_rewards

    (tmp_path / "rm,v2").mkdir()
    (tmp_path / "rm,v2" / "config.json").write_text("{}")  # a reward model's folder whose name holds a comma
    assert [(s.model, s.weight) for s in parse_rewards(f"{tmp_path / 'rm,v2'}:0.5,org/judge")] == [
        (str(tmp_path / "rm,v2"), 0.5), ("org/judge", 1.0)]


def test_a_reward_that_exits_interrupts_or_hangs_is_one_line_and_a_stop_signal_cuts_it_short(tmp_path):
    """SystemExit (with or without a code) and KeyboardInterrupt from a reward, or from its file's import, are one
    line naming it (a run that did not finish never exits 0); a reward past --reward-timeout (sleeping, or spinning
    in a loop that swallows every Exception) is one line naming it and the prompt; a stop signal while one runs
    raises Stopped at once, where training saves and stops."""
    path = reward_file(tmp_path)
    assert one_line(f"{path}:exits") == (f"reward {path}:exits raised SystemExit: code run inside training must "
                                         "return, not end the process")
    assert one_line(f"{path}:exits_with_code").startswith(f"reward {path}:exits_with_code raised SystemExit(3): ")
    StopRequest.install()  # as in training: SIGINT is noted, so a KeyboardInterrupt is the reward's own
    try:
        assert one_line(f"{path}:interrupts").startswith(f"reward {path}:interrupts raised KeyboardInterrupt: ")
        for name in ("sleeps", "spins"):
            started = time.monotonic()
            assert one_line(f"{path}:{name}", timeout=0.3) == (
                f"reward {path}:{name} did not return within 0.3 s on the 2 completions of prompt 'p'; make it "
                "faster, or raise --reward-timeout (0: no limit)")
            assert time.monotonic() - started < 5  # the one call, not one per completion (the failing one is not
            # searched for when the batch's call timed out)
        with pytest.raises(Stopped) as caught:
            Rewards(f"{path}:signalled").score(["p"], ["a"], [[1]], [{}])
        assert (str(caught.value), StopRequest.signum) == (f"in reward {path}:signalled", signal.SIGTERM)
    finally:
        StopRequest.uninstall()
        StopRequest.signum = 0
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(UserError) as caught:
        Rewards(f"{tmp_path / 'exits_at_import.py'}:f")
    assert str(caught.value) == (f"--reward {tmp_path / 'exits_at_import.py'} raised SystemExit(0): code run inside "
                                 "training must return, not end the process")


def test_a_reward_keeps_its_time_limit_through_its_own_alarm_and_a_stop_it_turns_into_an_error_is_a_stop(
        tmp_path):
    """A reward that sets and cancels SIGALRM itself (math_verify's timeouts do) still times out; one whose handler
    turns the stop's interruption into an error of its own still stops the run as a stop, not as its error."""
    path = reward_file(tmp_path)
    StopRequest.install()
    try:
        assert one_line(f"{path}:alarm_user", timeout=0.3).startswith(f"reward {path}:alarm_user did not return "
                                                                      "within 0.3 s")
        with pytest.raises(Stopped, match=f"^in reward {path}:converts_stops$"):
            Rewards(f"{path}:converts_stops").score(["p"], ["a"], [[1]], [{}])
    finally:
        StopRequest.uninstall()
        StopRequest.signum = 0


def test_a_reward_file_run_from_its_own_folder_or_using_dataclasses_loads(tmp_path, monkeypatch):
    """--reward rewards.py:f from the reward's own folder (the README's form: the current directory holds it, and
    torch's modules with relative file names are no helper of it); a file whose dataclass is built under `from
    __future__ import annotations` (which looks its module up in sys.modules while it is imported)."""
    (tmp_path / "local_rewards_77.py").write_text(
        "from __future__ import annotations\nfrom dataclasses import dataclass\n\n@dataclass\nclass Score:\n"
        "    value: float\n\ndef f(prompts, completions, completion_ids, **columns):\n"
        "    return [Score(1.0).value] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    loaded = Rewards("local_rewards_77.py:f")
    assert loaded.score(["p"], ["a"], [[1]], [{}])[0].tolist() == [1.0]
    assert loaded.identity == Rewards("local_rewards_77.py:f").identity


def test_a_reward_files_helpers_beside_it_are_importable_and_part_of_its_identity(tmp_path):
    """The reward's folder is on the import path (where TRL users keep helper modules), a module parsing the command
    line at import reads none of the trainer's, and an edited helper changes the reward's identity (a resumed run
    refuses it, as an edited reward file)."""
    (tmp_path / "helper_of_77.py").write_text("VALUE = 1.0\n")
    (tmp_path / "uses.py").write_text(
        "import argparse\nfrom helper_of_77 import VALUE\n"
        "args = argparse.ArgumentParser().parse_args()  # sys.argv is its own: no flag of fsdp1's reaches it\n"
        "def f(prompts, completions, completion_ids, **columns):\n    return [VALUE] * len(completions)\n")
    import sys

    argv = sys.argv
    sys.argv = ["fsdp1.py", "--objective", "grpo"]
    try:
        first = Rewards(f"{tmp_path / 'uses.py'}:f")
    finally:
        sys.argv = argv
    assert first.score(["p"], ["a"], [[1]], [{}])[0].tolist() == [1.0]
    (tmp_path / "helper_of_77.py").write_text("VALUE = 2.0\n")
    again = Rewards(f"{tmp_path / 'uses.py'}:f")  # the module is loaded already: its helper's bytes are read again
    assert again.identity != first.identity and again.identity[0].startswith(f"{tmp_path / 'uses.py'}:f:1.0:")
    del sys.modules["helper_of_77"]


def test_grpo_lengths_past_the_models_positions_and_a_bad_reward_timeout_are_refused_at_preflight(tmp_path,
                                                                                                   train_env):
    from conftest import ROOT, preflight_errors

    from pipeline.prep.corpus import CorpusConfig, build_dataset

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "p.jsonl").write_text('{"prompt": "2 + 2 =", "topic": "sums"}\n' * 3)
    build_dataset(CorpusConfig(tmp_path / "p", tmp_path / "prompts", num_proc=1))
    grpo = ["-e", "r", "-m", "local/tiny", "--save-dir", tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml",
            "--objective", "grpo", "-d", tmp_path / "prompts"]
    path = reward_file(tmp_path / "r")
    assert preflight_errors([[*grpo, "--reward", f"{path}:parity", "--max-completion-length", 2600],
                             [*grpo, "--reward", f"{path}:parity", "--reward-timeout", -1],
                             [*grpo, "--reward", f"{path}:parity", "--reward-timeout", 1e-320],
                             [*grpo, "--reward", "accuracy"],
                             [*grpo, "--reward", f"{path}:parity", "--reward-timeout", 0]], train_env["env"]) == [
        "--max-prompt-length 512 + --max-completion-length 2600 = 3112 tokens is above the model's limit "
        "(max_position_embeddings 2048); lower either so that they sum to 2048 at most",
        "--reward-timeout must be in [0, 1e+06], got -1",
        "--reward-timeout must be 0 (no limit) or at least 0.001 s, got 1e-320",
        f"--reward accuracy compares each completion with its prompt's `answer` column, and none of the 3 prompts of "
        f"{tmp_path / 'prompts'} has one (their columns: topic); add answers, or use another reward",
        "ok"]


def test_a_stop_signal_ends_a_generation_at_its_next_token(tiny_models, group_of_one):
    """With a stop noted: a collective generation (one all-reduce per token carries it) raises Stopped on every rank
    at the same token; one over a replica ends this rank's rows there (its rollout agrees with the others after)."""
    from transformers import AutoModelForCausalLM

    from pipeline.model.head import Head
    from pipeline.rl.generation import Sampling, generate

    head = Head(AutoModelForCausalLM.from_pretrained(tiny_models["tied"], dtype=torch.float32).eval(), False, 1)
    ids, mask = torch.tensor([[5, 9, 30]]), torch.ones(1, 3, dtype=torch.long)
    assert generate(head, ids, mask, Sampling(50, greedy=True), set(), 0, None)[0].shape == (1, 50)
    StopRequest.signum = signal.SIGTERM
    try:
        with pytest.raises(Stopped, match="^during generation$"):
            generate(head, ids, mask, Sampling(50, greedy=True), set(), 0, None, collective=True)
        got, _ = generate(head, ids, mask, Sampling(50, greedy=True), set(), 0, None, collective=False)
        assert got.shape == (1, 1)
    finally:
        StopRequest.signum = 0


def prompts_dataset(tmp_path: Path) -> Path:
    from pipeline.prep.corpus import CorpusConfig, build_dataset

    (tmp_path / "p").mkdir()
    rows = [{"prompt": f"Count to {i}:", "answer": str(i)} for i in range(48)]
    (tmp_path / "p" / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_dataset(CorpusConfig(tmp_path / "p", tmp_path / "ds", num_proc=1))
    return tmp_path / "ds"


def grpo_command(tmp_path: Path, name: str, reward: str, *extra: object) -> list:
    from conftest import ROOT

    return ["-e", name, "-d", tmp_path / "ds", "-m", "local/tiny", "--save-dir", tmp_path / "runs", "--config",
            ROOT / "configs" / "demo.yaml", "--objective", "grpo", "--num-generations", 2, "-b", 2,
            "--reward", reward, "--log-freq", 1, "--val-fraction", 0, "--eval-base", "false", "--ckpt-freq", 0,
            "--warmup-steps", 0, "--lr-schedule", "constant", "--lr", 1e-2, *extra]


def stopped_by_sigterm(argv: list, env: dict, ready, log: Path) -> tuple[int, float, str]:
    """`fsdp1.py --nproc-per-node 2 ARGV`, SIGTERM to it (as a scheduler sends it) once ready() holds: (exit code,
    seconds from the signal to its exit, what it printed)."""
    from conftest import start_python, wait_for, with_root

    with open(log, "w") as out:
        proc = start_python(["fsdp1.py", "--nproc-per-node", "2", *map(str, argv)], with_root(env), offline=True,
                            stdout=out, stderr=subprocess.STDOUT)
        wait_for(ready, proc, timeout=300)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the launcher passes it on to its workers
        code = proc.wait(timeout=300)
    return code, time.monotonic() - sent, log.read_text()


def test_sigterm_in_a_steps_generation_or_a_hanging_reward_stops_within_seconds_and_the_rerun_repeats_the_run(
        tmp_path, train_env):
    """A preemption (SIGTERM to the launcher) in the middle of step 2's rollouts, sent by the reward of its first
    micro-batch, before its second generates 200 tokens per completion (fsdp2: one all-reduce per token, which carries
    the stop): the run ends within seconds, step 2's checkpoint saved as it was before its prompts were drawn, and
    the rerun's steps are the uninterrupted run's, bit for bit. SIGTERM while a reward function never returns (ddp,
    each rank generating through its own replica) interrupts it at once. Each stop is one line naming where, exit
    128 + SIGTERM, no traceback."""
    from conftest import ROOT, events, start_python, torchrun, with_root

    prompts_dataset(tmp_path)
    path = reward_file(tmp_path / "r")
    env = train_env["env"]
    reward = f"{path}:parity_preempted_in_step_2"
    long = ("--strategy", "fsdp2", "--max-completion-length", 200, "--max-steps", 2, "--grad-accum", 2)
    straight = torchrun(2, ROOT / "fsdp1.py", *grpo_command(tmp_path, "straight", reward, *long), env=env)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run, mark = tmp_path / "runs" / "g", tmp_path / "preempted"
    with open(tmp_path / "g.log", "w") as out:
        argv = ["fsdp1.py", "--nproc-per-node", "2", *map(str, grpo_command(tmp_path, "g", reward, *long))]
        proc = start_python(argv, with_root({**env, "PREEMPT_MARK": str(mark)}), offline=True, stdout=out,
                            stderr=subprocess.STDOUT)
        code = proc.wait(timeout=300)
    seconds, said = time.time() - float(mark.read_text()), (tmp_path / "g.log").read_text()
    assert (code, "Traceback" in said) == (128 + signal.SIGTERM, False), said[-3000:]
    assert seconds < 60, seconds
    # where the signal met the step: in the reward that sent it, at the rollout's agreement, or in the next generation
    assert re.search(rf"stopped by signal (in reward {re.escape(reward)}|during the rollouts|during generation) at "
                     rf"step 1; checkpoint {re.escape(str(run / 'checkpoints' / 'step-00000001'))} saved; rerun the "
                     "same command to resume", said), said[-3000:]
    again = torchrun(2, ROOT / "fsdp1.py", *grpo_command(tmp_path, "g", reward, *long), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    keys = ("step", "loss", "grad_norm", "reward", "completions/mean_length")
    assert [[e[k] for k in keys] for e in events(run, "train")] == \
        [[e[k] for k in keys] for e in events(tmp_path / "runs" / "straight", "train")]

    mark = tmp_path / "in-the-reward"
    hanging = grpo_command(tmp_path, "h", f"{path}:hangs_on_step_2", "--strategy", "ddp",
                           "--max-completion-length", 8, "--max-steps", 3, "--reward-timeout", 0)
    code, seconds, said = stopped_by_sigterm(hanging, {**env, "REWARD_MARK": str(mark)}, mark.exists,
                                             tmp_path / "h.log")
    assert (code, "Traceback" in said, seconds < 60) == (128 + signal.SIGTERM, False, True), (seconds, said[-3000:])
    assert (f"stopped by signal in reward {path}:hangs_on_step_2 at step 1; checkpoint "
            f"{tmp_path / 'runs' / 'h' / 'checkpoints' / 'step-00000001'} saved; rerun the same command to resume"
            ) in said, said[-3000:]


@pytest.mark.parametrize("failing_rank", ["1", "0"])
def test_a_reward_failing_on_one_rank_is_the_whole_output(tmp_path, train_env, failing_rank):
    """A reward that raises, or returns one value too few, on one rank only: the run's whole output after its start
    is that rank's one line (exit 2); the other rank's collective, which failed with it, says nothing."""
    from conftest import run_script

    prompts_dataset(tmp_path)
    path = reward_file(tmp_path / "r")
    env = {**train_env["env"], "FAILING_RANK": failing_rank}
    for name, line in (("fails_on_rank", f"error: reward {path}:fails_on_rank raised ValueError: only here (prompt "),
                       ("short_on_rank", f"error: reward {path}:short_on_rank returned 3 values for 4 completions")):
        proc = run_script("fsdp1.py", "--nproc-per-node", 2, *grpo_command(
            tmp_path, name, f"{path}:{name}", "--max-completion-length", 4, "--max-steps", 2), env=env)
        said = (proc.stdout + proc.stderr).splitlines()
        rest = [s for s in said if not s.startswith("[rank=0]")]
        assert proc.returncode == 2 and len(rest) == 1 and rest[0].startswith(line), "\n".join(said[-30:])


def test_a_run_ended_by_sys_exit_anywhere_inside_it_exits_with_an_error_naming_where(tmp_path, train_env):
    """SystemExit(0) raised outside any guarded call (here: reading a reward's value, a float whose __float__ exits)
    ends the run with exit 2 and one line naming where, never exit 0 with nothing trained or exported."""
    from conftest import run_script

    prompts_dataset(tmp_path)
    path = reward_file(tmp_path / "r")
    proc = run_script("fsdp1.py", "--nproc-per-node", 2, *grpo_command(
        tmp_path, "x", f"{path}:exits_when_read", "--max-completion-length", 4, "--max-steps", 2),
        env=train_env["env"])
    line = REWARDS.splitlines().index("        sys.exit(0)") + 1
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (2, (
        f"error: the run was ended by SystemExit(0) raised at {path}:{line}, before it finished; it exits with an "
        "error (a rerun of the same command resumes from the last checkpoint)")), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr and not (tmp_path / "runs" / "x" / "hf").exists()
