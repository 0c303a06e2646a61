"""Mixtures of datasets: -d NAME:WEIGHT,... parsed and refused in one line, the sampler's proportions, determinism and
resume across world sizes, and a mixture run end to end (per-source validation, the log's account, exact resume)."""

import json

import numpy as np
import pytest
import torch
from conftest import ROOT, events, kill_tree, losses, run_script, start_torchrun, torchrun, wait_for

from pipeline.config_merge import merge
from pipeline.data.mixture import MixedBlocks, Stacked
from pipeline.data.sampler import MixtureSampler
from pipeline.data.sources import Source, parse_sources
from pipeline.data.token_cache import Blocks
from pipeline.distributed.runtime import Dist
from pipeline.errors import UserError
from pipeline.prep.corpus import CorpusConfig, build_dataset
from pipeline.train.blocks import check_one_batch


def test_sources_are_parsed_and_bad_ones_are_one_line():
    assert parse_sources("data/mine") == [Source("mine", "data/mine", 1.0)]
    assert parse_sources("data/mine:0.7, org/general:0.3") == [Source("mine", "data/mine", 0.7),
                                                               Source("general", "org/general", 0.3)]
    # a colon without a number after it is part of a path
    assert parse_sources("c:/odd:name") == [Source("odd:name", "c:/odd:name", 1.0)]
    bad = {
        "a:0.5,b": "--dataset-name 'b' has no weight; a mixture names each dataset with one, as NAME:WEIGHT,"
                   "NAME:WEIGHT",
        "a:0.5,b:0": "--dataset-name 'b:0': a weight must be a number in (0, 1e+06], got 0",
        "a:0.5,b:-1": "--dataset-name 'b:-1': a weight must be a number in (0, 1e+06], got -1",
        "a:0.5,b:inf": "--dataset-name 'b:inf': a weight must be a number in (0, 1e+06], got inf",
        "a:0.5,b:nan": "--dataset-name 'b:nan': a weight must be a number in (0, 1e+06], got nan",
        # weights the sampler's sum would overflow with, or that no run would ever draw
        "a:1e308,b:0.3": "--dataset-name 'a:1e308': a weight must be a number in (0, 1e+06], got 1e308",
        "a:1,b:1e-320": "--dataset-name b:1e-320 is 1e-320 of the draws, which no run would draw; each source needs "
                        "at least 1e-06 of the weights' sum",
        "a:1e6,b:0.5": "--dataset-name b:0.5 is 5e-07 of the draws, which no run would draw; each source needs at "
                       "least 1e-06 of the weights' sum",
        "a:0.5,b:x": "--dataset-name 'b:x': the weight after the last ':' must be a number, got 'x'",
        "a:0.5,,b:1": "--dataset-name 'a:0.5,,b:1' has an empty item; write NAME:WEIGHT,NAME:WEIGHT",
        "x/a:0.5,x/a:1": "--dataset-name: x/a named twice; a mixture names each dataset once (its eval loss is "
                         "eval/loss/NAME by the folder's name)",
        "x/a:0.5,y/a:1": "--dataset-name: y/a and x/a share the name 'a'; a mixture names each dataset once (its eval "
                         "loss is eval/loss/NAME by the folder's name)",
    }
    for value, message in bad.items():
        with pytest.raises(UserError) as caught:
            parse_sources(value)
        assert str(caught.value) == message, value


def test_one_dataset_under_two_names_is_one_line(tmp_path):
    """A symlink (or a copy) of a dataset folder named beside it would train one dataset as two sources: refused by
    its fingerprint before anything else loads."""
    from pipeline.config_merge import resolve
    from pipeline.prep.corpus import CorpusConfig, build_dataset
    from pipeline.train.preflight import load_sources

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("some text\n")
    build_dataset(CorpusConfig(tmp_path / "raw", tmp_path / "mine", num_proc=1))
    (tmp_path / "also").symlink_to(tmp_path / "mine")
    cfg = resolve(["-e", "x", "-m", "org/model", "-d", f"{tmp_path / 'mine'}:0.5,{tmp_path / 'also'}:0.5"])
    with pytest.raises(UserError) as caught:
        load_sources(cfg)
    assert str(caught.value) == (f"--dataset-name: {tmp_path / 'also'} and {tmp_path / 'mine'} hold the same dataset "
                                 "(one fingerprint); a mixture names each dataset once, with one weight")


