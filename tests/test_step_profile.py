"""benchmarks/step_profile.py reads where a step's time goes from a profiler trace. The GPU side is checked on a
trace shaped like Kineto's CUDA output (no GPU here: the figures below are worked out by hand); the CPU side on a
real torch.profiler trace."""

import pytest

from benchmarks.step_profile import STEP_MARK, describe, kind_of, profile_steps, summarize_trace


def _x(cat, name, ts, dur, tid=1, correlation=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def _gpu_shaped_trace():
    events = [_x("user_annotation", STEP_MARK, 0, 100), _x("user_annotation", STEP_MARK, 100, 100)]
    for base in (0, 100):
        events += [
            _x("cpu_op", "aten::linear", base + 1, 10),
            _x("cpu_op", "aten::addmm", base + 2, 6),  # own 4 and 6
            _x("cpu_op", "aten::_fused_adamw_", base + 60, 5),
            _x("cuda_runtime", "cudaLaunchKernel", base + 3, 1, correlation=base + 1),
            _x("cuda_runtime", "cuLaunchKernelEx", base + 4, 1, correlation=base + 2),
            _x("cuda_runtime", "cudaLaunchKernelExC", base + 61, 1, correlation=base + 4),
            _x("cuda_runtime", "cudaStreamSynchronize", base + 90, 5),
            _x("cuda_runtime", "cudaMemcpyAsync", base + 89, 1),
            _x("kernel", "nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT", base + 10, 30, tid=9, correlation=base + 1),
            _x("kernel", "pytorch_flash::flash_fwd_kernel<Traits>", base + 35, 10, tid=9, correlation=base + 2),
            _x("kernel", "vectorized_elementwise_kernel<4, Gelu>", base + 50, 10, tid=9, correlation=base + 3),
            _x("kernel", "multi_tensor_apply_kernel<FusedAdam>", base + 70, 5, tid=9, correlation=base + 4),
            _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", base + 89, 1, tid=9),
            # backward's operators on autograd's device thread; a graph launch; what is not to be counted: the GPU
            # copy of the step mark, an unnamed runtime call, a flow arrow
            _x("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", base + 20, 8, tid=2),
            _x("cuda_runtime", "cudaGraphLaunch", base + 62, 1),
            {**_x("gpu_user_annotation", STEP_MARK, base + 10, 80, tid=9), "pid": 0},
            _x("cuda_runtime", "INVALID", base + 5, 1, correlation=base + 3),  # launched the GELU
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": base, "ts": base + 3, "pid": 7, "tid": 1},
        ]
    return events


def test_a_gpu_shaped_trace_is_read_as_worked_out_by_hand():
    s = summarize_trace(_gpu_shaped_trace())
    assert s["steps"] == 2 and s["step_ms"] == pytest.approx(0.1)
    dev = s["device"]
    # busy: gemm 10-40, flash 35-45 (5 overlapping), gelu 50-60, adam 70-75, copy 89-90: 30+5+10+5+1 = 51 µs a step
    # over the two steps' 200 µs the device is busy 2 × 51 µs
    assert dev["busy_ms"] == pytest.approx(0.051) and dev["idle_share"] == pytest.approx(1 - 102 / 200)
    assert dev["ms_by_kind"] == pytest.approx(
        {"matmul": 0.030, "attention": 0.010, "other": 0.010, "optimizer": 0.005, "memory copy/set": 0.001}
    )
    assert dev["kernels"] == 4 and dev["device_to_host_copies"] == 1
    assert s["launches"] == 4 and s["host_syncs"] == {"cudaStreamSynchronize": 1}
    assert s["launches_by_correlation"] == 4  # the graph launch has no kernel here; the INVALID call has
    assert s["host_ops_ms_by_kind"] == pytest.approx({"matmul": 0.006, "optimizer": 0.005, "other": 0.012})
    assert s["host_outside_ops_ms"] == pytest.approx(0.1 - 0.015)  # the stepping thread's own
    assert s["host_other_threads_ops_ms"] == pytest.approx(0.008)
    text = "\n".join(describe(s))
    assert "idle 49 %" in text and "4 kernel launches" in text and "cudaStreamSynchronize 1" in text
    assert "waiting for backward" in text


def test_a_cuda_profile_without_kernels_is_called_incomplete():
    s = summarize_trace([_x("user_annotation", STEP_MARK, 0, 100), _x("cpu_op", "aten::mm", 1, 50)])
    assert "device" not in s and "no device activity" in "\n".join(describe(s))
    s["cuda"] = True
    assert "the trace is incomplete" in "\n".join(describe(s))


def test_kernel_and_operator_names_fall_in_their_kinds():
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert kind_of("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert kind_of("aten::mm") == "matmul" and kind_of("aten::mm_backward") == "other"
    assert kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert kind_of("triton_poi_fused_add_native_dropout_0") == "other"


def test_a_trace_without_step_marks_is_refused():
    with pytest.raises(ValueError, match=STEP_MARK):
        summarize_trace([_x("cpu_op", "aten::mm", 0, 5)])


def test_a_real_cpu_profile(tmp_path):
    import torch

    lin = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(lin.parameters(), foreach=True)

    def step(_):
        lin(torch.randn(32, 64)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    s = profile_steps(step, 3, str(tmp_path / "trace.json"), cuda=False)
    assert s["steps"] == 3 and "device" not in s and (tmp_path / "trace.json").stat().st_size > 0
    assert s["host_ops_ms_by_kind"]["matmul"] > 0 and s["host_ops_ms_by_kind"]["optimizer"] > 0
    assert 0 < sum(s["host_ops_ms_by_kind"].values()) + s["host_outside_ops_ms"] <= s["step_ms"] * 1.001
    assert "no device activity" in "\n".join(describe(s))
