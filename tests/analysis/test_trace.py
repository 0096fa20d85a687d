"""Tests of ``tensorsManager.recording()``: the access list and the Chrome trace."""

from __future__ import annotations

import json

import pytest
import torch

from torchTensorRef import strategies, tensorsManager
from torchTensorRef.analysis.trace import Trace
from paired import budget, device_type


def _bid(t):
    return t.proxyInfo.block_id


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_accesses_in_order(strategy):
    tensorsManager.strategy = strategy
    a = torch.rand(4, 4)
    b = torch.rand(4, 4)
    with tensorsManager.recording() as trace:
        c = torch.add(a, b)
        a.add_(1)
        v = a[0]
    assert [name for _i, name, _s, _e in trace.ops] == ["aten.add.Tensor", "aten.add_.Tensor", "aten.select.int"]
    first = trace.accesses[0][0]
    got = [(i - first, block, nbytes, write) for i, block, nbytes, write in trace.accesses]
    assert got == [
        (0, _bid(a), 64, False), (0, _bid(b), 64, False), (0, _bid(c), 64, True),
        (1, _bid(a), 64, True),
        (2, _bid(a), 64, False),
    ]
    assert _bid(v) == _bid(a)  # a view shares its base's block
    assert [index for index, *_ in trace.ops] == [first, first + 1, first + 2]
    for access in trace.accesses:
        assert [type(x) for x in access] == [int, int, int, bool]


def test_accesses_list_each_block_once_per_op():
    a = torch.rand(8)
    with tensorsManager.recording() as trace:
        c = torch.add(a[:4], a[4:])  # two views of one block
    (add,) = [index for index, name, _s, _e in trace.ops if name == "aten.add.Tensor"]
    assert [(block, write) for i, block, _n, write in trace.accesses if i == add] == [
        (_bid(a), False), (_bid(c), True)]


def test_moves_and_resident_bytes_match_the_stats():
    limit = tensorsManager.budget = budget("1MiB")
    model = torch.nn.Linear(32, 32)
    x = torch.rand(8, 32)
    tensorsManager.reset_stats()
    with tensorsManager.recording() as trace:
        model(x).sum().backward()
    stats = tensorsManager.stats()
    assert trace.bytes_moved() == {"to_device": stats["bytes_to_device"], "to_host": stats["bytes_to_host"]}
    assert max(nbytes for _t, nbytes in trace.resident) == stats["peak_device_bytes"]
    assert len(trace.ops) == stats["ops"]
    assert trace.budget == limit and trace.device.split(":")[0] == device_type()


def test_nothing_is_recorded_outside_and_recordings_nest():
    a = torch.rand(4)
    with tensorsManager.recording() as outer:
        a + 1
        with tensorsManager.recording() as inner:
            a * 2
        a - 3
    a / 4
    assert [name for _i, name, *_ in inner.ops] == ["aten.mul.Tensor"]
    assert [name for _i, name, *_ in outer.ops] == ["aten.add.Tensor", "aten.sub.Tensor"]


def test_save_writes_a_chrome_trace(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x = torch.rand(4, 16)
    with tensorsManager.recording() as trace:
        model(x).sum().backward()
    path = trace.save(tmp_path / "trace.json")
    assert path == str(tmp_path / "trace.json")
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"]
    assert data["otherData"]["device"].split(":")[0] == device_type()
    assert data["otherData"]["accesses"] == len(trace.accesses)
    for e in events:
        assert e["ph"] in ("M", "X", "C") and isinstance(e["name"], str) and e["pid"] == 1
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] > 0 and e["tid"] in (1, 2)
        if e["ph"] == "C":
            assert set(e["args"]) == {"device_bytes"}
    ops = [e for e in events if e.get("cat") == "op"]
    assert [e["name"] for e in ops] == [name for _i, name, _s, _e in trace.ops]
    moves = [e for e in events if e.get("cat") == "move"]
    assert sum(e["args"]["bytes"] for e in moves if e["name"] == "to_device") == trace.bytes_moved()["to_device"]
    assert len([e for e in events if e["ph"] == "C"]) == len(trace.resident)


def test_pass_through_records_no_accesses():
    tensorsManager.device = "cpu"
    a = torch.rand(4)
    with tensorsManager.recording() as trace:
        a + 1
    assert trace.accesses == [] and trace.moves == []


def test_trace_repr():
    assert repr(Trace("sim", None)) == "Trace(ops=0, accesses=0, moves=0)"
