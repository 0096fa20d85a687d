"""Tests of ``python -m torchTensorRef predict`` (run in-process: the runner is ``cli.main``)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from torchTensorRef import cli, predict_run, tensorsManager

from conftest import TEST_DEVICE
from paired import budget

INFER = textwrap.dedent("""
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    x = torch.rand(2, 64)
    with torch.no_grad():
        for _ in range(4):
            x = model(x).tanh()
    print("done", x.shape[0])
""")

TRAIN = textwrap.dedent("""
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.rand(8, 64)
    for _ in range(4):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
""")


@pytest.fixture
def script(tmp_path, monkeypatch):
    # run_script sets what plain python would: put it back after the test
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])

    def write(text):
        path = tmp_path / "script.py"
        path.write_text(text)
        return str(path)
    return write


def test_inference_is_predicted_beside_all_resident_and_cpu_offload(script, tmp_path, capsys):
    out = tmp_path / "p.json"
    chrome = tmp_path / "c.json"
    # (40 KiB above what the device holds outside the manager: earlier tests' plain tensors
    # there took half of an absolute 40 KiB in one run, and the model's first op did not fit)
    code = cli.main(["predict", "--gpu", "rtx-4090", "--strategy", "flow", "--budget", str(budget("40KiB")),
                     "--steps", "1:3",
                     "--json", str(out), "--chrome", str(chrome), script(INFER)])
    assert code == 0
    stdout, stderr = capsys.readouterr()
    assert "done 2" in stdout
    assert "predicted on rtx-4090" in stdout and "inference" in stdout
    assert "step 3 done, 2/2 recorded, 0/2 timed unrecorded" in stderr  # progress
    assert "step 4 done, 2/2 recorded, 1/2 timed unrecorded" in stderr  # the script stops at 4 steps
    assert "host time from 1 unrecorded step(s)" in stdout
    assert "busiest lane: torchTensorRef: " in stdout
    results = json.load(open(out))
    assert list(results) == ["torchTensorRef", "all-resident", "accelerate cpu_offload"]
    ours, resident, offload = results.values()
    # (the factor itself is noise at this size: timeline's tests pin its arithmetic)
    assert ours["host_unrecorded_scale"] >= 0 and resident["host_unrecorded_scale"] == 1
    assert ours["steps"] == 2 and ours["gpu"] == "rtx-4090"
    assert ours["bytes_to_device"] > 0 and resident["bytes_to_device"] == 0
    # cpu_offload copies every weight (2 Linear layers, fp32) in before each forward
    weights = 4 * (64 * 128 + 128 + 128 * 64 + 64)
    assert offload["bytes_to_device"] == weights
    assert offload["host_wait_seconds"] > 0  # from pageable memory: the host waits
    # the same kernels; only ours copies (the step times compare host times scaled by a
    # factor that is noise at this size)
    assert resident["compute_seconds"] == pytest.approx(ours["compute_seconds"])
    assert resident["transfer_seconds"] == 0 < ours["transfer_seconds"]
    names = {e["args"]["name"] for e in json.load(open(chrome))["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"host", "compute", "host-to-device", "device-to-host"}


def test_training_steps_on_the_optimizer(script, tmp_path, capsys):
    out = tmp_path / "p.json"
    code = cli.main(["predict", "--gpu", "t4", "--strategy", "genoa", "--budget", str(budget("256KiB")),
                     "--step-on", "optimizer", "--steps", "2", "--half", "--json", str(out), script(TRAIN)])
    assert code == 0
    stdout, _ = capsys.readouterr()
    assert "training" in stdout and "as 16-bit" in stdout
    results = json.load(open(out))
    assert list(results) == ["torchTensorRef", "all-resident"]  # no cpu_offload model for training
    assert results["torchTensorRef"]["steps"] == 2


def test_too_few_steps_is_reported(script, capsys):
    code = cli.main(["predict", "--steps", "5:7", script(INFER)])
    assert code == 1
    assert "the script ran 4 step(s) (--step-on forward); --steps 5:7 needs at least 6" in capsys.readouterr().err


def test_no_step_after_the_recorded_ones_keeps_the_recorded_host_time(script, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cli.main(["predict", "--steps", "2:4", "--json", str(out), script(INFER)]) == 0
    assert "no step ran after the recorded ones" in capsys.readouterr().err
    assert json.load(open(out))["torchTensorRef"]["host_unrecorded_scale"] == 1


def test_timed_steps_apart_from_the_recorded_ones():
    with pytest.raises(ValueError, match="timed steps 2:4 must be a range apart from the recorded 1:3"):
        predict_run.StepRecorder(1, 3, timed=(2, 4))
    with pytest.raises(ValueError, match="timed steps 5:7 must be a range apart from the recorded 5:6"):
        predict_run.StepRecorder(5, 6, timed=(1, 3), repeats=3, every=2)
    with pytest.raises(ValueError, match="timed repeats must be at least 2 steps apart"):
        predict_run.StepRecorder(0, 1, timed=(1, 3), repeats=2, every=1)


def test_the_fastest_complete_repeat_is_kept():
    recorder = predict_run.StepRecorder(0, 1, timed=(1, 3), repeats=3, every=4)
    assert recorder.runs == [(1, 3), (5, 7), (9, 11)]
    recorder.timed_at = [[0, 10, 30], [100, 105, 118], [200, 201]]  # the third stopped after a step
    assert recorder.unrecorded() == (2, 18) and recorder.timed_steps == 2
    recorder.timed_at = [[0, 10], [], []]
    assert recorder.unrecorded() == (1, 10)
    recorder.timed_at = [[], [], []]
    assert recorder.unrecorded() is None and recorder.timed_steps == 0


def test_a_gpu_file_of_numbers(script, tmp_path, capsys):
    gpu = tmp_path / "mine.json"
    gpu.write_text(json.dumps({"base": "l4", "name": "my-l4", "h2d_pinned_gb_s": 3}))
    assert cli.main(["predict", "--gpu", str(gpu), script(INFER)]) == 0
    assert "predicted on my-l4" in capsys.readouterr().out


@pytest.mark.parametrize("args, named", [
    (["--gpu", "h200-nvl"], "--gpu: unknown GPU 'h200-nvl': accepted are h100-sxm"),
    (["--steps", "3:1"], '--steps must be "A:B" with 0 <= A < B'),
    (["--steps", "x"], "(got: 'x')"),
    (["--budget", "lots"], "--budget: "),
    (["--step-on", "epoch"], "invalid choice: 'epoch'"),
    (["--host-scale", "-1"], "--host-scale must be a number >= 0 (got: -1.0)"),
])
def test_bad_arguments_are_usage_errors(args, named, script, capsys):
    path = script("print('ran')\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["predict", *args, path])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "usage: python -m torchTensorRef predict" in err and named in err
    assert "ran" not in out


def test_parse_steps():
    assert predict_run.parse_steps("1:3") == (1, 3)
    assert predict_run.parse_steps("0:1") == (0, 1)
    assert predict_run.parse_steps("4") == (1, 5)
    for bad in ("0", "2:2", "-1:3", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--steps must be"):
            predict_run.parse_steps(bad)
    assert tensorsManager.device == TEST_DEVICE
