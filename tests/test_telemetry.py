"""What a training window writes: metrics.jsonl, TensorBoard scalars, the loss plot; and the FLOPs count."""

import json

from pipeline.train.telemetry import Telemetry


def test_events_go_to_jsonl_and_tensorboard_and_the_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Telemetry(tmp_path, enabled=True, total_steps=4, start_step=0)
    for step, loss in ((2, 3.5), (4, 2.25)):
        t.event("train", step, loss=loss, lr=1e-4, grad_norm=float("nan"), mem_gb={"peak_alloc": 1.0}, epoch=0)
    t.event("eval", 4, loss=2.5, ppl=12.18)
    t.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"], r["loss"]) for r in records] == [("train", 2, 3.5), ("train", 4, 2.25),
                                                                    ("eval", 4, 2.5)]
    assert set(records[0]) == {"event", "step", "time", "loss", "lr", "grad_norm", "mem_gb", "epoch"}
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(2, 3.5), (4, 2.25)]
    assert [s.value for s in acc.Scalars("eval/ppl")] == [12.180000305175781]
    assert "train/grad_norm" not in acc.Tags()["scalars"]  # a non-finite value is not plotted
    assert "train/mem_gb" not in acc.Tags()["scalars"]
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


def test_a_disabled_instance_writes_nothing(tmp_path):
    t = Telemetry(tmp_path, enabled=False, total_steps=4, start_step=0)
    t.event("train", 1, loss=1.0)
    t.human({"loss": 1.0})
    t.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failing_run_closes_without_a_plot(tmp_path):
    t = Telemetry(tmp_path, enabled=True, total_steps=4, start_step=0)
    t.event("train", 1, loss=1.0)
    t.close(plot=False)
    t.close()  # a second close is a no-op, also for the plot
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "loss.png").exists()