def test_a_yaml_mixture_is_a_list_of_path_and_weight(tmp_path):
    (tmp_path / "run.yaml").write_text("dataset_name:\n  - {path: data/mine, weight: 0.7}\n"
                                       "  - {path: data/general, weight: 0.3}\n")
    named = {"experiment_name": "e", "model_name": "m"}
    assert merge({"config": tmp_path / "run.yaml", **named}).data.dataset_name == "data/mine:0.7,data/general:0.3"
    (tmp_path / "bad.yaml").write_text("dataset_name:\n  - data/mine\n")
    with pytest.raises(UserError, match="each entry of a mixture is a mapping of path and weight, got 'data/mine'"):
        merge({"config": tmp_path / "bad.yaml", **named})
    with pytest.raises(UserError, match=r"a weight must be a number in \(0, 1e\+06\], got 0"):
        merge({"dataset_name": "a:1,b:0", **named})


def test_stacked_rows_are_the_concatenation():
    a, b = np.arange(12).reshape(4, 3), 100 + np.arange(6).reshape(2, 3)
    stacked, whole = Stacked([a, b]), np.concatenate([a, b])
    idx = np.array([5, 0, 4, 3, 1])
    assert len(stacked) == 6 and np.array_equal(stacked[idx], whole[idx]) and np.array_equal(stacked[2:5], whole[2:5])


def test_a_source_without_training_blocks_is_one_line(tmp_path):
    cfg = merge({"dataset_name": "x/big:1,y/small:1", "experiment_name": "e", "model_name": "m",
                  "seq_length": 64})
    full, empty = np.zeros((8, 64), np.uint32), np.zeros((0, 64), np.uint32)
    blocks = MixedBlocks(parse_sources(cfg.data.dataset_name), [Blocks(full, empty, tmp_path),
                                                               Blocks(empty, empty, tmp_path)])
    with pytest.raises(UserError) as caught:
        check_one_batch(blocks, cfg, Dist(0, 1, 0, 1, torch.device("cpu")))
    assert str(caught.value) == ("the mixture's source small (y/small) gives no training blocks of 64 tokens; give it "
                                 "more data, or leave it out of --dataset-name")


def global_sequence(sizes, weights, world, batch, accum, steps, seed=3) -> np.ndarray:
    """Every block the ranks train on, in (step, micro-step, rank) slot order."""
    ranks = [MixtureSampler(sizes, weights, seed, world, r, batch, accum) for r in range(world)]
    out = []
    for _ in range(steps):
        if not ranks[0].has_next():
            for s in ranks:
                s.start_epoch(s.epoch + 1)
        upcoming = ranks[0].upcoming()
        per_rank = [s.next_step() for s in ranks]
        step = np.concatenate([per_rank[r][m] for m in range(accum) for r in range(world)])
        assert np.array_equal(step, upcoming)
        out.append(step)
    return np.concatenate(out)


