"""GRPO: its rewards, its generation, and runs on two real processes (learning, exact resume, a constant reward
that changes nothing), with the preflight's one-line refusals."""

import json
import math
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import built_strategy

REWARDS = '''
def even_ids(prompts, completions, completion_ids, **columns):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def constant(prompts, completions, completion_ids, **columns):
    return [1.0] * len(completions)


def echo_answer(prompts, completions, completion_ids, answer, **columns):
    return [float(a == "4") if a is not None else None for a in answer]


def fails_on_seven(prompts, completions, completion_ids, **columns):
    if any("7" in p for p in prompts):
        raise ValueError("no sevens")
    return [0.0] * len(completions)


def short(prompts, completions, completion_ids, **columns):
    return [0.0]


def not_finite(prompts, completions, completion_ids, **columns):
    return [math.nan] * len(completions)


def text(prompts, completions, completion_ids, **columns):
    return ["1"] * len(completions)


def by_step(prompts, completions, completion_ids, trainer_state, **columns):
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


def logs(prompts, completions, completion_ids, log_metric, log_extra, **columns):
    log_metric("mine/length", sum(map(len, completion_ids)) / len(completion_ids))
    log_extra("echo", list(completions))
    return [0.0] * len(completions)


def bad_metric(prompts, completions, completion_ids, log_metric, **columns):
    log_metric("mine/value", math.inf)
    return [0.0] * len(completions)


def bad_column(prompts, completions, completion_ids, log_extra, **columns):
    log_extra("short", [1])
    return [0.0] * len(completions)


def own_name(prompts, completions, completion_ids, log_metric, **columns):
    log_metric("reward", 1.0)
    return [0.0] * len(completions)
'''


def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text("import math\n" + REWARDS)
    return path


def test_rewards_are_weighted_abstentions_left_out_and_a_bad_one_stops_in_one_line(tmp_path):
    """The weighted sum of the values given (None abstains: nansum); TRL's signature with each column a keyword
    argument; a function that raises names itself and the prompt it failed on; a wrong count, NaN or text is one line;
    the built-ins read the last number or \\boxed{} and a think/answer format."""
    from pipeline.errors import UserError
    from pipeline.rl.rewards import Rewards

    path = reward_file(tmp_path)
    rewards = Rewards(f"{path}:echo_answer:2,{path}:constant:0.5")
    total, per = rewards.score(["a", "b", "c"], ["x", "y", "z"], [[1], [2], [3]],
                               [{"answer": "4"}, {"answer": "5"}, {}])
    assert total.tolist() == [2.5, 0.5, 0.5]
    assert per[:, 1].tolist() == [1.0, 1.0, 1.0] and per[:2, 0].tolist() == [1.0, 0.0] and math.isnan(per[2, 0])
    assert rewards.names == ["echo_answer", "constant"]
    assert rewards.identity[0].startswith(f"{path}:echo_answer:2.0:") and rewards.identity[0] != rewards.identity[1]

    def refusal(name: str, prompts: list[str]) -> str:
        with pytest.raises(UserError) as caught:
            Rewards(f"{path}:{name}").score(prompts, ["c"] * len(prompts), [[1]] * len(prompts),
                                            [{}] * len(prompts))
        return str(caught.value)

    assert refusal("fails_on_seven", ["what is 3?", "what is 7?"]) == (
        f"reward {path}:fails_on_seven raised ValueError: no sevens (prompt 'what is 7?')")
    assert refusal("short", ["p", "q"]) == (f"reward {path}:short returned 1 values for 2 completions (prompt 'p'); it "
                                            "must return one float or None per completion")
    assert refusal("not_finite", ["p"]) == (f"reward {path}:not_finite returned nan for the completion 'c' of prompt "
                                            "'p'; a reward must be a finite number within float32's +-3.4e+38, or "
                                            "None to abstain")
    assert refusal("text", ["p"]).startswith(f"reward {path}:text returned '1' for the completion")

    from pipeline.rl.rewards import RewardState

    shaped = Rewards(f"{path}:by_step").score(["p"], ["c"], [[1]], [{"trainer_state": "a column"}], RewardState(3, 4))
    assert shaped[0].tolist() == [0.75]  # TRL's trainer_state: the steps done when the completions were generated
    # TRL's log_metric and log_extra: a metric averaged over the window's calls, a column per completion
    logging = Rewards(f"{path}:logs")
    logging.score(["p", "q"], ["a", "b"], [[1, 2], [3]], [{}, {}])
    assert logging.extra == {"echo": ["a", "b"]}
    logging.score(["p"], ["a"], [[1, 2, 3, 4]], [{}])
    assert logging.take_metrics() == {"mine/length": [1.5, 4.0]} and logging.take_metrics() == {}
    assert refusal("bad_metric", ["p"]) == (f"reward {path}:bad_metric logged inf as the metric mine/value; "
                                            "log_metric takes a finite number")
    assert refusal("bad_column", ["p", "q"]) == (f"reward {path}:bad_column logged 1 values in the column short for 2 "
                                                 "completions; log_extra takes one value per completion")
    from pipeline.rl.figures import Figures

    figures = Figures(["reward"])
    figures.add("reward", torch.tensor([1.0, 3.0]))
    figures.log({"mine/length": [1.5, 4.0]})
    figures.log({"mine/length": [2.5]})
    assert figures.read(reduce=False) == {"reward": 2.0, "mine/length": 8.0 / 3}
    assert figures.read(reduce=False) == {}
    own = Rewards(f"{path}:own_name")
    own.score(["p"], ["a"], [[1]], [{}])
    with pytest.raises(UserError) as caught:
        figures.log(own.take_metrics())
    assert str(caught.value) == ("a reward function logged the metric reward, a name GRPO's train and eval events "
                                 "already use; give log_metric another name")
    with pytest.raises(UserError, match="the metric loss, a name GRPO's train and eval events already use"):
        figures.log({"loss": [1.0]})
    built_in = Rewards("accuracy,think_format:0.5")
    total, _ = built_in.score(["q"] * 4, ["so 3 + 4 = 7", "\\boxed{1,200} not 5", "<think>hm</think> 7", "none"],
                              [[1]] * 4, [{"answer": "7"}, {"answer": "1200.0"}, {"answer": 8}, {"answer": "7"}])
    assert total.tolist() == [1.0, 1.0, 0.5, 0.0]

    for spec, said in ((f"{path}:missing", f"--reward {path}:missing: the file defines no function missing"),
                       ("nothing", "--reward nothing is neither FILE.py:FUNCTION[:WEIGHT], a built-in reward "
                                   "(accuracy, think_format) nor a reward model folder, each with an optional :WEIGHT"),
                       ("accuracy:inf", "--reward accuracy:inf: the weight must be a finite number within +-1e6, "
                                        "got inf"),
                       ("accuracy,accuracy:2", "--reward names accuracy twice; each reward's metrics are named by its "
                                               "function, so give each once (with a weight: NAME:2)"),
                       (f"{tmp_path}/none.py:f", f"--reward {tmp_path}/none.py: the file cannot be read (No such "
                                                 "file or directory)")):
        with pytest.raises(UserError) as caught:
            Rewards(spec)
        assert str(caught.value) == said


