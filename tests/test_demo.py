"""Smoke tests of ``python -m torchTensorRef demo`` (tiny settings) and its comparison."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import torch

import torchTensorRef
from torchTensorRef import demo, strategies


def _demo(*args, cwd, env=None):
    if env is None:  # (the runs name "sim" and their budget: the suite's emulated workspaces are not theirs)
        env = {k: v for k, v in os.environ.items() if k != "TORCHTENSORREF_SIM_WORKSPACE"}
    return subprocess.run([sys.executable, "-m", "torchTensorRef", "demo", "--device", "sim", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def _kib(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024}[unit]


def test_quick_demo_pages_below_the_weights_matches_plain_and_writes_its_files(tmp_path):
    # The default budget was read while the plain reference model was still on the device,
    # so the managed model got its weights and half again: Flow ran with 0 evictions
    out = tmp_path / "demo-out"
    done = _demo("--quick", "--layers", "1", "--tokens", "3", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("Budget "))
    budget = _kib(line.split("Budget ")[1].split(" (")[0])
    weights = _kib(line.split("against ")[1].split(" of weights")[0])
    assert budget < weights, line
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    for name in strategies.NAMES:
        assert rows[name][1:3] == ["identical", "identical"], done.stdout
        assert int(rows[name][-3]) > 0, done.stdout  # evictions
        assert int(rows[name][5].strip("()%")) <= 100, done.stdout  # peak within the budget
        with open(out / f"trace-{name}.json") as f:
            events = json.load(f)["traceEvents"]
        assert any(e.get("cat") == "op" for e in events)
    assert "4/4 steps" in done.stderr  # the progress bar: the forward pass and 3 tokens
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert 'pip install "torchTensorRef[plot]"' in done.stdout
        assert not (out / "memory.png").exists()


def test_demo_without_matplotlib_says_how_to_get_the_plot(tmp_path):
    code = ("import sys, runpy; sys.modules['matplotlib'] = None; "  # makes `import matplotlib` fail
            "sys.argv = ['torchTensorRef', 'demo', '--device', 'sim', '--quick', '--layers', '1', "
            "'--tokens', '1', '--out', 'out']; runpy.run_module('torchTensorRef', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert 'matplotlib is not installed (pip install "torchTensorRef[plot]")' in done.stdout
    assert "identical  identical" in done.stdout  # the table is still there
    assert not (tmp_path / "out" / "memory.png").exists()
    assert (tmp_path / "out" / "trace-genoa.json").exists()


def test_demo_budget_too_small_says_what_to_do(tmp_path):
    # Below the largest op: the op that does not fit is named, with a budget that runs it
    done = _demo("--quick", "--layers", "1", "--tokens", "1", "--budget", "9KiB",
                 "--out", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "error: op aten." in done.stderr and "budget is 9.0 KiB" in done.stderr
    assert "try --budget" in done.stderr


def test_demo_budget_below_what_the_device_holds_is_a_usage_error(tmp_path):
    env = {**os.environ, "TORCHTENSORREF_SIM_WORKSPACE": "64KiB"}  # (what the device holds beside it)
    done = _demo("--quick", "--layers", "1", "--tokens", "1", "--budget", "96KiB",
                 "--out", str(tmp_path), cwd=tmp_path, env=env)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "--budget: budget must be more than" in done.stderr and "set a budget of at least" in done.stderr


def test_compare():
    with torchTensorRef.disabled():
        a = torch.tensor([1.0, 2.0, 3.0])
        b = torch.tensor([1.0, 2.5, 3.0])
        assert demo._compare(a, a.clone()) == "identical"
        assert demo._compare(b, a) == "max diff 5.0e-01"
        assert demo._compare(torch.tensor([1, 2]), torch.tensor([1, 3])) == "1 differ"
        assert demo._compare(a[:2], a) == "shape (2,)"
    managed = torch.tensor([1.0, 2.0, 3.0])
    assert type(managed) is torchTensorRef.TensorRef
    assert demo._compare(managed, a) == "identical"


def test_demo_default_budget_holds_beside_a_gpus_workspaces(tmp_path):
    # On an H100 the demo failed at its first ops: "aten.view.default needs 33.0 MiB" (cuBLAS's
    # workspaces, counted against a budget of half the weights). "sim" emulates them here.
    env = {**os.environ, "TORCHTENSORREF_SIM_WORKSPACE": "33MiB"}
    done = _demo("--quick", "--layers", "1", "--tokens", "2", "--out", str(tmp_path), cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # (two threads' 33 MiB workspaces; the plain reference model is gone by then)
    outside = float(done.stderr.split(" MiB of it allocated outside the manager")[0].split("(")[-1])
    assert outside == 66.0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    for name in strategies.NAMES:
        assert rows[name][1:3] == ["identical", "identical"], done.stdout
        peak_percent = int(rows[name][5].strip("()%"))
        assert peak_percent <= 100, done.stdout


def test_an_out_folder_that_cannot_be_written_is_a_usage_error(tmp_path):
    # --out below a file (a folder that cannot be made or written) ended in a traceback from
    # os.makedirs, after the runs' setup.
    (tmp_path / "a-file").write_text("")
    done = _demo("--quick", "--layers", "1", "--tokens", "1", "--out", str(tmp_path / "a-file" / "out"),
                 cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--out must be a folder the demo can write" in done.stderr and "a-file" in done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / "a-file").read_text() == ""
