"""Smoke runs of the benchmark harnesses on "sim" with tiny models: they run, their byte counts agree.

Timings are never checked (they depend on the machine); the bytes are exact.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import pytest
import torch

import torchTensorRef
from torchTensorRef.analysis import timeline

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import (common, cuda_peak, cuda_timeline, gpu_throughput, moe_decode, op_paths, optimizer_step,  # noqa: E402
                        overhead, overshoot_plugin, plots, region_anatomy, region_calls, region_instructions,
                        regions_flow, run_all, small_ops, train_budget, train_instructions, train_parts, transfer)

METADATA = ("device", "torch", "date", "command")


def _moved(row):
    return row["bytes_to_device"] + row["bytes_to_host"]


@pytest.fixture(scope="module")
def transfer_result(tmp_path_factory):
    path = tmp_path_factory.mktemp("transfer") / "transfer.json"
    result = transfer.main(["--quick", "--models", "gpt2", "--fractions", "0.5", "--json", str(path)])
    return result, path


def test_transfer_writes_json_with_metadata(transfer_result):
    result, path = transfer_result
    with open(path) as f:
        saved = json.load(f)
    for key in METADATA:
        assert saved[key], key
    assert saved["command"].startswith("python benchmarks/transfer.py --quick")
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))


def test_transfer_flow_between_reference_and_genoa(transfer_result):
    rows = transfer_result[0]["rows"]
    for workload in transfer.WORKLOADS:
        flow = transfer._find(rows, "gpt2", workload, "flow", 0.5)
        genoa = transfer._find(rows, "gpt2", workload, "genoa", 0.5)
        for r in (flow, genoa):
            assert r["equal_to_plain"], r
            assert r["peak_device_bytes"] <= r["budget"]
            assert r["moved"] == _moved(r)
            # Belady's rule with blocks of different sizes is no proven optimum: a pager may
            # beat it by a little, never by much (byte accounting gone wrong would)
            assert r["moved"] >= 0.98 * r["reference_moved"], r
        assert flow["moved"] <= genoa["moved"], (flow, genoa)


def test_transfer_counts_accelerate_copies(transfer_result):
    rows = transfer_result[0]["rows"]
    tokens = transfer.SIZES["quick"]["tokens"]
    train = transfer._find(rows, "gpt2", "train", "accelerate")
    gen = transfer._find(rows, "gpt2", "generate", "accelerate")
    # every forward copies every weight in (the tied embedding twice): at least the parameter bytes
    assert train["forward_only"] and train["moved"] >= train["param_bytes"]
    assert not gen["forward_only"] and gen["equal_to_plain"]
    assert gen["moved"] == tokens * train["moved"]  # one forward per new token, each copying the same


def test_accelerate_counter_against_parameter_bytes():
    model = common.llama(layers=2, hidden=16, intermediate=32, vocab=64, heads=2, kv_heads=1, positions=16)
    ids = common.plain_inputs(0, 64, 1, 4)
    counter = common.AccelerateCopies()
    with counter.counting():
        offloaded = common.offloaded_copy(model, "cpu")
        counter.reset()
        with torch.no_grad(), torchTensorRef.disabled():
            offloaded(ids)
    # untied Llama: each parameter is copied exactly once per forward; buffers stay put
    assert counter.bytes == common.param_bytes(model)
    assert counter.calls == len(list(model.parameters()))


def test_transfer_plot(transfer_result, tmp_path):
    pytest.importorskip("matplotlib")
    path = plots.plot("transfer", transfer_result[0], str(tmp_path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gpu_result(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "gpu.json"
    tm = torchTensorRef.tensorsManager
    previous = tm.sim_rounding, tm.sim_workspace
    # As on a GPU: allocations rounded up as CUDA's allocator rounds them, workspaces outside
    # the manager (the real peaks are checked against the budget below)
    tm.sim_rounding, tm.sim_workspace = True, 64 * 1024
    try:
        result = gpu_throughput.main(["--device", "sim", "--tiny", "--fractions", "0.5", "--json", str(path)])
    finally:
        tm.sim_rounding, tm.sim_workspace = previous
    return result, path


def test_gpu_throughput_harness_on_sim(gpu_result):
    result, path = gpu_result
    with open(path) as f:
        saved = json.load(f)
    for key in METADATA:
        assert saved[key], key
    rows = {(r["config"], r["budget_fraction"]): r for r in result["rows"]}
    size = gpu_throughput.SIZES["tiny"]
    wbytes = result["weight_bytes"]
    for (config, _f), r in rows.items():
        for workload in ("generate", "train"):
            assert "error" not in r[workload], (config, workload, r[workload])
    assert rows[("resident", None)]["generate"]["moved"] == 0
    # (at half the weights the budget pages: a loop with a region per layer; with none, one region)
    assert rows[("flow", 0.5)]["generate"]["paged"] and not rows[("flow", None)]["generate"]["paged"]
    assert rows[("flow", None)]["generate"]["manager_ops"] < rows[("flow", 0.5)]["generate"]["manager_ops"]
    assert all(r["generate"]["outside_after"] >= 0 for (c, _f), r in rows.items() if c in ("flow", "genoa"))
    assert rows[("resident", None)]["train"]["moved"] == 0
    assert "skipped" in rows[("accelerate", None)]["train"]
    # accelerate copies all weights for every forward: the prompt's and one per further token
    assert rows[("accelerate", None)]["generate"]["moved"] == size["tokens"] * wbytes
    flow, genoa = rows[("flow", 0.5)], rows[("genoa", 0.5)]
    for workload in ("generate", "train"):
        assert flow[workload]["moved"] <= genoa[workload]["moved"]
        for r in (flow, genoa):
            assert r[workload]["peak"] <= r["budget"]  # (the most the device held, workspaces included)
            assert r[workload]["bound_seconds"] >= r[workload]["transfer_seconds"]
    assert flow["generate"]["tokens_equal_resident"] and genoa["generate"]["tokens_equal_resident"]
    assert flow["train"]["losses_equal_resident"]
    for workload in ("generate", "train"):  # (whether each managed row was timed settled, and how it prefetched)
        assert isinstance(flow[workload]["settled"], bool) and isinstance(flow[workload]["evicts_ahead"], bool)
        assert genoa[workload]["settled"] is True and genoa[workload]["evicts_ahead"] is None
    # (step by step, as far as both ran: every step of the resident row, Flow's warming up longer)
    assert len(flow["train"]["losses"]) >= len(rows[("resident", None)]["train"]["losses"])
    # each measured row has its prediction beside it, on the row the --gpu flag names (h100-pcie on sim)
    assert saved["predicted_on"] == "h100-pcie" and "not measured" in saved["predicted_note"]
    for (config, _f), r in rows.items():
        for workload in ("generate", "train"):
            if "skipped" in r[workload]:
                continue
            m, p = r[workload], r[workload]["predicted"]
            assert p["gpu"] == "h100-pcie" and p["step_seconds"] >= p["bound_seconds"] > 0, (config, workload)
            assert p["bottleneck"] in timeline.LANES
            assert m["predicted_to_measured"] == pytest.approx(p["seconds"] / m["seconds"])
    assert rows[("resident", None)]["generate"]["predicted"]["moved"] == 0
    assert rows[("flow", 0.5)]["generate"]["predicted"]["moved"] > 0
    assert rows[("flow", 0.5)]["train"]["predicted"]["host_unrecorded_scale"] != 1  # timed unrecorded on sim
    # accelerate's hooks modelled from the module calls: every weight before each forward, as measured
    assert rows[("accelerate", None)]["generate"]["predicted"]["moved"] == size["tokens"] * wbytes
    assert {c["check"] for c in result["checks"]} >= {"flow 50% generate: bound / time",
                                                      "flow 50% generate: tokens/s vs accelerate",
                                                      "flow 50% train: real peak / budget",
                                                      "flow no budget generate: vs all-resident",
                                                      "flow no budget train: vs all-resident"}
    # managed with no budget: nothing moves, the tokens and losses are all-resident's
    free = rows[("flow", None)]
    assert free["budget"] is None and free["generate"]["moved"] == 0 and free["train"]["moved"] == 0
    assert free["generate"]["tokens_equal_resident"]
    assert free["train"]["losses_equal_resident"]


def test_gpu_throughput_per_op_runs_the_managed_rows_op_by_op(gpu_result, tmp_path):
    args = ["--device", "sim", "--tiny", "--fractions", "0.5", "--strategies", "flow", "--workloads", "generate"]
    per_op = gpu_throughput.main(args + ["--per-op", "--json", str(tmp_path / "per_op.json")])
    assert torchTensorRef.regions.enabled  # (given back)
    assert gpu_result[0]["regions"] is True and per_op["regions"] is False
    flow = {(r["config"], r["budget_fraction"]): r for r in per_op["rows"]}[("flow", 0.5)]["generate"]
    with_regions = {(r["config"], r["budget_fraction"]): r for r in gpu_result[0]["rows"]}[("flow", 0.5)]["generate"]
    assert flow["tokens_equal_resident"]
    # a region is one op of the manager: op by op, the same generate() runs many more
    assert flow["manager_ops"] > 2 * with_regions["manager_ops"] > 0


def test_gpu_throughput_no_predict_measures_without_recording():
    args = ["--device", "sim", "--tiny", "--fractions", "0.5", "--strategies", "flow", "--workloads", "generate",
            "--no-predict"]
    result = gpu_throughput.main(args)
    assert "predicted_on" not in result
    rows = {(r["config"], r["budget_fraction"]): r for r in result["rows"]}
    for row in rows.values():
        assert "error" not in row["generate"] and "predicted" not in row["generate"], row
    assert rows[("flow", 0.5)]["generate"]["tokens_equal_resident"]


def test_gpu_throughput_counts_the_moves_of_each_managed_row_and_offers_evicting_prefetches():
    args = ["--device", "sim", "--tiny", "--fractions", "0.5", "--strategies", "flow-free", "flow-evicting",
            "--workloads", "generate", "--no-predict"]
    result = gpu_throughput.main(args)
    rows = {(r["config"], r["budget_fraction"]): r for r in result["rows"]}
    plain, free = rows[("resident", None)]["generate"], rows[("flow-free", None)]["generate"]
    flow, evicting = rows[("flow-free", 0.5)]["generate"], rows[("flow-evicting", 0.5)]["generate"]
    for m in (plain, flow, evicting):  # the median of the timed calls
        assert len(m["call_seconds"]) == gpu_throughput.SIZES["tiny"]["timed_calls"]
        assert m["seconds"] == statistics.median(m["call_seconds"])
    assert "counters" not in plain and free["counters"]["fetches"] == 0 == free["counters"]["evictions"]
    assert flow["tokens_equal_resident"] and evicting["tokens_equal_resident"]
    assert flow["moved"] > 0 and flow["counters"]["evictions"] > 0
    # prefetches that may evict bring in ahead most of what Flow filling free memory only
    # fetches when it is needed
    assert evicting["counters"]["prefetches"] > flow["counters"]["prefetches"]
    assert evicting["counters"]["fetches"] < flow["counters"]["fetches"]
    assert evicting["peak_to_budget"] <= 1.0


def test_gpu_throughput_plot(gpu_result, tmp_path):
    pytest.importorskip("matplotlib")
    path = plots.plot("gpu_throughput", gpu_result[0], str(tmp_path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_gpu_throughput_unknown_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        gpu_throughput.main(["--device", "sim", "--tiny", "--gpu", "h200-nvl"])
    assert info.value.code == 2
    assert "--gpu: unknown GPU 'h200-nvl': accepted are h100-sxm" in capsys.readouterr().err


def test_gpu_throughput_without_cuda_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = gpu_throughput.main([])
    assert "needs CUDA" in capsys.readouterr().out
    assert "needs CUDA" in result["skipped"]


def test_overhead_harness_runs_and_outputs_match(tmp_path):
    path = tmp_path / "overhead.json"
    result = overhead.main(["--layers", "1", "--width", "64", "--seq", "8", "--vocab", "64", "--repeats", "1",
                            "--small-op-calls", "50", "--json", str(path)])
    assert result["outputs_equal"] == {"pass-through": True, "sim": True, "minimal subclass": True}
    assert result["ops_per_forward"] > 10
    assert result["bytes_to_device_per_forward"]["pass-through"] == 0
    assert set(result["small_op"]) == {"pass-through", "sim", "sim, Flow with a 1 GiB budget"}
    with open(path) as f:
        saved = json.load(f)
    for key in METADATA:
        assert saved[key], key
    assert saved["command"].startswith("python benchmarks/overhead.py --layers 1")
    assert saved["result"]["ratio_sim"] == result["ratio_sim"]


def test_small_ops_tiny_run_times_every_row_within_its_budget_equal_to_plain(tmp_path):
    # One test for the one run (the suite's slowest harness run): split across tests, a
    # module fixture would run it again on each pytest-xdist worker its tests land on.
    png = tmp_path / "small_ops.png" if _has_matplotlib() else None
    path = tmp_path / "small_ops.json"
    result = small_ops.main(["--size", "tiny", "--json", str(path)] + (["--plot", str(png)] if png else []))
    _small_ops_every_row_timed_and_equal_to_plain(path)
    _small_ops_budgets_and_bytes(result)
    _small_ops_region_rows_match_plain_torch_within_their_budgets(result)
    if png is not None:  # (matplotlib is in the test extra; without it no plot is asked for)
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_small_ops_layers_sets_the_models_depth(capsys):
    def run(*extra):
        result = small_ops.main(["--size", "tiny", "--regions-only", "--rows", "sim, Flow, 50%, regions",
                                 "--work", "decode", "--repeats", "1", *extra])
        rows = [r for w in result["works"] for r in w["region_rows"]]  # (the Llama's, GPT-2's)
        assert len(rows) == 2 and all(r["equal"] and r["peak_device_bytes"] <= r["budget"] for r in rows), rows
        return result, rows[0]

    default, shallow = run()
    deep, row = run("--layers", "4")
    assert (default["llama"]["layers"], deep["llama"]["layers"], deep["gpt2"]["layers"]) == (2, 4, 4)
    assert row["budget"] > shallow["budget"]  # (half the weights: the deeper model's are more)
    with pytest.raises(SystemExit):
        small_ops.main(["--size", "tiny", "--layers", "0"])
    assert "--layers must be a whole number of decoder layers >= 1, not 0" in capsys.readouterr().err


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _small_ops_every_row_timed_and_equal_to_plain(path):
    with open(path) as f:
        saved = json.load(f)
    for key in METADATA:
        assert saved[key], key
    assert saved["command"].startswith("python benchmarks/small_ops.py --size tiny")
    assert saved["result"]["outputs_equal"] is True
    works = saved["result"]["works"]
    assert [w["work"] for w in works] == ["llama decode", "gpt2 decode", "llama serve", "llama train"]
    for work in works:
        assert [r["row"] for r in work["rows"]] == [label for label, *_ in small_ops.ROWS]
        for r in work["rows"]:
            assert r["fits"], (work["work"], r)  # tiny models: even 25% holds the largest op
            assert 0 < r["fastest_ms"] <= r["median_ms"], r
            assert r["ratio"] > 0 and r["ratio_of_fastest"] > 0
            assert r["ops"] > 10 and r["outputs_equal"], r


def _small_ops_budgets_and_bytes(result):
    for work in result["works"]:
        rows = {r["row"]: r for r in work["rows"]}
        base = work["budget_base_bytes"]
        if work["kind"] == "train":  # weights, grads, AdamW state and activations
            assert base == rows["sim, no budget"]["peak_device_bytes"] > 4 * work["param_bytes"]
        else:
            assert base == work["param_bytes"]
        assert rows["pass-through"]["bytes_moved"] == 0
        assert rows["sim, Flow, 2x (fits)"]["budget"] == 2 * base
        for r in work["rows"]:
            if r["budget"] is not None:
                assert r["peak_device_bytes"] <= r["budget"], r
        for fraction in ("50%", "25%"):
            flow, genoa = rows[f"sim, Flow, {fraction}"], rows[f"sim, Genoa, {fraction}"]
            assert flow["budget"] == genoa["budget"] < base
            # Genoa sends every result back after its op; Flow keeps what fits
            assert 0 < flow["bytes_moved"] <= genoa["bytes_moved"], (work["work"], flow, genoa)


def _small_ops_region_rows_match_plain_torch_within_their_budgets(result):
    for work in result["works"]:
        rows = {r["row"]: r for r in work["region_rows"]}  # (decoding, and training through regions)
        assert list(rows) == [label for label, *_ in small_ops.REGION_ROWS]
        for r in rows.values():
            assert r.get("fits") is not False and r["equal"], r
            least, most = small_ops.WARMUP
            assert least <= r["warmup_runs"] <= most, r
            if r["budget"] is not None:
                assert r["peak_device_bytes"] <= r["budget"], r
                # timed once Flow has settled (nothing to page, or its plan followed and its way of
                # prefetching chosen), or after the most warm-up runs
                assert r["settled"] or r["warmup_runs"] == most, r
            else:
                assert r["warmup_runs"] == least, r
        # regions run a module call as one op: fewer ops than the per-op path, on every device form
        for device in ("pass-through", "sim, Flow, 50%", "sim-cpu, Flow, 50%"):
            assert rows[f"{device}, regions"]["ops"] < rows[f"{device}, per op"]["ops"], device
        # a sim-cpu row's copy floor: plain plus its bytes at the host's copy rate
        for label, r in rows.items():
            assert ("copy_floor" in r) == label.startswith("sim-cpu"), label
            if "copy_floor" in r:
                plain_s = statistics.median(r["plain_times"])
                assert r["copy_floor"] == pytest.approx(1 + r["bytes_moved"] / r["host_copy_bytes_per_s"] / plain_s)
                assert r["host_copy_bytes_per_s"] > 0
                assert r["copy_floor"] > 1 if r["bytes_moved"] else r["copy_floor"] == 1  # (fits: nothing moves)
                # the time added per op beyond plain and the copies, from the same figures
                added = statistics.median(r["times"]) - plain_s - r["bytes_moved"] / r["host_copy_bytes_per_s"]
                assert r["host_us_per_op"] == pytest.approx(added / r["ops"] * 1e6)
        # the lenient form pages as "sim" does: the same budget, bytes moved alike (decoding:
        # a tiny training step moves a few bytes, where a scalar's block lands differs)
        for fraction in ("50%", "25%") if work["kind"] != "train" else ():
            strict, lenient = rows[f"sim, Flow, {fraction}, per op"], rows[f"sim-cpu, Flow, {fraction}, per op"]
            assert strict["budget"] == lenient["budget"] and lenient["bytes_moved"] > 0
            assert abs(lenient["bytes_moved"] - strict["bytes_moved"]) <= 0.1 * strict["bytes_moved"]


def test_small_ops_rows_picks_the_region_rows_by_label():
    result = small_ops.main(["--size", "tiny", "--work", "decode", "--regions-only", "--rows", "sim-cpu, Flow, 50%"])
    for work in result["works"]:
        assert [r["row"] for r in work["region_rows"]] == ["sim-cpu, Flow, 50%, per op", "sim-cpu, Flow, 50%, regions"]
        assert all(r["equal"] and r["bytes_moved"] > 0 for r in work["region_rows"])


def test_small_ops_budget_too_small_does_not_fit(monkeypatch, capsys):
    monkeypatch.setattr(small_ops, "ROWS", small_ops.ROWS[:1] + (("sim, Flow, 0.1%", "sim", "flow", 0.001),))
    result = small_ops.main(["--size", "tiny", "--work", "decode", "--no-regions"])
    for work in result["works"]:
        row = work["rows"][1]
        assert not row["fits"] and "budget" in row["error"].lower(), row
    assert "does not fit" in capsys.readouterr().out


def test_small_ops_mismatch_exits_non_zero(monkeypatch, capsys):
    monkeypatch.setattr(small_ops, "ROWS", small_ops.ROWS[:2])
    monkeypatch.setattr(small_ops, "outputs_equal", lambda outs, expected: False)
    with pytest.raises(SystemExit) as exit_:
        small_ops.main(["--size", "tiny", "--work", "train", "--no-regions"])
    assert exit_.value.code == 1
    assert "DIFFER FROM PLAIN" in capsys.readouterr().out


def test_minimal_wrapper_computes_as_plain_torch():
    with torchTensorRef.disabled():
        x = torch.randn(3, 3)
        w = overhead.MinimalWrapper.wrap(x)
        got = (w @ w + 1).elem
        assert type(got) is torch.Tensor and torch.equal(got, x @ x + 1)


def test_run_all_writes_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, assets = tmp_path / "out", tmp_path / "assets"
    argv = ["--quick", "--only", "flow_vs_reference", "--out", str(out), "--assets", str(assets), "--noisy"]
    written = run_all.main(argv)
    with open(out / "flow_vs_reference.json") as f:
        saved = json.load(f)
    for key in METADATA:
        assert saved[key], key
    assert saved["command"] == "python benchmarks/run_all.py " + " ".join(argv)
    assert "noisy" in saved["note"]
    rows = saved["result"]["rows"]
    flow = next(r for r in rows if r["strategy"] == "flow")
    genoa = next(r for r in rows if r["strategy"] == "genoa")
    assert _moved(flow) <= _moved(genoa)
    assert flow["losses"] == genoa["losses"]
    png = out / "flow_vs_reference.png"
    assert written["flow_vs_reference"]["files"] == [str(out / "flow_vs_reference.json"), str(png)]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_run_all_copies_headline_plots_to_assets(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    out, assets = tmp_path / "out", tmp_path / "assets"
    monkeypatch.setattr(run_all, "HEADLINES", {"flow_vs_reference": "headline.png"})
    run_all.main(["--quick", "--only", "flow_vs_reference", "--out", str(out), "--assets", str(assets)])
    assert (assets / "headline.png").read_bytes() == (out / "flow_vs_reference.png").read_bytes()


@pytest.mark.parametrize("prefetch_evicts", [False, True], ids=["flow", "flow-prefetch-evicts"])
def test_region_calls_times_region_calls_alone_within_the_budget(fresh_manager, tmp_path, prefetch_evicts):
    path = tmp_path / "region_calls.json"
    argv = ["--layers", "8", "--width", "32", "--repeats", "3", "--json", str(path)]
    result = region_calls.main(argv + (["--prefetch-evicts"] if prefetch_evicts else []))
    rows = result["rows"]
    assert list(rows) == [label for label, _fraction in region_calls.ROWS]
    for label, r in rows.items():
        assert r["equal"], label
        assert r["calls"] == 8, label  # one op of the manager per block: region calls alone
        assert r["ms"] > 0 and r["plain_ms"] > 0 and r["copy_floor"] >= 1, label
        if r["budget"] is not None:
            assert r["peak_device_bytes"] <= r["budget"], label
    for label in ("no budget", "Flow, fits (2x)"):
        assert rows[label]["bytes_moved"] == 0 and rows[label]["fetches_per_call"] == 0
    for label in ("Flow, 50%", "Flow, 25%"):
        r = rows[label]
        assert r["plan"], label  # timed once Flow follows its plan
        assert r["bytes_moved"] > 0 and r["evictions_per_call"] > 0, label
    assert rows["Flow, 25%"]["bytes_moved"] >= rows["Flow, 50%"]["bytes_moved"]
    if prefetch_evicts:  # (at 50% the next block fits beside the current one: it comes in ahead)
        assert rows["Flow, 50%"]["ahead"] > 0.9
    with open(path) as f:
        saved = json.load(f)
    assert saved["command"].startswith("python benchmarks/region_calls.py --layers 8")
    assert saved["result"]["rows"]["Flow, 50%"]["calls"] == 8


def test_moe_decode_reads_the_experts_a_token_uses_against_every_expert(fresh_manager, tmp_path):
    # (4 layers at half the weights: a layer's experts a region, whose gathers read rows once
    # it runs op by op; every expert moves when the stacks are read whole)
    path = tmp_path / "moe.json"
    result = moe_decode.main(["--layers", "4", "--tokens", "4", "--fractions", "0.5", "--json", str(path)])
    r = result["rows"]["0.5"]
    assert r["rows"]["equal"] and r["whole"]["equal"]
    assert r["rows"]["peak_to_budget"] <= 1 and r["whole"]["peak_to_budget"] <= 1
    assert r["whole"]["mib_to_device"] > 2 * r["rows"]["mib_to_device"]
    assert set(METADATA) <= set(json.loads(path.read_text()))


def test_regions_flow_compares_flow_with_the_offline_reference_in_groups(fresh_manager, monkeypatch):
    # (16 layers at half the weights: a layer's tensors an eighth of the budget, a group; the
    # figure of docs/benchmarks/group-reference-2026-12-06.md, which counts every allocation
    # at its size: with the allocator's rounding Flow keeps room for its slack, which the
    # reference does not, and moves more, as that file says)
    monkeypatch.setattr(torchTensorRef.tensorsManager, "sim_rounding", False)
    result = regions_flow.main(["--layers", "16", "--fraction", "0.5", "--regions-only"])
    assert list(result) == ["regions"]
    last = result["regions"][-1]
    assert last["plan"] and last["groups"] > 0
    assert last["to_group_reference"] <= 1.10
    assert last["to_overlap_reference"] <= last["to_group_reference"] <= last["to_reference"]


def test_regions_flow_compares_with_the_reference_keeping_the_slack_margin(fresh_manager, monkeypatch):
    # (with the allocator's rounding the manager keeps room for its slack: at 4 layers of 256
    # at half the weights, a sixth of the share, which the group reference without that
    # margin does not keep; within the share less the margin Flow moves what it moves)
    monkeypatch.setattr(torchTensorRef.tensorsManager, "sim_rounding", True)
    last = regions_flow.main(["--layers", "4", "--width", "256", "--fraction", "0.5", "--regions-only"])["regions"][-1]
    assert 0 < last["slack"] < last["share"]
    assert last["to_margin_reference"] <= 1.10
    assert last["to_margin_reference"] <= last["to_group_reference"]


def test_regions_flow_refuses_a_width_its_heads_cannot_split():
    with pytest.raises(SystemExit):
        regions_flow.main(["--width", "100"])


def test_cuda_timeline_tells_the_device_s_busy_times_their_overlap_and_the_host_s_waits():
    E, ms = cuda_timeline.Event, 1_000_000
    assert cuda_timeline.classify("Memcpy HtoD (Pinned -> Device)", True) == "to_device"
    assert cuda_timeline.classify("Memcpy DtoH (Device -> Pageable)", True) == "to_host"
    assert cuda_timeline.classify("Memcpy DtoD (Device -> Device)", True) == "copy"
    assert cuda_timeline.classify("Memset (Device)", True) == "fill"
    assert cuda_timeline.classify("ampere_bf16_s16816gemm", True) == "kernel"
    assert cuda_timeline.classify("cudaStreamSynchronize", False) == "runtime"
    assert cuda_timeline.classify("cuMemAlloc_v2", False) == "runtime"
    assert cuda_timeline.classify("aten::mm", False) == "other"
    events = [E("kernel", "gemm", 0, 10 * ms), E("kernel", "gemm", 5 * ms, 20 * ms),
              E("to_device", "Memcpy HtoD (Pinned -> Device)", 15 * ms, 25 * ms),
              E("to_host", "Memcpy DtoH (Device -> Pageable)", 30 * ms, 40 * ms),
              E("runtime", "cudaStreamSynchronize", 41 * ms, 44 * ms),
              E("runtime", "cudaStreamSynchronize", 45 * ms, 48 * ms),
              E("runtime", "cudaLaunchKernel", 0, 1 * ms), E("other", "aten::mm", 0, 2 * ms)]
    r = cuda_timeline.summarize(events, 50 * ms, calls=1)
    assert r["kernels_ms"] == 20 and r["to_device_ms"] == 10 and r["to_host_ms"] == 10
    assert r["copies_under_kernels_ms"] == 5  # (15-20: the copy in beside the second kernel)
    assert r["idle_ms"] == 15  # (25-30 and 40-50)
    assert r["pageable_copies"] == 1 and r["copies_to_device"] == 1
    assert r["host_waits"] == {"cudaStreamSynchronize": {"count": 2, "ms": 6}}
    assert list(r["runtime_top"]) == ["cudaStreamSynchronize", "cudaLaunchKernel"]
    halves = cuda_timeline.summarize(events, 50 * ms, calls=2)
    assert halves["kernels_ms"] == 10 and halves["host_waits"]["cudaStreamSynchronize"] == {"count": 1, "ms": 3}


def test_cuda_timeline_runs_its_rows_on_sim(fresh_manager):
    result = cuda_timeline.main(["--device", "sim", "--size", "tiny", "--workloads", "train", "--calls", "1",
                                 "--host-profile", "3"])
    assert [r["row"] for r in result["rows"]] == ["resident", "flow, no budget", "flow 50%"]
    budgeted = result["rows"][-1]
    assert budgeted["budget"] is not None and budgeted["counters"]["evictions"] > 0
    for r in result["rows"]:
        assert r["wall_ms"] > 0 and r["kernels_ms"] == 0 and r["idle_ms"] == r["wall_ms"]  # (no device activity)
        assert len(r["host"]["functions"]) == 3 and r["host"]["areas"]["torch C calls"] > 0
    # (the backward's kernels are torch's C calls; paging is the manager's own Python, which
    # plain torch on the emulated device runs none of)
    resident = result["rows"][0]["host"]["areas"]
    assert budgeted["host"]["areas"]["torchTensorRef/memory"] > 10 * resident.get("torchTensorRef/memory", 0)
    assert budgeted["host"]["areas"]["torchTensorRef/strategies"] > resident.get("torchTensorRef/strategies", 0)


def test_a_host_profile_files_each_function_s_own_time_under_its_area():
    root = os.path.join(os.sep, "repo")
    area = common._area
    assert area(os.path.join(root, "torchTensorRef", "regions", "op.py"), "new", root) == "torchTensorRef/regions"
    assert area(os.path.join(root, "torchTensorRef", "memory", "sim", "tensor.py"), "f", root) \
        == "torchTensorRef/memory/sim"  # (the emulator, which a GPU does not run, apart)
    assert area(os.path.join(root, "torchTensorRef", "cli.py"), "main", root) == "torchTensorRef"
    assert area(os.path.join(root, "benchmarks", "common.py"), "f", root) == "benchmarks"
    assert area(os.path.join(root, "tests", "test_x.py"), "f", root) == "other Python"
    assert area("/venv/site-packages/torch/nn/modules/module.py", "_call_impl", root) == "torch (Python)"
    assert area("/venv/site-packages/transformers/models/llama/modeling_llama.py", "f", root) == "transformers"
    assert area("~", "<built-in method torch._C._nn.linear>", root) == "torch C calls"
    assert area("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>", root) == "torch C calls"
    assert area("~", "<built-in method builtins.isinstance>", root) == "Python built-ins"
    model = torch.nn.Linear(4, 4)
    profile = common.host_profile(lambda: [common.param_bytes(model) for _ in range(3)], repeats=4, per=2, top=50)
    rows = {where: (calls, own, inclusive) for where, calls, own, inclusive in profile["functions"]}
    (mine,) = [k for k in rows if k.startswith("benchmarks/common.py:") and k.endswith("(param_bytes)")]
    assert rows[mine][0] == 6  # (3 a run, 4 runs, per 2)
    assert rows[mine][2] >= rows[mine][1] > 0
    assert profile["areas"]["benchmarks"] >= rows[mine][1]
    assert list(profile["areas"].values()) == sorted(profile["areas"].values(), reverse=True)


def test_bytecode_counts_are_each_function_s_own_bytecodes_per_unit_and_leave_no_tracer():
    model = torch.nn.Linear(4, 4)

    def run():
        return [common.param_bytes(model) for _ in range(3)]

    tracer = sys.gettrace()  # (a coverage tool's, where one runs)
    one = common.bytecode_counts(run, repeats=1, per=1, top=500)
    four = common.bytecode_counts(run, repeats=4, per=2, top=500)
    assert sys.gettrace() is tracer
    rows = dict(four["functions"])
    (mine,) = [k for k in rows if k.startswith("benchmarks/common.py:") and k.endswith("(param_bytes)")]
    assert rows[mine] == 2 * dict(one["functions"])[mine] > 0  # (4 runs per 2: twice one run's, exactly)
    assert four["total"] == 2 * one["total"] >= sum(rows.values())
    assert four["areas"]["benchmarks"] >= rows[mine]
    assert list(four["areas"].values()) == sorted(four["areas"].values(), reverse=True)


def test_region_anatomy_counts_the_bytecodes_a_region_call_adds(fresh_manager):
    tracer = sys.gettrace()
    result = region_anatomy.main(["--layers", "4", "--width", "16", "--forwards", "10", "--budget", "0.5",
                                  "--bytecodes", "20"])
    counted = result["bytecodes"]
    assert counted["plain_per_block"] > 0 and counted["added_per_call"] > counted["plain_per_block"]
    assert len(counted["functions"]) == 20
    assert counted["areas"]["torchTensorRef/regions"] > 0 and counted["areas"]["torchTensorRef/memory"] > 0
    assert sys.gettrace() is tracer


def test_region_calls_reports_the_copies_of_region_groups(fresh_manager):
    argv = ["--layers", "32", "--width", "32", "--repeats", "3", "--prefetch-evicts"]
    grouped = region_calls.main(argv)["rows"]
    alone = region_calls.main(argv + ["--no-groups"])["rows"]
    for label in ("Flow, 50%", "Flow, 25%"):
        g, a = grouped[label], alone[label]
        assert g["equal"] and a["equal"] and g["peak_device_bytes"] <= g["budget"], label
        # a block's two weights come in with one copy, where they took two (at 25% a block's
        # group is too large beside the budget where the device rounds its tensors up: alone)
        assert g["copies_per_call"] < a["copies_per_call"] or label == "Flow, 25%", label
        assert g["copies_per_call"] <= a["copies_per_call"], label
        assert g["bytes_moved"] <= 1.10 * a["bytes_moved"], label


class _Counter:
    """Stands in for the counting library: what was counted, in order."""

    def __init__(self):
        self.calls = []

    def cg_start(self):
        self.calls.append("start")

    def cg_stop(self):
        self.calls.append("stop")


@pytest.mark.parametrize("fraction", [None, 0.5], ids=["no-budget", "flow-50"])
def test_region_instructions_counts_plain_then_the_regions_with_equal_outputs(fresh_manager, fraction):
    counter = _Counter()
    result = region_instructions.child(4, 16, 3, 8, fraction, counter)
    assert counter.calls == ["start", "stop", "start", "stop"]  # plain torch's forwards, then the managed ones
    assert result["equal"]
    assert result["ops"] == 4 * 3  # one op of the manager per block: region calls alone
    if fraction is None:
        assert result["bytes_to_device"] == 0
    else:
        assert result["bytes_to_device"] > 0  # (four blocks at half their bytes: each call brings one in)
    assert fresh_manager.budget is None  # (lifted after the row)


def test_region_instructions_reads_callgrind_s_dumps_in_their_order(tmp_path):
    out = tmp_path / "row.out"
    for n, total in ((1, 100), (2, 250), (10, 7)):
        (tmp_path / f"row.out.{n}").write_text(f"events: Ir\nsummary: 0\ntotals: {total}\n")
    (tmp_path / "row.out.log").write_text("not a dump")
    paths = region_instructions.dumps(str(out))
    assert [os.path.basename(p) for p in paths] == ["row.out.1", "row.out.2", "row.out.10"]
    assert region_instructions.totals(paths) == [100, 250, 7]
    (tmp_path / "bad.out.1").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no 'totals:' line"):
        region_instructions.totals([str(tmp_path / "bad.out.1")])


def test_region_instructions_says_what_it_needs_where_valgrind_is_missing(monkeypatch):
    monkeypatch.setattr(region_instructions.shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit, match="needs valgrind and gcc"):
        region_instructions.main(["--layers", "2", "--forwards", "1", "--warmup", "0"])
    with pytest.raises(SystemExit):
        region_instructions.main(["--fractions", "half"])  # (argparse's usage error)


def test_train_instructions_counts_each_part_of_plain_then_managed_steps_with_equal_losses(fresh_manager):
    counter = _Counter()
    result = train_instructions.child(2, 16, 4, 2, 1, counter)
    # per part: two plain steps, then two managed ones, each counted on its own
    assert counter.calls == ["start", "stop"] * (4 * len(train_parts.PARTS))
    assert result["equal"]
    assert result["ops_per_step"] > 0
    assert fresh_manager.budget is None


def test_train_instructions_sums_the_dumps_per_part_in_the_child_s_order():
    steps = 2
    counts = []
    for i, _name in enumerate(train_parts.PARTS):  # plain's steps, then the managed ones
        counts += [100 * (i + 1)] * steps + [150 * (i + 1)] * steps
    parts = train_instructions.parts_of(counts, steps)
    assert list(parts) == list(train_parts.PARTS) + ["step total"]
    assert parts["forward"] == {"plain": 200, "managed": 300, "added": 100, "ratio": 1.5}
    assert parts["step total"]["plain"] == 1000 and parts["step total"]["managed"] == 1500
    with pytest.raises(ValueError, match="expected 16"):
        train_instructions.parts_of(counts[:-1], steps)


@pytest.mark.parametrize("budget", [None, 0.5], ids=["no-budget", "flow-50"])
def test_region_anatomy_times_each_step_of_a_region_call_and_gives_them_back(fresh_manager, budget):
    originals = {(owner, name): owner.__dict__[name] for _label, owner, name in region_anatomy.STEPS}
    argv = ["--layers", "4", "--width", "16", "--forwards", "5"] + ([] if budget is None else ["--budget", str(budget)])
    result = region_anatomy.main(argv)
    assert result["equal"]
    assert result["ops_per_forward"] == 4  # one op of the manager per block: region calls alone
    steps = result["steps_us_per_call"]
    assert list(steps) == [label for label, _owner, _name in region_anatomy.STEPS]
    # (inclusive times: a step holds the ones below it)
    assert 0 < steps["        the call"] < steps["      run (views in, call, views out)"] < steps["    step"]
    assert steps["    step"] < steps["  region"] < steps["module call to region"]
    if budget is None:
        assert steps["        fetch"] == 0 and steps["        evict"] == 0
    else:
        assert steps["        fetch"] > 0 and steps["        evict"] > 0  # (half the blocks page)
    assert all(owner.__dict__[name] is fn for (owner, name), fn in originals.items())


def test_region_anatomy_times_a_llama_s_decoding_by_its_layers_regions(fresh_manager):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    forward = LlamaDecoderLayer.__dict__["forward"]
    result = region_anatomy.main(["--model", "llama", "--layers", "2", "--width", "32", "--forwards", "2",
                                  "--tokens", "3", "--budget", "0.5"])
    assert result["equal"] and result["model"] == "llama"
    # (under a budget that pages: the loop, and at least a region per layer for each of the
    # 3 forwards a call makes, not one region a call)
    assert result["ops_per_forward"] > 1 + 3 * 2, result["ops_per_forward"]
    assert result["evictions_per_forward"] > 0
    steps = result["steps_us_per_call"]
    assert 0 < steps["        the call"] < steps["      run (views in, call, views out)"]
    assert steps["    objects searched"] > 0  # (the layers are given the key/value cache)
    assert LlamaDecoderLayer.__dict__["forward"] is forward


def test_region_anatomy_runs_on_the_test_device_and_profiles_the_calls(fresh_manager, tmp_path):
    # (on the test device, "sim" or "cuda", against plain torch there: how the next GPU run
    # finds where a region call's host time goes)
    device = fresh_manager.torch_device.type
    path = tmp_path / "region_anatomy.json"
    result = region_anatomy.main(["--layers", "4", "--width", "16", "--forwards", "5", "--budget", "0.5",
                                  "--device", device, "--profile", "40", "--json", str(path)])
    assert result["equal"] and result["ops_per_forward"] == 4
    profile = {where: (calls, own, inclusive) for where, calls, own, inclusive in result["profile"]}
    assert len(profile) == 40 and all(own > 0 and inclusive >= own for _c, own, inclusive in profile.values())
    # (per region call: the boundary runs once, the block's forward once)
    run = [calls for where, (calls, _o, _i) in profile.items() if where.endswith("mechanism.py:" + str(
        region_anatomy.mechanism.Region._run.__code__.co_firstlineno) + "(_run)")]
    assert run == [1.0]
    with open(path) as f:
        saved = json.load(f)
    assert saved["device"] == device and saved["result"]["profile"][0][0] == result["profile"][0][0]


def test_optimizer_step_times_the_step_alone_as_one_op_and_op_by_op(fresh_manager, tmp_path):
    path = tmp_path / "optimizer_step.json"
    result = optimizer_step.main(["--size", "tiny", "--steps", "3", "--json", str(path)])
    rows = result["rows"]
    assert list(rows) == [label for label, _device, _one, _budget in optimizer_step.ROWS]
    for label, r in rows.items():
        assert r["equal"] and r["within_budget"], label  # (plain torch's parameters, bit for bit, every step)
        assert r["ms"] > 0 and r["plain_ms"] > 0, label
        if r["budget"] != 2.0:
            assert (r["ops_per_step"] == 1) == r["one_op"], label
    parts, op_by_op = rows["sim-cpu, Flow, 2x, in parts"], rows["sim-cpu, Flow, 2x, op by op"]
    assert 1 < parts["ops_per_step"] < op_by_op["ops_per_step"]  # (a part an op)
    assert parts["mib_moved"] > 0 and rows["sim-cpu, Flow, 64x, one op"]["mib_moved"] == 0
    assert json.loads(path.read_text())["command"].startswith("python benchmarks/optimizer_step.py --size tiny")


def test_train_budget_reports_the_device_s_own_peak_beside_the_manager_s(fresh_manager, tmp_path, monkeypatch):
    path = tmp_path / "train_budget.json"
    monkeypatch.setattr(torchTensorRef.regions, "enabled", True)  # (the benchmark turns them off)
    result = train_budget.main(["--fractions", "0.5", "--steps", "2", "--seq", "8", "--device",
                                str(fresh_manager.device), "--json", str(path)])
    assert [(r["strategy"], r["ok"]) for r in result["rows"]] == [("flow", True), ("genoa", True)]
    for r in result["rows"]:
        # the device's count (its max_memory_allocated, what the program sees) within the budget
        assert 0 < r["peak_to_budget"] <= 1 and 0 < r["device_peak_to_budget"] <= 1, r
        assert r["max_diff"] < 1e-6, r
    assert json.loads(path.read_text())["command"].startswith("python benchmarks/train_budget.py --fractions 0.5")


def test_train_parts_times_each_part_beside_plain_torch_with_equal_losses(fresh_manager, tmp_path):
    path = tmp_path / "train_parts.json"
    device = str(fresh_manager.device)
    result = train_parts.main(["--layers", "2", "--width", "32", "--steps", "3", "--warmup", "1",
                               "--json", str(path)])
    assert list(result["parts"]) == list(train_parts.PARTS) + ["step total"]
    for name, r in result["parts"].items():
        assert 0 < r["plain_min_ms"] <= r["plain_median_ms"] and 0 < r["managed_min_ms"] <= r["managed_median_ms"]
        assert r["ratio"] == pytest.approx(r["managed_median_ms"] / r["plain_median_ms"]), name
    # each step learns something (the losses fall), and the two sides agree bit for bit
    assert result["losses_equal"] and len(result["losses"]["plain"]) == 4
    assert result["losses"]["plain"][-1] < result["losses"]["plain"][0]
    # a region's forward, its backward and the optimizer step are one op each
    assert 3 <= result["manager_ops_per_step"] < 100
    saved = json.loads(path.read_text())
    assert saved["command"].startswith("python benchmarks/train_parts.py --layers 2") and saved["result"]["parts"]
    assert str(fresh_manager.device) == device and fresh_manager.budget is None  # (given back)


def test_op_paths_times_every_path_and_the_plan_row_follows_its_plan(fresh_manager, tmp_path):
    path = tmp_path / "op_paths.json"
    fresh_manager.device = "sim"
    previous = fresh_manager.sim_workspace
    fresh_manager.sim_workspace = 0  # (emulated workspaces take every op off the fast path it times)
    try:
        with torchTensorRef.disabled():
            # a tensor an earlier test left on the device: the rows' budgets must leave it room
            held_outside = torch.empty(op_paths.SIDE, op_paths.SIDE, device="sim")
        result = op_paths.main(["--calls", "50", "--profile", "--json", str(path)])
        del held_outside
    finally:
        fresh_manager.sim_workspace = previous
    rows = result["rows"]
    assert list(rows) == [label for label, _setup in op_paths.ROWS]
    for label, r in rows.items():
        assert r["plain_us"] > 0 and r["floor_us"] > 0 and r["managed_us"] > 0, label
    assert rows["sim, Flow following its plan"]["plan"] and rows["sim, Flow following its plan"]["under_pressure"]
    assert not rows["sim, Flow learning"]["plan"] and rows["sim, Flow learning"]["under_pressure"]
    assert not rows["sim, a budget that fits"]["under_pressure"]
    assert any("run_fast" in name for name, _us in result["profile_plan_row"])
    with open(path) as f:
        saved = json.load(f)
    assert saved["command"].startswith("python benchmarks/op_paths.py --calls 50")


def test_predicted_harness_at_a_tiny_size(tmp_path):
    from benchmarks import predicted

    png = tmp_path / "predicted.png" if _has_matplotlib() else None
    argv = ["--tiny", "--layers", "1", "--train-layers", "1", "--json", str(tmp_path / "predicted.json")]
    result = predicted.main(argv + (["--plot", str(png)] if png else []))
    saved = json.load(open(tmp_path / "predicted.json"))
    for key in METADATA:
        assert saved[key], key
    assert saved["predicted"] is True and "not measured" in saved["note"]
    decode, train = saved["works"]
    assert {r["row"] for r in decode["rows"]} >= {"all-resident", "accelerate cpu_offload", "Flow, 50%", "Genoa, 100%"}
    assert "accelerate cpu_offload" not in {r["row"] for r in train["rows"]}
    for work in (decode, train):
        assert {r["gpu"] for r in work["rows"]} == {"h100-pcie", "rtx-4090"}
        for r in work["rows"]:
            if not r["fits"]:
                assert "budget" in r["error"]
                continue
            assert r["step_seconds"] >= r["bound_seconds"] > 0
            # with no host time but the launches, a row is no longer but still not below its bound
            assert r["bound_seconds"] <= r["schedule_step_seconds"] <= r["step_seconds"]
            assert r["bottleneck"] in timeline.LANES and r["bound_lane"] in timeline.LANES
            if r["strategy"] == "flow":
                assert r["flow_plan"]  # recorded once Flow follows its plan
            if r["strategy"] is not None:  # the host time of an unrecorded run, or why not
                assert r["host_time"]["scale"] >= 0 and ("narrower" in r["host_time"] or "error" in r["host_time"])
                assert r["host_unrecorded_scale"] == 1  # (applied as host_scale: the trace has no timing)
            if r["row"] == "all-resident":
                assert r["bytes_to_device"] == 0
            elif r["budget_fraction"] is not None and r["budget_fraction"] < 1:
                assert r["bytes_to_device"] > 0
        offload = [r for r in work["rows"] if r["row"] == "accelerate cpu_offload"]
        for r in offload:  # every weight, in before each forward
            assert r["bytes_to_device"] == work["param_bytes"] // (1 if saved["bf16_recorded"] else 2)
    assert result["works"][0]["rows"] == saved["works"][0]["rows"]
    # the targets, checked on the rows: the figure is recomputed from them
    decode_rows = {(r["row"], r["gpu"]): r for r in decode["rows"]}
    for c in saved["checks"]:
        if c["work"] == "decode" and c["check"] == "Flow 50%: step / bound":
            r = decode_rows[("Flow, 50%", c["gpu"])]
            assert c["value"] == pytest.approx(r["step_seconds"] / r["bound_seconds"])
            assert c["met"] == (c["value"] <= 1.25) and c["busiest_lane"] == r["bottleneck"]
            resident = decode_rows[("all-resident", c["gpu"])]
            assert c["attainable"] == pytest.approx(
                max(r["bound_seconds"], resident["step_seconds"]) / r["bound_seconds"])
            assert c["schedule"] == pytest.approx(r["schedule_step_seconds"] / r["bound_seconds"])
            assert 1 <= c["schedule"] <= c["value"]
    assert {c["check"] for c in saved["checks"] if c["work"] == "decode"} >= {
        "Flow 50%: step / bound", "Flow 50%: cpu_offload step / Flow step"}
    if png:
        assert png.stat().st_size > 0


def test_overshoot_plugin_lists_the_live_allocations_that_hold_no_resident_block():
    def block(address, size, state="active_allocated"):
        return {"address": address, "size": size, "state": state, "requested_size": size,
                "frames": [{"filename": "tests/ops/test_opinfo.py", "line": 9, "name": "_run"}]}

    segments = [{"blocks": [block(0, 512), block(512, 4096), block(4608, 512, "inactive")]},
                {"blocks": [block(8192, 1024), block(9216, 512)]}]
    # a resident block's pointer, one inside a group's allocation (a member's view), none in the rest
    missed = overshoot_plugin.unmanaged(segments, [0, 512 + 1024])
    assert [b["address"] for b in missed] == [8192, 9216]
    assert cuda_peak.where(missed[0], 5, overshoot_plugin.FRAMES) == "test_opinfo.py:9 _run"
    # without CUDA the plugin changes nothing
    overshoot_plugin.pytest_configure(None)
    from torchTensorRef.memory import op_protocol
    assert op_protocol.OpProtocol.finish is overshoot_plugin._finish or torch.cuda.is_available()


def test_cuda_peak_replays_allocations_to_the_moment_the_most_was_held():
    def event(action, addr, size, name="f"):
        return {"action": action, "addr": addr, "size": size,
                "frames": [{"filename": "torch/nn/functional.py", "line": 1, "name": "inner"},
                           {"filename": "torchTensorRef/regions/mechanism.py", "line": 7, "name": name}]}

    events = [event("alloc", 1, 100), event("alloc", 2, 50, "g"), event("free_requested", 1, 100),
              event("alloc", 3, 30), event("free_completed", 1, 100),  # (a stream still used it until here)
              event("alloc", 4, 60), event("free_completed", 2, 50)]
    peak, live = cuda_peak.live_at_peak(events, start=1000)
    assert peak == 1000 + 100 + 50 + 30
    assert [e["addr"] for e in live] == [1, 2, 3]  # largest first
    assert cuda_peak.where(live[1]) == "mechanism.py:7 g"  # (torch's own frames left out)
    # a block allocated before the recording and freed during it leaves the bytes counted at the start
    peak, live = cuda_peak.live_at_peak([event("free_completed", 9, 400), event("alloc", 5, 300)], start=1000)
    assert peak == 1000 and live == []
    peak, live = cuda_peak.live_at_peak([event("free_completed", 9, 400), event("alloc", 5, 500)], start=1000)
    assert peak == 1100 and [e["addr"] for e in live] == [5]


def test_cuda_peak_without_cuda_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_peak.main([]) == 0
    assert "needs CUDA" in capsys.readouterr().out


class FakeAllocator:
    """``torch.cuda``'s counters of allocated bytes, for a kernel that makes a temporary."""

    def __init__(self):
        self.current = self.peak = 1 << 20

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.current

    def memory_allocated(self, device=None):
        return self.current

    def max_memory_allocated(self, device=None):
        return self.peak


