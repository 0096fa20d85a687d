"""Tests of ``python -m torchTensorRef run``: unmodified scripts behave as under plain python."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchTensorRef
from torchTensorRef import cli, strategies, tensorsManager

TRAIN = textwrap.dedent("""
    import sys
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    for step in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, sys.argv[1])
""")

REPORT = textwrap.dedent("""
    import sys
    print(repr(sys.argv), __name__, __file__, sys.path[0], sys.modules["__main__"].__dict__ is globals())
    if sys.argv[1:2] == ["exit"]:
        sys.exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
    if sys.argv[1:2] == ["raise"]:
        def inner():
            raise ValueError("raised by the script")
        inner()
""")


def _python(*args, cwd, env=None):
    full_env = dict(os.environ)
    # (the runs name their device and budget: the suite's settings, emulated workspaces
    # included, are not the runner's)
    for var in ("TORCHTENSORREF_DEVICE", "TORCHTENSORREF_STRATEGY", "TORCHTENSORREF_BUDGET",
                "TORCHTENSORREF_SIM_WORKSPACE"):
        full_env.pop(var, None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=full_env)


def _runner(*args, cwd, env=None):
    return _python("-m", "torchTensorRef", "run", *args, cwd=cwd, env=env)


def _same_checkpoint(a, b):
    if isinstance(a, torch.Tensor):
        return type(a) is torch.Tensor and type(b) is torch.Tensor and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_checkpoint(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_checkpoint(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_training_script_gives_plain_losses_and_checkpoint(strategy, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    plain = _python("train.py", "plain.pt", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    managed = _runner("--device", "sim", "--strategy", strategy, "--budget", "32KiB",
                      "train.py", "managed.pt", cwd=tmp_path)
    assert managed.returncode == 0, managed.stderr
    assert managed.stdout == plain.stdout
    assert plain.stdout.count("loss") == 5
    with torchTensorRef.disabled():
        want = torch.load(tmp_path / "plain.pt", weights_only=True)
        got = torch.load(tmp_path / "managed.pt", weights_only=True)
    assert _same_checkpoint(got, want)
    summary = managed.stderr
    assert f"device sim, strategy {strategy}, budget 32.0 KiB" in summary
    assert "to the accelerator" in summary and "evictions" in summary and "ops" in summary


def test_training_under_a_host_budget_spills_to_the_offload_dir_and_gives_plain_losses(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    plain = _python("train.py", "plain.pt", cwd=tmp_path)
    # (2 KiB: with CUDA's rounding, reading one tensor back took the whole of 1 KiB while 128 B
    # of another were in use)
    managed = _runner("--device", "sim", "--strategy", "flow", "--budget", "32KiB", "--host-budget", "2KiB",
                      "--offload-dir", str(tmp_path / "spill"), "train.py", "managed.pt", cwd=tmp_path)
    assert managed.returncode == 0, managed.stderr
    assert managed.stdout == plain.stdout
    disk = next(line for line in managed.stderr.splitlines() if line.strip().startswith("disk:"))
    assert "of host copies of 2.0 KiB" in disk and "wrote 0 B" not in disk
    assert (tmp_path / "spill").is_dir()


def test_checkpoint_loads_without_torchTensorRef(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    assert _runner("--quiet", "train.py", "c.pt", cwd=tmp_path).returncode == 0
    check = _python("-c", "import torch, sys; d = torch.load('c.pt', weights_only=True); "
                          "assert 'torchTensorRef' not in sys.modules; "
                          "print(sorted(d['model']), type(d['model']['0.weight']).__name__)", cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == "['0.bias', '0.weight', '2.bias', '2.weight'] Tensor"


@pytest.mark.parametrize("args", [[], ["--device", "x", "--quiet"], ["exit", "0"], ["exit", "3"],
                                  ["exit", "a message"], ["raise"]])
def test_script_sees_what_plain_python_shows(args, tmp_path):
    (tmp_path / "report.py").write_text(REPORT)
    plain = _python("report.py", *args, cwd=tmp_path)
    managed = _runner("--quiet", "report.py", *args, cwd=tmp_path)
    assert managed.returncode == plain.returncode
    assert managed.stdout == plain.stdout
    assert managed.stderr == plain.stderr  # the script's traceback, not the runner's


def test_summary_is_printed_after_an_error(tmp_path):
    (tmp_path / "report.py").write_text(REPORT)
    done = _runner("--device", "sim", "report.py", "raise", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.index("ValueError: raised by the script") < done.stderr.index("torchTensorRef: device sim")


def test_environment_configures_the_runner(tmp_path):
    (tmp_path / "show.py").write_text(
        "import torchTensorRef as t\nm = t.tensorsManager\nprint(m.device, m.strategy.name, m.budget)\n")
    done = _runner("--quiet", "show.py", cwd=tmp_path,
                   env={"TORCHTENSORREF_DEVICE": "sim", "TORCHTENSORREF_STRATEGY": "genoa",
                        "TORCHTENSORREF_BUDGET": "1MiB"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["sim", "genoa", str(2**20)]
    # (on "sim": where a GPU is the default device, 2 MiB is below what cuBLAS's workspaces take)
    flags = _runner("--quiet", "--budget", "2MiB", "show.py", cwd=tmp_path,
                    env={"TORCHTENSORREF_DEVICE": "sim", "TORCHTENSORREF_BUDGET": "1MiB"})
    assert flags.stdout.split()[2] == str(2 * 2**20)  # a flag wins over the environment


@pytest.mark.parametrize("args, named", [
    (["--device", "gpu"], '"sim"'),
    (["--strategy", "lru"], '"genoa"'),
    (["--budget", "lots"], '"512MiB"'),
    (["--budget", "-1"], ">= 0"),
    # (a size too large for a float: an OverflowError's traceback, not a usage error)
    (["--budget", "9" * 400 + "GiB"], "2**63 - 1"),
    (["--host-budget", "lots"], "--host-budget"),
    (["--offload-dir", "/proc/none"], "offload_dir"),
    ([], "script.py"),
])
def test_bad_arguments_are_usage_errors(args, named, tmp_path, capsys):
    (tmp_path / "ok.py").write_text("print('ran')\n")
    script = [str(tmp_path / "ok.py")] if args else []
    before = (tensorsManager.device, tensorsManager.strategy, tensorsManager.budget)
    with pytest.raises(SystemExit) as info:
        cli.main(["run", *args, *script])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "usage: python -m torchTensorRef run" in err
    assert named in err
    assert "ran" not in out
    assert (tensorsManager.device, tensorsManager.strategy, tensorsManager.budget) == before


def test_missing_script_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", str(tmp_path / "nowhere.py")])
    assert info.value.code == 2
    assert "nowhere.py' is not a file" in capsys.readouterr().err


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "{run,demo,predict}" in capsys.readouterr().err