def test_generation_with_a_cache_is_the_greedy_decoding_without_one_and_sampling_is_seeded(tiny_models):
    """Left-padded prompts completed with a KV cache give the tokens a cache-free greedy decoding gives each prompt
    alone, cut after the first stop token; top-k 1 is greedy; the same seed draws the same completions, another seed
    others."""
    from transformers import AutoModelForCausalLM

    from pipeline.eval.samples import next_token
    from pipeline.model.head import Head
    from pipeline.rl.generation import Sampling, generate, seeded

    model = AutoModelForCausalLM.from_pretrained(tiny_models["tied"], dtype=torch.float32).eval()
    head = Head(model, False, 1)
    prompts = [[5, 9, 30, 41], [77, 12]]
    ids = torch.tensor([prompts[0], [0, 0, *prompts[1]]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    alone = []
    for prompt in prompts:
        row = torch.tensor([prompt])
        for _ in range(6):
            row = torch.cat([row, next_token(head, row).view(1, 1)], 1)
        alone.append(row[0, len(prompt):].tolist())
    stop = alone[0][2]
    got, got_mask = generate(head, ids, mask, Sampling(6, greedy=True), {stop}, 0, None)
    first = alone[0][:alone[0].index(stop) + 1]
    assert got[0, :len(first)].tolist() == first and got_mask[0].tolist()[:len(first)] == [1] * len(first)
    assert got_mask[0, len(first):].sum() == 0
    second = alone[1][:alone[1].index(stop) + 1] if stop in alone[1] else alone[1]
    assert got[1, :len(second)].tolist() == second
    top1, _ = generate(head, ids, mask, Sampling(6, top_k=1), {stop}, 0, seeded(0, 1, 0, 0))
    assert top1.tolist() == got.tolist()
    # each prompt's forward once for its group (repeats): the cache and logits copied to its rows
    group = generate(head, ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0), Sampling(6, greedy=True),
                     {stop}, 0, None, repeats=3)
    assert [t.tolist() for t in group] == [t.repeat_interleave(3, 0).tolist() for t in (got, got_mask)]
    wide = Sampling(6, temperature=2.0, top_p=0.95)
    a, b, c = (generate(head, ids.repeat(4, 1), mask.repeat(4, 1), wide, set(), 0, seeded(0, s, 0, 0))[0]
               for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_prompt_ending_with_the_assistants_text_is_continued_as_trl_does(tmp_path, tiny_models):
    """TRL's continue_final_message: a conversational prompt whose last turn is the assistant's text is rendered up to
    that text, with no end of turn after it, where a prompt ending with the user's (no assistant turn at all: such
    prompts failed the conversation check at start) gets the assistant's header."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from pipeline.config_grpo import GRPOConfig
    from pipeline.data.chat_render import render
    from pipeline.errors import UserError
    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.rl.prompts import build_prompt_blocks

    (tmp_path / "p").mkdir()
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>"}]},
            {"prompt": [{"role": "user", "content": "2+2?"}]}]
    long = {"prompt": [{"role": "user", "content": "2+2? " * 200}, {"role": "assistant", "content": "<think>"}]}
    (tmp_path / "p" / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, long]))
    build_dataset(CorpusConfig(tmp_path / "p", tmp_path / "ds", num_proc=1))
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["tied"])
    ds = load_from_disk(str(tmp_path / "ds"))
    blocks = build_prompt_blocks(ds, tokenizer, GRPOConfig(long_prompts="drop"), "", 0.0, 0, 0)
    # the prompts the run continues are counted among those kept (the long one, dropped, is not one of them)
    assert {k: blocks.counts[k] for k in ("kept", "dropped", "prefilled")} == {"kept": 2, "dropped": 1, "prefilled": 1}
    with pytest.raises(UserError) as refused:
        build_prompt_blocks(ds, tokenizer, GRPOConfig(max_prompt_length=2, long_prompts="drop"), "", 0.0, 0, 0)
    assert str(refused.value) == ("no prompt is left of 3: 3 longer than --max-prompt-length 2 (raise it or use "
                                  "--long-prompts cut), 0 empty")
    texts = {}
    for ids, mask, row in zip(blocks.train, blocks.train_part.mask, blocks.train_part.rows, strict=True):
        texts[int(row)] = tokenizer.decode(ids[mask.astype(bool)])
    ends = [render(tokenizer, r["prompt"], "", continue_final_message=i == 0, add_generation_prompt=i == 1)
            for i, r in enumerate(rows)]
    assert texts == {0: ends[0], 1: ends[1]} and texts[0].endswith("<think>") and not texts[1].endswith("<think>")


def test_the_manual_strategy_gathers_each_unit_once_for_a_generation(group_of_one, tiny_models):
    """Strategy.gathered under manual ZeRO-3: a pass of forwards without autograd all-gathers each unit at its first
    forward only, gives the logits of forwards outside it, leaves nothing gathered after, and uses the weights as
    updated, not a gathered copy a forward before the update left."""
    from transformers import AutoConfig

    from pipeline.config import ModelConfig
    from pipeline.strategies.registry import make_strategy

    cfg = ModelConfig(model_name=str(tiny_models["tied"]), precision="fp32", strategy="manual", sharding="auto",
                      vocab_parallel="off")
    s = make_strategy(cfg, group_of_one, torch.float32, [])
    s.build(AutoConfig.from_pretrained(tiny_models["tied"]))
    s.load_weights(tiny_models["tied"])
    gathers = []
    original = s.comm.all_gather
    s.comm.all_gather = lambda out, shard: (gathers.append(1), original(out, shard))[1]
    ids = torch.randint(0, 400, (2, 8))
    with torch.no_grad():
        outside = [s.model(input_ids=ids[:, :n]).logits for n in (6, 7, 8)]
        per_pass = len(gathers)
        s.release()
        gathers.clear()
        with s.gathered():
            inside = [s.model(input_ids=ids[:, :n]).logits for n in (6, 7, 8)]
    assert len(gathers) == per_pass // 3 == len(s.flats)
    assert all(torch.equal(a, b) for a, b in zip(outside, inside, strict=True))
    assert all(flat.gathered is None for flat in s.flats)
    # a forward leaves the root gathered (training's does), then an update changes the shards: the pass sees it
    with torch.no_grad():
        s.model(input_ids=ids)
        for flat in s.flats:
            flat.shard.add_(0.01)
        with s.gathered():
            updated = s.model(input_ids=ids).logits
        s.release()
        assert torch.equal(updated, s.model(input_ids=ids).logits)


def test_grpo_runs_a_group_per_prompt_learns_resumes_bitwise_and_a_constant_reward_changes_nothing(tmp_path, train_env,
                                                                                                  tiny_models):
    """Two ranks, full fine-tuning under ddp: each step generates G completions per prompt and logs TRL's figures;
    a reward that varies within groups from the first step (the share of even token ids) rises by 0.2 or more;
    killed after a checkpoint, the rerun repeats the uninterrupted run's steps after it bit for bit, completions
    included, and a changed reward file is refused on resume; with --num-iterations 2 each generation trains twice
    and a checkpoint between the two resumes exactly; fsdp1 and manual take ddp's first step. LoRA under
    fsdp2 with a KL penalty against the base (the adapters off) starts at kl 0, and pipeline.evaluate of its adapter
    gives its final validation reward. Full fine-tuning under fsdp2 with a constant reward and a KL penalty against
    a frozen copy of the base: every advantage is 0, so the loss, the gradient and the kl are 0 and the export is the
    base, on conversational prompts (some continuing the assistant's begun turn)."""
    from conftest import ROOT, events, kill_tree, preflight_errors, run_evaluate, start_torchrun, torchrun, wait_for

    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.rl.figures import TRAIN_FIELDS

    (tmp_path / "prompts").mkdir()
    rows = [{"prompt": f"Count to {i}:", "answer": str(i)} for i in range(48)]
    (tmp_path / "prompts" / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_dataset(CorpusConfig(tmp_path / "prompts", tmp_path / "ds", num_proc=1))
    rewards = reward_file(tmp_path)

    def common() -> list:
        return ["-d", tmp_path / "ds", "-m", "local/tiny", "--save-dir", tmp_path / "runs", "--config",
                ROOT / "configs" / "demo.yaml", "--objective", "grpo", "--num-generations", 4,
                "--max-completion-length", 8, "-b", 2, "--log-freq", 1, "--val-fraction", 0.25, "--eval-freq", 0,
                "--warmup-steps", 0, "--lr-schedule", "constant"]

    def run(name: str, *extra: object) -> str:
        proc = torchrun(2, ROOT / "fsdp1.py", "-e", name, *common(), *extra, env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    said = run("lora", "--reward", f"{rewards}:even_ids", "--strategy", "ddp", "--lr", 2e-2,
               "--max-steps", 12, "--ckpt-freq", 6)
    lora = tmp_path / "runs" / "lora"
    train, evals = events(lora, "train"), events(lora, "eval")
    assert "prompts: 48 kept (36 train, 12 validation)" in said
    assert "; 36 train / 12 val prompts; global batch 4 prompts (16 completions); step 0 of 12" in said
    assert "GRPO scores each prompt once with its 4 completions after it (packed rows: the same log-probabilities as " \
        "plain rows, largest difference " in said
    names = {"reward", "reward_std", "rewards/even_ids/mean", "rewards/even_ids/std", "frac_reward_zero_std",
             "completions/mean_length", "completions/min_length", "completions/max_length",
             "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "entropy", "completions_per_s"}
    assert names <= set(train[0]) and "kl" not in train[0] and train[0]["tokens_per_s"] is None
    assert set(train[0]) - names <= set(TRAIN_FIELDS)  # the names a reward's log_metric is refused: all the others
    assert train[0]["completions/max_length"] <= 8 and train[0]["clip_ratio/region_mean"] == 0  # on-policy: ratio 1
    assert train[0]["time_ms"]["generate"] > 0
    rises = [e["reward"] for e in train]
    assert sum(rises[-3:]) / 3 - sum(rises[:3]) / 3 >= 0.2, rises
    assert f"validation mean reward {evals[0]['reward']:.4f} -> {evals[-1]['reward']:.4f} over 12 prompts" in said
    samples = events(lora, "sample")
    assert len(samples) == 2 * 12 and set(samples[0]["rewards"]) == {"even_ids"}
    # killed (SIGKILL, every process) once step 6's checkpoint is complete, in a run that would go on to step 40 (the
    # schedule is constant: the steps do not change it); the rerun resumes there and repeats steps 7-12 bit for bit
    again = tmp_path / "runs" / "again"
    killed = [*common(), "-e", "again", "--reward", f"{rewards}:even_ids", "--strategy", "ddp", "--lr", 2e-2,
              "--ckpt-freq", 6]
    proc = start_torchrun(2, ROOT / "fsdp1.py", *killed, "--max-steps", 40, env=train_env["env"])
    wait_for(lambda: any(e["step"] == 6 for e in events(again, "checkpoint")), proc)
    kill_tree(proc)
    assert proc.wait() == -signal.SIGKILL
    assert torch.load(again / "checkpoints" / "step-00000006" / "objective-1.pt") == {"packing": "on"}
    proc = torchrun(2, ROOT / "fsdp1.py", *killed, "--max-steps", 12, env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the packed-rows decision is the checkpoint's: the rerun scores as the killed run did, without comparing again
    assert "GRPO scores each prompt once" not in proc.stdout + proc.stderr
    resumed = events(again, "resume")
    assert resumed[0]["from_step"] == 6
    after = [e for e in events(again, "train") if e["time"] > resumed[0]["time"]]
    keys = ("loss", "grad_norm", "reward", "reward_std", "entropy", "completions/mean_length")
    assert [[e[k] for k in keys] for e in after] == [[e[k] for k in keys] for e in train[6:]]
    retold = [s["completion"] for s in events(again, "sample") if s["time"] >= resumed[0]["time"]]
    assert retold == [s["completion"] for s in samples[12:]]
    # on 3 ranks the third holds no decision: every rank compares again (a collective all of them reach), not only it
    shutil.copytree(again, tmp_path / "runs" / "wider")
    wider = torchrun(3, ROOT / "fsdp1.py", *[a if a != "again" else "wider" for a in killed], "--max-steps", 8,
                     "--resume-from", "step-00000006", env=train_env["env"])
    assert wider.returncode == 0, wider.stderr[-3000:]
    assert (wider.stdout + wider.stderr).count("GRPO scores each prompt once") == 1

    # --num-iterations 2: each generation trained on twice, the second time against the generating policy (the ratio
    # leaves 1, the clip acts); a checkpoint between the two keeps the rollouts, so the rerun repeats the steps after
    run("mu", "--reward", f"{rewards}:even_ids", "--strategy", "ddp", "--lr", 2e-2, "--max-steps", 6, "--ckpt-freq", 3,
        "--num-iterations", 2)
    mu = events(tmp_path / "runs" / "mu", "train")
    assert (mu[0]["loss"], mu[0]["clip_ratio/region_mean"]) == (train[0]["loss"], 0)
    assert mu[1]["reward"] == mu[0]["reward"] and mu[1]["clip_ratio/region_mean"] > 0
    # 3 generations of 4 prompts over 6 steps: the prompts seen are the ones drawn
    assert json.loads((tmp_path / "runs" / "mu" / "state.json").read_text())["samples_seen"] == 12
    assert sorted(p.name for p in (tmp_path / "runs" / "mu" / "checkpoints" / "step-00000003").glob("objective-*")) \
        == ["objective-0.pt", "objective-1.pt"]
    shutil.copytree(tmp_path / "runs" / "mu", tmp_path / "runs" / "mu-again")
    run("mu-again", "--reward", f"{rewards}:even_ids", "--strategy", "ddp", "--lr", 2e-2, "--max-steps", 6,
        "--ckpt-freq", 3, "--num-iterations", 2, "--resume-from", "step-00000003")
    assert [[e[k] for k in keys] for e in events(tmp_path / "runs" / "mu-again", "train")[6:]] == \
        [[e[k] for k in keys] for e in mu[3:]]
    # every strategy takes the same first step: the same completions (seeded alike), loss and gradient (fsdp1's
    # under --selective-checkpointing, whose recomputed operations give the same values)
    for strategy, extra in (("fsdp1", ("--selective-checkpointing", "on")), ("manual", ())):
        run(strategy, "--reward", f"{rewards}:even_ids", "--strategy", strategy, "--lr", 2e-2, "--max-steps", 1,
            "--ckpt-freq", 0, *extra)
        first = events(tmp_path / "runs" / strategy, "train")[0]
        assert (first["loss"], first["reward"]) == (train[0]["loss"], train[0]["reward"])
        assert first["grad_norm"] == pytest.approx(train[0]["grad_norm"], rel=1e-5)
    # the reward file's content is the run's: changed, the rerun is refused in one line (before any weight is read)
    rewards.write_text(rewards.read_text() + "\n# changed\n")
    refused = preflight_errors([["-e", "again", *common(), "--reward", f"{rewards}:even_ids", "--strategy", "ddp",
                                 "--lr", 2e-2, "--ckpt-freq", 6, "--max-steps", 12]], train_env["env"])[0]
    assert refused.startswith(f"refusing to resume {again}: its rewards were {rewards}:even_ids:1.0:")
    assert refused.endswith("(FILE:FUNCTION:WEIGHT:content hash): a changed reward file, function or weight trains "
                            "toward another goal; restore them, or pass --no-resume to start a new run beside it")
    # a reward of weight 0 that only logs (TRL's log_metric and log_extra): its metric in each train event, averaged
    # over both ranks' calls, and its column with the sampled completions
    run("kl", "--reward", f"{rewards}:even_ids", "--reward", f"{rewards}:logs:0", "--adapter", "lora", "--strategy",
        "fsdp2", "--grpo-beta", 0.04, "--lr", 1e-2, "--max-steps", 2, "--ckpt-freq", 0, "--scale-rewards", "batch",
        "--loss-type", "grpo")
    kl = events(tmp_path / "runs" / "kl", "train")
    assert kl[0]["kl"] == 0 and kl[1]["kl"] > 0  # the adapters start at zero: the policy is its reference
    assert kl[0]["mine/length"] == pytest.approx(kl[0]["completions/mean_length"], rel=1e-6)
    shown = events(tmp_path / "runs" / "kl", "sample")
    assert shown and all(s["extra"] == {"echo": s["completion"]} for s in shown)
    # pipeline.evaluate of the adapter on the run's config: the held-out prompts' greedy mean reward, as the run's end
    scored = run_evaluate(train_env["env"], tmp_path / "runs" / "kl" / "adapter", "--config",
                          tmp_path / "runs" / "kl" / "config.yaml", "--out", tmp_path / "e.json")
    assert scored.returncode == 0, scored.stderr[-3000:]
    report, final = json.loads((tmp_path / "e.json").read_text()), events(tmp_path / "runs" / "kl", "eval")[-1]
    assert (report["objective"], report["prompts"]) == ("grpo", 12)
    assert report["mean_reward"] == pytest.approx(final["reward"], abs=1e-6)
    assert f"mean reward  {report['mean_reward']:.4f}\n" in scored.stdout
    # with a KL penalty too: under full fine-tuning its reference is a frozen copy of the base (sharded under fsdp2),
    # which the unchanged policy equals at every step
    # on conversational prompts (rendered by the chat template; half of them with the assistant's turn begun, which
    # the model continues), whose completions reach the rewards as messages
    (tmp_path / "chats").mkdir()
    chats = [{"prompt": [{"role": "user", "content": f"Count to {i}:"},
                         *([{"role": "assistant", "content": "1,"}] if i % 2 else [])]} for i in range(48)]
    (tmp_path / "chats" / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    build_dataset(CorpusConfig(tmp_path / "chats", tmp_path / "chat-ds", num_proc=1))
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "constant",
                    *[tmp_path / "chat-ds" if a == tmp_path / "ds" else a for a in common()], "--reward",
                    f"{rewards}:constant", "--strategy", "fsdp2", "--lr", 1e-2, "--max-steps", 2, "--ckpt-freq", 0,
                    "--precision", "fp32", "--grpo-beta", 0.04, env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "; 24 end with the assistant's text, which the model continues" in proc.stdout + proc.stderr
    constant = events(tmp_path / "runs" / "constant", "train")
    assert [(e["loss"], e["grad_norm"], e["frac_reward_zero_std"], e["kl"]) for e in constant] == [(0, 0, 1, 0)] * 2
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "runs" / "constant" / "hf" / "model-00001-of-00001.safetensors")
    original = load_file(tiny_models["tied"] / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k].to(exported[k].dtype)) for k in exported)


def test_prompts_and_grpo_go_together_and_its_settings_are_checked_in_one_line(tmp_path, train_env):
    """A prompts dataset trains with grpo alone; grpo needs prompts and a reward; GRPO's flags belong to it and are
    range-checked; a reward file that does not load is one line. Each before any weight is read."""
    from conftest import ROOT, preflight_errors

    from pipeline.prep.corpus import CorpusConfig, build_dataset

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "p.jsonl").write_text('{"prompt": "2 + 2 =", "answer": "4"}\n' * 3)
    build_dataset(CorpusConfig(tmp_path / "p", tmp_path / "prompts", num_proc=1))
    rewards = reward_file(tmp_path)
    common = ["-e", "r", "-m", "local/tiny", "--save-dir", tmp_path / "runs", "--config",
              ROOT / "configs" / "demo.yaml"]
    grpo = [*common, "--objective", "grpo", "-d", tmp_path / "prompts"]
    refusals = preflight_errors([[*common, "-d", tmp_path / "prompts"],
                                 [*common, "-d", train_env["dataset"], "--objective", "grpo", "--reward", "accuracy"],
                                 [*common, "-d", train_env["dataset"], "--num-generations", 4],
                                 grpo,
                                 [*grpo, "--reward", "accuracy", "--num-generations", 1],
                                 [*grpo, "--reward", "accuracy", "--top-p", 0],
                                 [*grpo, "--reward", f"{rewards}:nope"],
                                 [*grpo, "--reward", "accuracy", "--vocab-parallel", "on"],
                                 [*grpo, "--reward", "accuracy", "--reward", f"{rewards}:even_ids:2"]],
                                train_env["env"])
    assert refusals == [
        f"{tmp_path / 'prompts'} holds 3 prompts alone (prompt-only records, for online RL): train them with "
        "--objective grpo --reward FILE.py:FUNCTION",
        f"--objective grpo generates completions of prompts and {train_env['dataset']} holds none (DATA-HF reads "
        "records with a \"prompt\" and no completion, e.g. {\"prompt\": \"...\", \"answer\": \"...\"}, as prompts)",
        "--num-generations is for --objective grpo, not sft",
        "--objective grpo needs at least one --reward (FILE.py:FUNCTION[:WEIGHT] or a built-in: accuracy, "
        "think_format), or an --environment whose class has get_reward()",
        "--num-generations must be in [2, 4096], got 1",
        "--top-p must be in (0, 1], got 0",
        f"--reward {rewards}:nope: the file defines no function nope",
        "--vocab-parallel on: GRPO scores its completions through the model's own head; use --vocab-parallel auto "
        "or off",
        "ok"]
    assert not (tmp_path / "runs").exists()


def test_a_reward_model_folder_is_a_grpo_reward_scored_in_the_training_processes(tmp_path, train_env, tiny_models):
    """A reward model trained here (--objective reward, on pairs preferring numbers to words) is a GRPO reward as a
    folder (--reward RUN/hf, as TRL takes a model id): scored on each rank's completions, named by its run in the
    metrics, and the policy's mean reward under it rises. A model folder that is no reward model is one line."""
    from conftest import ROOT, events, preflight_errors, torchrun

    from pipeline.prep.corpus import CorpusConfig, build_dataset

    words = ["apple", "river", "stone", "cloud", "green", "house", "music", "paper", "light", "water", "table", "dream"]
    (tmp_path / "pairs").mkdir()
    (tmp_path / "pairs" / "p.jsonl").write_text("".join(json.dumps(
        {"prompt": f"Count to {i}:", "chosen": " " + " ".join(str(7 * i + k) for k in range(1 + i % 3)),
         "rejected": " " + " ".join(words[(i + k) % len(words)] for k in range(1 + i % 3))}) + "\n" for i in range(96)))
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}:"}) + "\n"
                                                          for i in range(48)))
    for name in ("pairs", "prompts"):
        build_dataset(CorpusConfig(tmp_path / name, tmp_path / f"{name}-ds", num_proc=1))
    common = ["-m", "local/tiny", "--save-dir", tmp_path / "runs", "--config", ROOT / "configs" / "demo.yaml",
              "--strategy", "ddp", "--precision", "fp32", "--log-freq", 1, "--eval-freq", 0, "--ckpt-freq", 0]
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "rm", "-d", tmp_path / "pairs-ds", *common, "--objective", "reward",
                    "--seq-length", 64, "--max-steps", 20, "--lr", 1e-3, "--val-fraction", 0.1, env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert events(tmp_path / "runs" / "rm", "eval")[-1]["accuracy"] > 0.9
    grpo = ["-d", tmp_path / "prompts-ds", *common, "--objective", "grpo", "--num-generations", 4,
            "--max-completion-length", 8, "-b", 2, "--val-fraction", 0.25, "--warmup-steps", 0, "--lr-schedule",
            "constant", "--lr", 2e-2, "--max-steps", 20]
    proc = torchrun(2, ROOT / "fsdp1.py", "-e", "grpo", *grpo, "--reward", tmp_path / "runs" / "rm" / "hf",
                    env=train_env["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = events(tmp_path / "runs" / "grpo", "train")
    rises = [e["reward"] for e in train]
    assert train[0]["rewards/rm_hf/mean"] == train[0]["reward"]
    assert sum(rises[-5:]) / 5 > sum(rises[:5]) / 5 + 0.2, rises
    # resident on every rank: its parameters are in the memory estimate (counted on the meta device)
    from transformers import AutoModelForSequenceClassification

    from pipeline.rl.rewards import Rewards

    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "runs" / "rm" / "hf")
    judge = Rewards(str(tmp_path / "runs" / "rm" / "hf"))
    assert judge.model_params == sum(p.numel() for p in loaded.parameters())
    # a prompt whose answer was begun: the reward model reads the begun text and the completion as one answer
    (fn,) = judge.functions
    fn.place(torch.device("cpu"), torch.float32)
    user = [{"role": "user", "content": "Count to 3:"}]
    assert fn.ids([*user, {"role": "assistant", "content": " 1,"}], [{"role": "assistant", "content": " 2, 3"}]) == \
        fn.ids(user, [{"role": "assistant", "content": " 1, 2, 3"}]) is not None
    refused = preflight_errors([["-e", "other", *grpo, "--reward", tmp_path / "runs" / "rm" / "hf",
                                 "--reward", tiny_models["tied"]]], train_env["env"])
    assert refused == [f"--reward {tiny_models['tied']} is not a reward model (a sequence classifier with one output, "
                       "as --objective reward exports to RUN/hf); give FILE.py:FUNCTION, a built-in, or a reward model "
                       "folder"]


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "fsdp1", "manual"])
def test_ddp_generates_through_its_replica_and_the_sharded_strategies_through_their_collective_forward(
        name, tiny_models, group_of_one):
    """Under ddp each rank generates with the module inside the wrapper (whose forward is no collective, so no
    per-token all-reduce keeps the ranks in step: each generates at its own pace); every other strategy's forward
    all-gathers, so its ranks step together (replica_head None)."""
    strategy = built_strategy(tiny_models["tied"], name, group_of_one)
    replica = strategy.replica_head()
    if name == "ddp":
        assert replica.model is strategy.module and strategy.head().model is strategy.model is not strategy.module
    else:
        assert replica is None


