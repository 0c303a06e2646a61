import hashlib
import json
import os

import numpy as np
import pytest

from pipeline.data.sampler import BlockSampler
from pipeline.data.token_cache import split_blocks
from pipeline.errors import UserError


def epoch_indices(n, world, batch, accum, seed=3, epoch=0):
    """Per step, per rank, the concatenated indices of all micro-steps."""
    samplers = [BlockSampler(n, seed, world, r, batch, accum) for r in range(world)]
    for s in samplers:
        s.start_epoch(epoch)
    steps = []
    while samplers[0].has_next():
        steps.append([np.concatenate(s.next_step()) for s in samplers])
    return steps


def test_ranks_are_disjoint_and_cover_the_permutation_in_order():
    steps = epoch_indices(n=103, world=2, batch=3, accum=2)
    assert len(steps) == 103 // 12
    seen = np.concatenate([np.concatenate(step) for step in steps])
    assert len(seen) == len(set(seen.tolist())) == len(steps) * 12
    perm = np.random.default_rng([3, 0]).permutation(103)
    for k, step in enumerate(steps):  # each global batch is the next slice of the permutation, whoever gets it
        assert sorted(np.concatenate(step).tolist()) == sorted(perm[k * 12:(k + 1) * 12].tolist())
    assert set(perm[len(steps) * 12:].tolist()).isdisjoint(seen.tolist()), "incomplete last batch is dropped"


def test_deterministic_and_new_order_each_epoch():
    a, b = epoch_indices(50, 2, 2, 1), epoch_indices(50, 2, 2, 1)
    assert all((x == y).all() for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))
    e1 = epoch_indices(50, 2, 2, 1, epoch=1)
    assert not all((x == y).all() for sa, sb in zip(a, e1, strict=True) for x, y in zip(sa, sb, strict=True))


def test_state_round_trip_and_world_size_change_keep_the_global_position():
    one = BlockSampler(64, 7, 1, 0, 8, 1)
    one.next_step()
    one.next_step()
    state = one.state_dict()
    assert state == {"epoch": 0, "consumed": 16, "n_blocks": 64, "seed": 7, "global_batch": 8}
    expected = sorted(one.next_step()[0].tolist())
    two = [BlockSampler(64, 7, 2, r, 4, 1) for r in range(2)]  # same global batch on two ranks
    for s in two:
        s.load_state_dict(state)
    assert sorted(np.concatenate([s.next_step()[0] for s in two]).tolist()) == expected


def test_state_from_other_data_is_refused():
    s = BlockSampler(10, 0, 1, 0, 1, 1)
    with pytest.raises(UserError, match="the data changed since the checkpoint: 12 training blocks"):
        s.load_state_dict({"epoch": 0, "consumed": 0, "n_blocks": 12, "seed": 0, "global_batch": 1})


def test_validation_split_is_seeded_and_never_empty():
    train, val = split_blocks(100, 0.05, seed=1)
    assert len(val) == 5 and len(train) == 95 and set(train.tolist()).isdisjoint(val.tolist())
    assert (split_blocks(100, 0.05, seed=1)[1] == val).all()
    assert not (split_blocks(100, 0.05, seed=2)[1] == val).all()
    assert len(split_blocks(10, 0.01, seed=0)[1]) == 1
    assert len(split_blocks(10, 0.0, seed=0)[1]) == 0


def test_a_damaged_arrow_file_is_one_line_naming_the_dataset(train_env, tmp_path):
    import shutil

    from pipeline.data.dataset import load_text_dataset

    shutil.copytree(train_env["dataset"], tmp_path / "ds")
    arrow = next((tmp_path / "ds").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size * 3 // 4])  # a copy cut short
    with pytest.raises(UserError, match=rf"^--dataset-name {tmp_path / 'ds'} cannot be read, its files are damaged "
                                        r"\(.*\); build it again with DATA-HF.py$"):
        load_text_dataset(str(tmp_path / "ds"))


def test_the_dataset_fingerprint_covers_content_and_is_read_once(tmp_path):
    import datasets

    from pipeline.data.dataset import DATA_RECORD, dataset_fingerprint, load_text_dataset, size_fingerprint

    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["the gardener measured the wet soil"] * 50}).save_to_disk(str(folder))
    (arrow,) = folder.glob("*.arrow")
    old = arrow.stat()
    os.utime(arrow, ns=(old.st_atime_ns, old.st_mtime_ns - 10**10))  # written long before it is read
    first = dataset_fingerprint(load_text_dataset(str(folder)))
    record = json.loads((folder / DATA_RECORD).read_text())
    assert record[arrow.name]["sha256"] == hashlib.sha256(arrow.read_bytes()).hexdigest()
    assert dataset_fingerprint(load_text_dataset(str(folder))) == first
    assert (folder / DATA_RECORD).read_text() == json.dumps(record, indent=1)  # vouched for, not read again
    legacy = size_fingerprint(load_text_dataset(str(folder)))
    data = arrow.read_bytes()
    arrow.write_bytes(data.replace(b"gardener", b"Gardener", 1))  # a same-size edit
    assert arrow.stat().st_size == old.st_size
    edited = load_text_dataset(str(folder))
    assert edited[0]["text"] == "the Gardener measured the wet soil"
    assert size_fingerprint(edited) == legacy
    assert dataset_fingerprint(edited) != first


def test_a_read_only_dataset_is_fingerprinted_without_a_record(small_disk):
    import datasets

    from pipeline.data.dataset import DATA_RECORD, dataset_fingerprint, load_text_dataset

    small_disk.resize(8 * 2**20)
    folder = small_disk.path / "ds"
    datasets.Dataset.from_dict({"text": ["the gardener measured the wet soil"] * 50}).save_to_disk(str(folder))
    small_disk.read_only()
    first = dataset_fingerprint(load_text_dataset(str(folder)))
    assert dataset_fingerprint(load_text_dataset(str(folder))) == first
    assert not (folder / DATA_RECORD).exists()


def test_the_resume_guard_accepts_a_run_from_before_content_fingerprints(tmp_path):
    from pipeline.train.preflight import check_fingerprint

    saved = {"model_name": "m", "dataset": "by-size"}
    check_fingerprint(tmp_path, saved, {"model_name": "m", "dataset": "by-content"}, {"dataset": "by-size"})
    with pytest.raises(UserError, match="dataset was 'other' and is now 'by-content'"):
        check_fingerprint(tmp_path, {**saved, "dataset": "other"}, {"model_name": "m", "dataset": "by-content"},
                          {"dataset": "by-size"})