def test_kernel_temporary_names_the_op_whose_call_held_the_most_it_then_freed(monkeypatch):
    fake = FakeAllocator()
    for name in ("reset_peak_memory_stats", "memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))

    @torch.library.custom_op("ttr_benchmarks::with_workspace", mutates_args=())
    def with_workspace(x: torch.Tensor, workspace: int) -> torch.Tensor:
        fake.peak = max(fake.peak, fake.current + workspace)  # (made and freed inside the call)
        return x.clone()

    def call():
        x = torch.ones(4)
        y = with_workspace(x, 3 << 20)
        fake.current += 512  # (a result that stays: not a temporary)
        return with_workspace(y * 2, 1 << 20)

    with torchTensorRef.disabled():
        found = common.kernel_temporary(call, "cuda:0")
    assert found == {"bytes": 3 << 20, "op": "ttr_benchmarks.with_workspace.default"}


def test_real_models_small_on_sim_equal_to_plain_within_their_budgets(tmp_path):
    """``benchmarks/real_models.py --size small --device sim``, in its own process as on a GPU:
    every row runs, the managed rows' tokens, losses and latents are plain torch's bit for bit
    and their real peaks stay within their budgets."""
    import importlib.util
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "real_models.json"
    # as on a GPU: allocations counted as CUDA's allocator rounds them, workspaces outside the manager
    env = dict(os.environ, TORCHTENSORREF_SIM_ROUNDING="1", TORCHTENSORREF_SIM_WORKSPACE=str(64 * 1024))
    argv = ["--size", "small", "--device", "sim", "--json", str(path)]
    done = subprocess.run([sys.executable, "benchmarks/real_models.py", *argv], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    saved = json.loads(path.read_text())
    for key in METADATA:
        assert saved[key], key
    assert saved["command"] == "python benchmarks/real_models.py " + " ".join(argv)
    result = saved["result"]
    assert result["failures"] == []
    rows = {(r["group"], r["config"]): r for r in result["rows"]}
    missing = {name for name in ("peft", "diffusers") if importlib.util.find_spec(name) is None}
    for r in result["rows"]:
        assert "error" not in r, r
        if r["config"] == "cpu":  # (plain torch on "sim" runs on the CPU already)
            assert "accelerator is the host's CPU" in r["skipped"], r
        elif "skipped" in r:
            assert r["skipped"] in {f"{name} is not installed" for name in missing}, r
    managed = [r for r in result["rows"] if r.get("strategy") in ("flow", "genoa") and "skipped" not in r]
    expected = {"llama decode b1", "llama decode b8"}
    expected |= set() if "peft" in missing else {"llama lora step"}
    expected |= set() if "diffusers" in missing else {"unet denoise 2 steps"}
    assert {r["group"] for r in managed} == expected
    for r in managed:
        assert r["equal"] is True, r
        if r["group"].startswith("unet"):  # every call's output, warm-up ones too, is plain torch's
            assert r["call_differences"] and set(r["call_differences"]) == {0.0}, r
        assert r["budget"] > r["outside_bytes"] > 0, r
        assert r["peak"] <= r["budget"] and r["allocator_peak"] <= r["budget"] and r["overshoot"] == 0, r
        assert r["moved"] == r["bytes_to_device"] + r["bytes_to_host"] > 0, r
        plain = rows[(r["group"], "plain")]
        assert r["to_plain"] == pytest.approx(r["seconds_per_unit"] / plain["seconds_per_unit"])
        assert r["bound_per_unit"] >= plain["seconds_per_unit"] and r["to_bound"] > 0
    # the budgets: the shares of the 7B model's weights that 8 GiB and 4 GiB are, on top of the outside bytes
    weights = result["models"]["llama"]["weight_bytes"]
    shares = {}
    for r in managed:
        if r["group"].startswith("llama decode"):
            shares.setdefault(r["strategy"], set()).add(round((r["budget"] - r["outside_bytes"]) / weights, 2))
    assert shares == {"flow": {0.64, 0.32}, "genoa": {0.64}}
    # every section's own rows run before the offloading libraries' (slower: at full size they
    # would leave a later section's managed rows past the deadline)
    order = [r.get("strategy") for r in result["rows"]]
    last_flow = max(i for i, s in enumerate(order) if s == "flow")
    assert all(i > last_flow for i, s in enumerate(order) if s in ("accelerate device_map", "group offload"))
    # accelerate's hooks copy in, every token, what its device map left on the host
    accelerate = [r for r in result["rows"] if r.get("strategy") == "accelerate device_map"]
    assert len(accelerate) == 4
    for r in accelerate:
        assert r["moved"] > 0 and r["budget"] > r["outside_bytes"] and "equal" in r, r
    if "diffusers" not in missing:
        offload = rows[("unet denoise 2 steps", "diffusers group offload")]
        assert offload["moved"] == 2 * result["models"]["denoiser"]["weight_bytes"] and "equal" in offload


CLIENT_TESTS = '''
import torch

torch_device = "cpu"  # (diffusers' tests read their device from a module's global)


def test_the_module_device():
    assert torch.ones(2, device=torch_device).device.type == "cpu"


def test_a_plain_tensor():
    assert type(torch.zeros(2)) is torch.Tensor


def test_values():
    assert torch.arange(4.0).sum().item() == 6.0


class TestOnADevice:
    torch_device = "cpu"

    def test_the_device(self):
        assert torch.ones(2, device=self.torch_device).device.type == "cpu"
'''


def test_client_tests_finds_what_the_import_changes_and_nothing_else(tmp_path):
    """``benchmarks/client_tests.py``: a library's tests run plain, with the import, and on
    "sim"; the comparison names exactly the tests whose outcome the import changed."""
    import subprocess

    from benchmarks import client_tests

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "test_client.py").write_text(CLIENT_TESTS)
    for variant in client_tests.VARIANTS:
        done = subprocess.run([sys.executable, "benchmarks/client_tests.py", "run", variant,
                               str(tmp_path / f"{variant}.tsv"), "--tests", str(tmp_path / "test_client.py")],
                              cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    plain, cpu, sim = (client_tests.load(str(tmp_path / f"{v}.tsv")) for v in client_tests.VARIANTS)
    assert {k.split("::", 1)[1]: o for k, (o, _m) in plain.items()} == {
        "test_a_plain_tensor": "passed", "test_values": "passed", "TestOnADevice::test_the_device": "passed",
        "test_the_module_device": "passed"}
    # the import makes factories give TensorRefs; on "sim" the test class and the module run on "sim"
    assert sorted(k.split("::", 1)[1] for k in client_tests.regressions(plain, cpu)) == ["test_a_plain_tensor"]
    assert sorted(k.split("::", 1)[1] for k in client_tests.regressions(plain, sim)) == [
        "TestOnADevice::test_the_device", "test_a_plain_tensor", "test_the_module_device"]
    text = client_tests.report(str(tmp_path / "plain.tsv"), str(tmp_path / "sim.tsv"))
    assert "regressions: 3, of which OutOfBudgetError: 0" in text