def test_truncated_completions_are_said_and_masked_on_request_and_gspo_runs(tmp_path, train_env):
    """Completions that all reach --max-completion-length 4: the first log line says so (clipped_ratio 1.0), a window
    where most do is one warning pointing at --mask-truncated-completions; with it they train nothing (loss and
    gradient 0 at every step, TRL's masking), and the warning says so. GSPO (--importance-sampling-level sequence)
    trains, warning that a token-summing loss type weighs completions by length; changed on resume, it is refused."""
    from conftest import ROOT, events, preflight_errors, torchrun

    from pipeline.prep.corpus import CorpusConfig, build_dataset

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}:"}) + "\n" for i in range(32)))
    build_dataset(CorpusConfig(tmp_path / "p", tmp_path / "ds", num_proc=1))
    rewards = reward_file(tmp_path)

    def command(name: str, *extra: object) -> list:
        return ["-e", name, "-d", tmp_path / "ds", "-m", "local/tiny", "--save-dir", tmp_path / "runs", "--config",
                ROOT / "configs" / "demo.yaml", "--objective", "grpo", "--num-generations", 4, "-b", 2,
                "--max-completion-length", 4, "--reward", f"{rewards}:even_ids", "--log-freq", 1, "--val-fraction", 0,
                "--eval-base", "false", "--max-steps", 2, "--lr", 1e-2, "--strategy", "ddp", *extra]

    said = {}
    for name, extra in (("plain", ()), ("masked", ("--mask-truncated-completions", "true")),
                        ("gspo", ("--importance-sampling-level", "sequence"))):
        proc = torchrun(2, ROOT / "fsdp1.py", *command(name, *extra), env=train_env["env"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        said[name] = proc.stdout + proc.stderr
    assert "'completions/clipped_ratio': 1.0" in said["plain"] and (
        "100% of this window's completions reached --max-completion-length 4 without ending: their rewards judge "
        "cut-off text; raise --max-completion-length, or pass --mask-truncated-completions to train on finished ones "
        "only") in said["plain"]
    assert said["plain"].count("of this window's completions reached") == 1  # once a run
    assert ("100% of this window's completions reached --max-completion-length 4 without ending: they train nothing "
            "(--mask-truncated-completions), so little trains; raise --max-completion-length") in said["masked"]
    plain, masked = events(tmp_path / "runs" / "plain", "train"), events(tmp_path / "runs" / "masked", "train")
    assert plain[0]["reward_std"] > 0 and plain[0]["grad_norm"] > 0
    assert [(e["loss"], e["grad_norm"]) for e in masked] == [(0, 0)] * 2
    assert ("--importance-sampling-level sequence with --loss-type dapo sums the completions' tokens, so each "
            "completion weighs by its length rather than as one sequence; --loss-type grpo is the GSPO paper's "
            "objective (as TRL warns)") in said["gspo"]
    gspo = events(tmp_path / "runs" / "gspo", "train")
    assert gspo[0]["loss"] == pytest.approx(plain[0]["loss"], abs=1e-6)  # on-policy the ratio is 1 either way
    assert preflight_errors([command("gspo", "--max-steps", 4)], train_env["env"]) == [
        f"refusing to resume {tmp_path / 'runs' / 'gspo'}: --importance-sampling-level was 'sequence' and is now "
        "'token'; rerun with the original value, or pass --no-resume to start a new run beside it"]