def test_the_mixture_draws_each_source_in_its_share_the_same_on_any_world_size():
    sizes, weights = [500, 37], [0.7, 0.3]  # the small source is drawn many epochs over
    seq = global_sequence(sizes, weights, world=2, batch=4, accum=2, steps=100)
    from_second = np.mean(seq >= sizes[0])
    assert abs(from_second - 0.3) <= 0.01 * 0.3 and len(seq) == 1600
    drawn = np.cumsum(seq >= sizes[0])  # within a block of its share at every point
    assert np.abs(drawn - 0.3 * np.arange(1, len(seq) + 1)).max() <= 1
    assert np.array_equal(seq, global_sequence(sizes, weights, world=4, batch=2, accum=2, steps=100))
    assert np.array_equal(seq, global_sequence(sizes, weights, world=1, batch=16, accum=1, steps=100))
    second = seq[seq >= sizes[0]] - sizes[0]
    for epoch in range(len(second) // sizes[1]):  # each epoch of a source is a permutation of its blocks
        assert sorted(second[epoch * 37:(epoch + 1) * 37]) == list(range(37))
    assert not np.array_equal(second[:37], second[37:74])


def test_a_resumed_mixture_sampler_continues_the_sequence_and_refuses_other_data():
    sizes, weights = [50, 20], [1.0, 3.0]
    whole = global_sequence(sizes, weights, world=1, batch=8, accum=1, steps=12)
    first = MixtureSampler(sizes, weights, 3, 1, 0, 8, 1)
    for _ in range(5):
        if not first.has_next():
            first.start_epoch(first.epoch + 1)
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint holds it
    two = [MixtureSampler(sizes, weights, 3, 2, r, 4, 1) for r in range(2)]  # another world size
    for s in two:
        s.load_state_dict(state)
    rest = []
    for _ in range(7):
        if not two[0].has_next():
            for s in two:
                s.start_epoch(s.epoch + 1)
        rest.append(np.concatenate([s.next_step()[0] for s in two]))
    assert np.array_equal(np.concatenate(rest), whole[40:])
    with pytest.raises(UserError, match=r"the data changed since the checkpoint: sources of \[50, 20\] training "
                                        r"blocks in shares \[0.25, 0.75\]"):
        MixtureSampler(sizes, [1.0, 1.0], 3, 1, 0, 8, 1).load_state_dict(state)


# ------------------------------------------------------------------------------------------------- end to end


def mix_args(env: dict, agents, root, *extra, weights: str = "0.7,0.3") -> list:
    """The bundled agents (tool calls, reasoning traces) and the demo's conversations, mixed, through Qwen3's
    template (which rewrites earlier turns: both are trained turn by turn)."""
    first, second = weights.split(",")
    return ["-e", "m", "-d", f"{agents}:{first},{env['chats']}:{second}", "-m", "local/tiny", "--save-dir", root,
            "--config", ROOT / "configs" / "demo.yaml", "--chat-template", ROOT / "examples/templates/qwen3.jinja",
            "--seq-length", "1024", "--log-freq", "1", "--ckpt-freq", "4", "--eval-freq", "4", "--max-steps", "8",
            "--chat-date", "01 Jan 2025", *extra]


def test_a_mixture_of_agents_and_chats_trains_in_its_ratios_and_resumes_exactly(train_env, tmp_path):
    """Agents at 0.7 and conversations at 0.3: every agent conversation kept, trained turn by turn with the cost in
    the log; the log and a mixture event say what each source gave (tokens, share, epochs); each eval event has each
    source's loss and the overall one between them (their target-weighted mean); a run killed after its first
    checkpoint resumes to the same losses; another weight, or --train-on-reasoning off, is another run (refused on
    resume)."""
    build_dataset(CorpusConfig(ROOT / "examples" / "agents", tmp_path / "agents", num_proc=1))
    agents, env = tmp_path / "agents", train_env["env"]
    ref = torchrun(2, ROOT / "fsdp1.py", *mix_args(train_env, agents, tmp_path / "ref"), env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "ref" / "m"
    log = (run / "train.log").read_text()
    assert "conversation samples: kept 80; " in log
    assert "mixture: agents 38 training blocks at 70.0%, chats 52 training blocks at 30.0%" in log
    assert "40 conversations trained turn by turn (their template rewrites earlier turns) as 80 samples" in log
    [mixture] = events(run, "mixture")
    drawn = {name: v["blocks"] for name, v in mixture["sources"].items()}
    assert drawn == {"agents": 22, "chats": 10}  # 8 steps of 4 blocks: 0.3 x 32 = 9.6
    assert mixture["sources"]["chats"]["tokens"] == 10 * 1024 and mixture["sources"]["agents"]["share"] == 0.6875
    assert "mixture over 8 steps: agents 22,528 tokens (68.8%" in log and "; chats 10,240 tokens (31.2%" in log
    evals = events(run, "eval")
    assert [e["step"] for e in evals] == [0, 4, 8]
    for e in evals:
        low, high = sorted([e["eval/loss/agents"], e["eval/loss/chats"]])
        assert low < e["loss"] < high
    expected = losses(run)
    proc = start_torchrun(2, ROOT / "fsdp1.py", *mix_args(train_env, agents, tmp_path), env=env)
    wait_for(lambda: max(losses(tmp_path / "m"), default=0) >= 5, proc)
    kill_tree(proc)
    again = torchrun(2, ROOT / "fsdp1.py", *mix_args(train_env, agents, tmp_path), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and losses(tmp_path / "m") == expected
    assert events(tmp_path / "m", "mixture")[-1]["sources"] == mixture["sources"]
    for changed, why in (({"weights": "0.5,0.5"}, "dataset was"), ({}, "train_reasoning was None and is now False")):
        extra = () if changed else ("--train-on-reasoning", "off")
        refused = run_script("fsdp1.py", *mix_args(train_env, agents, tmp_path, *extra, **changed), env=env)
        assert refused.returncode == 2 and "refusing to resume" in refused.stderr and why in refused.stderr
