"""What a training window writes: metrics.jsonl, TensorBoard scalars, the loss plot; and the FLOPs count."""

import json
import shutil

from pipeline.train.telemetry import Telemetry, read_metrics


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


def test_a_cut_line_and_garbage_in_metrics_jsonl_lose_no_event_and_the_plot_is_drawn(tmp_path):
    """A killed run's unended line would swallow the next run's first event; bytes that are not UTF-8 or lines that
    are not events failed the plot at the end of a finished run."""
    t = Telemetry(tmp_path, enabled=True, total_steps=4, start_step=0)
    t.event("train", 1, loss=3.0)
    t.close()
    with open(tmp_path / "metrics.jsonl", "ab") as fh:
        fh.write(b'\xff\xfe garbage\n[1, 2]\n{"event": "train"}\n{"event": "train", "step": 2, "loss": "x"}\n'
                 b'{"event": "train", "step": 2, "lo')  # what a kill mid-write leaves
    t = Telemetry(tmp_path, enabled=True, total_steps=4, start_step=2)
    t.event("train", 3, loss=2.0)
    t.close()
    assert [(e["step"], e["loss"]) for e in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 3.0), (2, "x"),
                                                                                           (3, 2.0)]
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_full_disk_at_the_end_is_a_warning_not_a_second_error(small_disk, caplog):
    t = Telemetry(small_disk.path, enabled=True, total_steps=4, start_step=0)
    t.event("train", 1, loss=3.0)
    (small_disk.path / "filler").write_bytes(b"\0" * (shutil.disk_usage(small_disk.path).free - 4096))
    t.close()
    assert f"cannot write {small_disk.path / 'loss.png'}: no space left on device" in caplog.text
    assert not (small_disk.path / "loss.png").exists() and not list(small_disk.path.glob(".loss.png.tmp-*"))


def test_profile_kinds_of_real_kernel_names_and_the_busy_time_of_overlapping_kernels():
    """pipeline/train/profiling.py sorts kernels (CUDA's, as an H200 profile names them) and CPU operators into the
    kinds of work the step is split into; kernels on two streams that overlap count once."""
    from pipeline.train.profiling import busy_us, kind_of

    kinds = {
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN": "matmuls",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmuls",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(...)": "matmuls",
        "aten::mm": "matmuls",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false>>": "attention",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
        "void at::native::(anonymous namespace)::fused_adamw_kernel_impl<float>(...)": "optimizer",
        "void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<1>, LpNormFunctor>": "optimizer",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "FSDP::post_backward_reduce (layers.0)": "communication",
        "triton_red_fused__log_softmax_backward_data_nll_loss_backward_0": "loss",
        "VocabParallelCrossEntropy": "loss",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norms and elementwise",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": (
            "norms and elementwise"),
        "aten::mul": "norms and elementwise",
        "Memcpy HtoD (Pinned -> Device)": "copies",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "copies",
        "PythonSubclass": "other",
    }
    assert {name: kind_of(name) for name in kinds} == kinds
    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_us([]) == 0
