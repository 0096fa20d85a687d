"""Tests of ``timeline.predict``: a recorded trace replayed on a modelled GPU."""

from __future__ import annotations

import json

import pytest
import torch

from torchTensorRef import predict_run
from torchTensorRef.analysis import gpus, timeline
from torchTensorRef import tensorsManager
from paired import budget


def _train(steps=2, managed="96KiB", strategy="flow"):
    tensorsManager.strategy = strategy
    tensorsManager.budget = budget(managed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    x = torch.rand(16, 64)
    model(x).square().mean().backward()  # warm-up: the first step pins and allocates
    with tensorsManager.recording() as trace:
        for _ in range(steps):
            model(x).square().mean().backward()
            trace.mark()
    return trace


def _fast(**fields):
    """A GPU with the H100 PCIe's numbers but ``fields``."""
    return gpus.resolve({"base": "h100-pcie", "name": "test", **fields})


def test_lanes_add_up():
    trace = _train()
    p = timeline.predict(trace, "rtx-4090")
    assert p.steps == 2
    lanes = p.lanes
    assert lanes["compute"] == pytest.approx(p.compute_seconds)
    assert lanes["host"] == pytest.approx(p.host_seconds)
    assert lanes["host-to-device"] + lanes["device-to-host"] == pytest.approx(p.transfer_seconds)
    # Each instant some lane is busy, and no lane is busy longer than the step.
    assert max(lanes.values()) <= p.step_seconds * (1 + 1e-9)
    assert p.step_seconds <= sum(lanes.values()) * (1 + 1e-9)
    assert p.host_seconds >= p.host_ours_seconds + p.host_program_seconds
    assert p.host_ours_seconds > 0 and p.host_program_seconds > 0
    # The compute lane is idle for the stalls at most.
    assert p.stalls["copy"] + p.stalls["host"] <= p.step_seconds - p.compute_seconds + 1e-12


def test_moves_cost_transfer_time_that_all_resident_does_not():
    trace = _train()
    recorded = timeline.predict(trace, "h100-pcie")
    resident = timeline.predict(trace, "h100-pcie", scenario="resident")
    assert recorded.bytes_to_device > 0 and recorded.transfer_seconds > 0
    assert resident.transfer_seconds == 0 and resident.bytes_to_device == 0
    assert resident.host_ours_seconds == 0
    assert recorded.step_seconds > resident.step_seconds
    assert recorded.compute_seconds == pytest.approx(resident.compute_seconds)
    moved = trace.bytes_moved()
    assert recorded.bytes_to_device * recorded.steps == moved["to_device"]


def test_bound_is_compute_or_bytes_over_the_link():
    trace = _train()
    for gpu in ("h100-pcie", "t4", _fast(h2d_pinned_gb_s=0.001)):
        p = timeline.predict(trace, gpu)
        spec = gpus.resolve(gpu)
        expected = max(p.compute_seconds, p.bytes_to_device / (spec.h2d_pinned_gb_s * 1e9),
                       p.bytes_to_host / (spec.d2h_pinned_gb_s * 1e9))
        assert p.bound_seconds == pytest.approx(expected)
        assert p.step_seconds >= p.bound_seconds
    slow_link = timeline.predict(trace, _fast(h2d_pinned_gb_s=0.001))
    assert slow_link.bound_seconds > slow_link.compute_seconds


def test_flops_of_a_recorded_mm():
    m, k, n = 48, 40, 24
    a, b = torch.rand(m, k), torch.rand(k, n)
    with tensorsManager.recording() as trace:
        torch.mm(a, b)
    (index,) = [i for i, name, _s, _e in trace.ops if name == "aten.mm.default"]
    kernel = trace.kernels[index]
    assert kernel.flops == 2 * m * n * k
    assert kernel.nbytes == 4 * (m * k + k * n + m * n)
    assert kernel.launches and not kernel.half and not kernel.sync
    # A GPU with a slow fp32 rate and fast memory: the mm is compute-bound.
    gpu = _fast(tflops_32=1e-6, memory_gb_s=1e6)
    p = timeline.predict(trace, gpu)
    assert p.flops == 2 * m * n * k
    assert p.compute_seconds == pytest.approx(2 * m * n * k / 1e6)


def test_views_launch_nothing():
    a = torch.rand(8, 8)
    with tensorsManager.recording() as trace:
        a.t()
    (kernel,) = trace.kernels.values()
    assert not kernel.launches and kernel.nbytes == 0
    assert timeline.predict(trace, "l4").compute_seconds == 0


def test_memory_bound_op_uses_the_bandwidth():
    a = torch.rand(1000)
    with tensorsManager.recording() as trace:
        a + 1
    gpu = _fast(memory_gb_s=1e-3)  # 1 MB/s
    p = timeline.predict(trace, gpu)
    assert p.compute_seconds == pytest.approx(8000 / 1e6)


def test_half_precision_uses_the_tensor_core_peak():
    a, b = torch.rand(32, 32, dtype=torch.bfloat16), torch.rand(32, 32, dtype=torch.bfloat16)
    with tensorsManager.recording() as trace:
        torch.mm(a, b)
    gpu = _fast(tflops_16=1e-6, tflops_32=1e-9, memory_gb_s=1e6)
    assert timeline.predict(trace, gpu).compute_seconds == pytest.approx(2 * 32 ** 3 / 1e6)


def test_as_half_halves_the_bytes_and_uses_the_16_bit_peak():
    trace = _train()
    full = timeline.predict(trace, "h100-pcie")
    half = timeline.predict(trace, "h100-pcie", as_half=True)
    assert half.bytes_to_device == pytest.approx(full.bytes_to_device / 2)
    slow32 = _fast(tflops_32=1e-9, memory_gb_s=1e6)
    half_compute = timeline.predict(trace, slow32, as_half=True).compute_seconds
    assert half_compute < timeline.predict(trace, slow32).compute_seconds


def _fetches(pinned_limit):
    tensorsManager.strategy = "genoa"  # every op fetches its inputs: ordered copies
    tensorsManager.pinned_limit = pinned_limit
    a = torch.rand(256, 256)
    b = torch.rand(256, 256)
    (a + b).sum()
    with tensorsManager.recording() as trace:
        (a + b).sum()
    return trace


def test_pinned_copies_are_faster_than_pageable():
    before = tensorsManager.pinned_limit
    try:
        pinned = _fetches("1GiB")
        pageable = _fetches(0)
    finally:
        tensorsManager.pinned_limit = before
    assert "blocking" not in pinned.move_modes and "ordered" in pinned.move_modes
    assert "blocking" in pageable.move_modes
    assert pinned.bytes_moved() == pageable.bytes_moved()
    p, q = timeline.predict(pinned, "rtx-3090"), timeline.predict(pageable, "rtx-3090")
    assert p.transfer_seconds < q.transfer_seconds
    assert p.host_wait_seconds < q.host_wait_seconds  # the host waits for a pageable copy


def test_item_makes_the_host_wait():
    tensorsManager.strategy = "flow"  # no budget: nothing moves, only .item() syncs
    a = torch.rand(64, 64)
    slow = _fast(tflops_32=1e-3, memory_gb_s=1e-3)  # every kernel takes long
    with tensorsManager.recording() as trace:
        s = torch.mm(a, a).sum()
    assert timeline.predict(trace, slow).host_wait_seconds == 0
    with tensorsManager.recording() as trace:
        torch.mm(a, a).sum().item()
    (sync,) = [k for k in trace.kernels.values() if k.sync]
    p = timeline.predict(trace, slow)
    assert p.host_wait_seconds > 0
    assert p.step_seconds == pytest.approx(p.lanes["host"] + p.host_wait_seconds, rel=1e-6)
    del s


def test_chrome_trace_has_the_four_lanes(tmp_path):
    trace = _train(managed="96KiB", strategy="genoa")
    p = timeline.predict(trace, "a100-sxm")
    path = p.save(tmp_path / "predicted.json")
    events = json.load(open(path))["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(timeline.LANES)
    used = {names[e["tid"]] for e in events if e["ph"] == "X"}
    assert used == set(timeline.LANES)
    compute = sum(e["dur"] for e in events if e["ph"] == "X" and names[e["tid"]] == "compute")
    assert compute / 1e6 / p.steps == pytest.approx(p.compute_seconds, rel=1e-6)


def test_the_table_has_the_gpus_with_their_sources():
    table = gpus.table()
    for name in ("h100-sxm", "h100-pcie", "a100-sxm", "l4", "rtx-4090", "rtx-3090", "rtx-3060-12gb", "t4"):
        row = table[name]
        assert row.source and row.link.startswith("PCIe")
        assert row.h2d_pageable_gb_s < row.h2d_pinned_gb_s
    assert table["h100-sxm"].tflops_16 > table["h100-pcie"].tflops_16 > table["t4"].tflops_16


def test_user_supplied_numbers():
    trace = _train()
    mine = {"name": "mine", "memory_gib": 16, "tflops_16": 100, "tflops_32": 10, "memory_gb_s": 500,
            "h2d_pinned_gb_s": 10, "d2h_pinned_gb_s": 10, "h2d_pageable_gb_s": 5, "d2h_pageable_gb_s": 5}
    p = timeline.predict(trace, mine)
    assert p.gpu.name == "mine" and p.gpu.source == "user-supplied"
    q = timeline.predict(trace, dict(mine, h2d_pinned_gb_s=1, d2h_pinned_gb_s=1, h2d_pageable_gb_s=0.5,
                                      d2h_pageable_gb_s=0.5))
    assert q.transfer_seconds > p.transfer_seconds


@pytest.mark.parametrize("gpu, message", [
    ("h200-nvl", "unknown GPU 'h200-nvl': accepted are h100-sxm, h100-pcie"),
    ({"base": "t4", "tflops": 3}, "unknown GPU field(s) tflops: accepted are base, name"),
    ({"name": "x", "tflops_16": 3}, "GPU 'x' needs memory_gib, tflops_32"),
    ({"base": "t4", "memory_gb_s": -1}, "memory_gb_s must be a positive number (got: -1)"),
    ({"base": "nope"}, "unknown GPU 'nope'"),
])
def test_bad_gpus_say_what_is_accepted(gpu, message):
    with pytest.raises(ValueError) as e:
        gpus.resolve(gpu)
    assert message in str(e.value)


def test_bad_arguments():
    trace = _train(steps=1)
    with pytest.raises(ValueError, match="unknown scenario 'offload': accepted are recorded, resident, cpu_offload"):
        timeline.predict(trace, scenario="offload")
    with pytest.raises(ValueError, match=r"steps must be a positive int \(got: 0\)"):
        timeline.predict(trace, steps=0)
    with pytest.raises(ValueError, match=r"host_scale must be a number >= 0 \(got: -1\)"):
        timeline.predict(trace, host_scale=-1)
    with pytest.raises(TypeError, match="gpu must be a name, a GPU or a dict"):
        timeline.predict(trace, 3)


def test_all_resident_leaves_out_the_proxy_entry_cost():
    trace = _train(steps=1)
    assert timeline.predict(trace, scenario="resident").host_program_seconds == pytest.approx(
        timeline.predict(trace).host_program_seconds)
    entry = predict_run.proxy_entry_ns()
    assert entry > 0  # a Python tensor subclass costs host time per op
    trace.entry_ns = entry
    recorded = timeline.predict(trace)
    resident = timeline.predict(trace, scenario="resident")
    assert recorded.host_program_seconds > resident.host_program_seconds
    assert resident.host_program_seconds >= recorded.host_program_seconds - len(trace.ops) * entry / 1e9 - 1e-12


def test_deferred_simulated_copies_are_not_host_time():
    # About "sim" itself (its copies run when waited on): on sim whatever the test device.
    tensorsManager.device = "sim"
    trace = _train(steps=3, managed="96KiB", strategy="flow")
    assert "async" in trace.move_modes  # Flow prefetched
    assert trace.hidden_copies  # ... and "sim" ran those copies when they were waited on
    for start, end in trace.hidden_copies:
        assert trace.t0 <= start <= end <= trace.t_end
    with_copies = timeline.predict(trace)
    trace.hidden_copies = []
    assert timeline.predict(trace).host_ours_seconds > with_copies.host_ours_seconds


def test_host_scale_scales_the_measured_host_time():
    trace = _train()
    p = timeline.predict(trace, "h100-pcie")
    q = timeline.predict(trace, "h100-pcie", host_scale=0.5)
    assert q.host_ours_seconds == pytest.approx(p.host_ours_seconds / 2)
    assert q.host_program_seconds == pytest.approx(p.host_program_seconds / 2)
    assert q.compute_seconds == pytest.approx(p.compute_seconds)
    assert q.step_seconds < p.step_seconds


def test_host_scale_zero_leaves_the_schedule_of_kernels_and_copies():
    trace = _train(steps=3, managed="96KiB", strategy="flow")
    p = timeline.predict(trace, "h100-pcie")
    q = timeline.predict(trace, "h100-pcie", host_scale=0)
    assert q.host_ours_seconds == q.host_program_seconds == 0
    # only the modelled launches are left on the host: one per kernel and one per copy
    copies = sum(1 for (_k, _b, n, _s, _e), mode in zip(trace.moves, trace.move_modes) if n and mode != "drop")
    assert q.host_seconds == pytest.approx(q.kernels * timeline.LAUNCH_HOST + copies / q.steps * timeline.COPY_HOST)
    assert (q.compute_seconds, q.transfer_seconds, q.bound_seconds) == pytest.approx(
        (p.compute_seconds, p.transfer_seconds, p.bound_seconds))
    assert q.bound_seconds <= q.step_seconds < p.step_seconds


def _hand_trace():
    """One op on "sim": entered at 1 µs, kernel 3-7 µs (of which 1 µs measuring it), exits at
    8 µs; then an ordered copy in from 8 to 9 µs; the recording stops at 10 µs."""
    from torchTensorRef.analysis.op_cost import Kernel
    from torchTensorRef.analysis.trace import Trace

    trace = Trace("sim", None)
    trace.t0 = 0
    trace.entries[0] = 1000
    trace.ops.append((0, "aten.add.Tensor", 2000, 8000))
    trace.kernels[0] = Kernel(3000, 7000, 0, 4000, False, True, False)
    trace.measure_ns = 1000
    trace.moves.append(("to_device", 7, 4000, 8000, 9000))
    trace.move_modes.append("ordered")
    trace.t_end = 10000
    return trace


def test_host_time_from_an_unrecorded_run():
    trace = _hand_trace()
    # Recorded host: ours 1-3 and 7-8 µs, the program's 0-1 and 9-10 µs: 5 µs. Device work
    # on the recording machine: the kernel less its measuring, 3 µs, and the copy, 1 µs.
    p = timeline.predict(trace, "h100-pcie")
    assert p.host_unrecorded_scale == 1.0
    assert p.host_ours_seconds == pytest.approx(3e-6)
    assert p.host_program_seconds == pytest.approx(2e-6)
    # Unrecorded, 2 steps took 10 µs: 5 µs each, of which 4 µs device work: 1 µs of host.
    trace.set_unrecorded(2, 10_000)
    assert timeline.unrecorded_scale(trace) == pytest.approx(1 / 5)
    q = timeline.predict(trace, "h100-pcie")
    assert q.host_unrecorded_scale == pytest.approx(1 / 5)
    assert q.host_ours_seconds == pytest.approx(0.6e-6)
    assert q.host_program_seconds == pytest.approx(0.4e-6)
    assert q.host_seconds == pytest.approx(1e-6 + timeline.LAUNCH_HOST + timeline.COPY_HOST)
    assert q.compute_seconds == pytest.approx(p.compute_seconds)
    # unrecorded=False keeps the recording's; host_scale applies on top of the measured one
    assert timeline.predict(trace, "h100-pcie", unrecorded=False).host_ours_seconds == pytest.approx(3e-6)
    assert timeline.predict(trace, "h100-pcie", host_scale=0.5).host_ours_seconds == pytest.approx(0.3e-6)
    # all-resident has no host time of ours to substitute: its program time is as recorded
    assert timeline.predict(trace, scenario="resident").host_program_seconds == pytest.approx(2e-6)
    # an unrecorded run faster than the device work recorded: no host time, not a negative one
    trace.set_unrecorded(1, 3_000)
    assert timeline.unrecorded_scale(trace) == 0.0


def test_an_unrecorded_run_is_only_known_on_sim():
    trace = _hand_trace()
    with pytest.raises(ValueError, match="steps must be a positive int"):
        trace.set_unrecorded(0, 1000)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        trace.set_unrecorded(1, 0)
    with pytest.raises(ValueError, match="no unrecorded run"):
        timeline.unrecorded_scale(trace)
    trace.device = "cuda"
    with pytest.raises(ValueError, match="only known on 'sim'"):
        trace.set_unrecorded(1, 1000)


def test_the_bounding_lane_is_named():
    trace = _train()
    p = timeline.predict(trace, "h100-pcie")
    assert p.bottleneck in timeline.LANES and p.lanes[p.bottleneck] == max(p.lanes.values())
    assert timeline.predict(trace, _fast(tflops_32=1e-6)).bound_lane == "compute"
    assert timeline.predict(trace, _fast(h2d_pinned_gb_s=1e-6)).bound_lane == "host-to-device"
    assert timeline.predict(trace, _fast(d2h_pinned_gb_s=1e-9)).bound_lane == "device-to-host"
    summary = p.summary()
    assert summary["bound_lane"] == p.bound_lane and summary["bottleneck"] == p.bottleneck


@pytest.mark.parametrize("device, row", [
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA A100-SXM4-80GB", "a100-sxm"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie"), ("NVIDIA L4", "l4"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("Tesla T4", "t4"), ("NVIDIA GeForce RTX 3060", "rtx-3060-12gb"), ("NVIDIA H200", "h200"),
    # other GPUs than the rows: no guess
    ("NVIDIA L40S", None), ("NVIDIA GeForce RTX 3060 Ti", None), ("NVIDIA A100-SXM4-40GB", None),
    ("NVIDIA H200 NVL", None),
])
def test_the_row_of_a_cuda_device_name(device, row):
    assert gpus.for_device(device) == row
