"""benchmarks/gpu_check.py on a CPU-only machine: it refuses without CUDA, and with --allow-cpu its
summary holds the right fields and counts, a step past its limit is killed and reported, and later
steps still run.

The subprocesses hide any GPU (CUDA_VISIBLE_DEVICES=""), so these tests do the same everywhere.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import gpu_check  # noqa: E402

STEP_FIELDS = ("command", "log", "status", "returncode", "seconds", "timed_out", "limit_s")
ENV_FIELDS = ("date", "device", "device_name", "torch", "cuda_version", "driver", "transformers", "commit", "steps")

# The cuda step runs this file with -m cuda: one test of each outcome, so the counts are known
FAKE_TESTS = """
import pytest

pytestmark = pytest.mark.cuda

@pytest.fixture
def broken():
    raise RuntimeError("setup breaks")

@pytest.fixture
def breaks_after():
    yield
    raise RuntimeError("teardown breaks")

def test_passes():
    pass

def test_fails():
    assert False

@pytest.mark.skip(reason="skipped on purpose")
def test_skipped():
    pass

@pytest.mark.xfail(reason="fails on purpose", strict=True)
def test_xfails():
    assert False

def test_errs_at_setup(broken):
    pass

def test_errs_at_teardown(breaks_after):
    pass
"""

# Ignores SIGINT (so only the kill of its group ends it) and leaves a child behind, which
# must die with it
HANG = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("demo started", flush=True)
print(f"child {child.pid}", flush=True)
time.sleep(120)
"""

# What gpu_throughput.py prints after each configuration
ROW = {"config": "resident", "budget_fraction": None, "budget": None,
       "generate": {"seconds": 0.5, "tokens_per_s": 6.0, "moved": 0, "peak": 1024},
       "train": {"seconds": 0.25, "moved": 0, "peak": 2048}}


def _run(args, timeout=120, **environ):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT, **environ)
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_without_cuda_it_refuses_with_exit_2_and_writes_nothing(tmp_path):
    # without --allow-cpu, a CPU-only machine must not pass for a GPU check
    out = tmp_path / "out"
    done = _run(["--out", str(out)])
    assert done.returncode == 2, done.stderr
    assert "gpu_check needs CUDA: torch.cuda.is_available() is False" in done.stderr
    assert "--allow-cpu" in done.stderr
    assert not (out / "summary.json").exists()


def test_allow_cpu_writes_the_summary_kills_a_step_past_its_limit_and_runs_the_next(tmp_path):
    out = tmp_path / "out"
    fake = tmp_path / "test_fake_outcomes.py"
    fake.write_text(textwrap.dedent(FAKE_TESTS))
    hang = tmp_path / "hang.py"
    hang.write_text(textwrap.dedent(HANG))
    rows = tmp_path / "rows.py"
    rows.write_text(f"print('warming up')\nprint({json.dumps(json.dumps(ROW))})\n")
    start = time.monotonic()
    # (one process: starting xdist workers takes longer than these tests)
    done = _run(["--out", str(out), "--allow-cpu", "--workers", "0",
                 "--suite-args", "tests/core/test_sizes.py -k 'parse_integer or parse_fractional'",
                 "--cuda-args", str(fake),
                 "--command", f"demo={{python}} {hang}", "--demo-limit", "3", "--grace", "1",
                 "--command", f"throughput={{python}} {rows}"])
    wall = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr  # the cuda step failed, the demo timed out

    summary = json.loads((out / "summary.json").read_text())
    for field in ENV_FIELDS:
        assert field in summary, field
    assert summary["device"] == "sim" and summary["finished"] is True and summary["passed"] is False
    assert summary["torch"] and summary["commit"]
    assert summary["step_env"]["TORCHTENSORREF_TEST_DEVICE"] == "sim"
    assert list(summary["steps"]) == ["suite", "cuda", "demo", "throughput"]
    for name, step in summary["steps"].items():
        for field in STEP_FIELDS:
            assert field in step, (name, field)
        assert os.path.exists(step["log"]), name

    suite = summary["steps"]["suite"]
    assert suite["status"] == "passed" and suite["returncode"] == 0 and not suite["timed_out"]
    assert suite["counts_from"] == "junit" and suite["counts"]["passed"] > 0
    # the junit XML and pytest's own last line agree
    assert suite["counts"] == gpu_check.line_counts(suite["summary_line"])
    assert " -n " not in suite["command"]

    cuda = summary["steps"]["cuda"]
    assert cuda["status"] == "failed" and cuda["returncode"] == 1
    assert cuda["counts"] == {"passed": 2, "failed": 1, "errors": 2, "skipped": 1, "xfailed": 1, "xpassed": 0}
    assert cuda["counts"] == gpu_check.line_counts(cuda["summary_line"])
    assert "-m cuda" in cuda["command"]
    # the tests that failed or erred are named, in the summary and on the console
    named = sorted((p["test"].split("::")[1], p["outcome"]) for p in cuda["problems"])
    assert named == [("test_errs_at_setup", "error"), ("test_errs_at_teardown", "error"), ("test_fails", "failed")]
    assert next(p for p in cuda["problems"] if p["test"].endswith("test_errs_at_setup"))["message"].startswith(
        "failed on setup")
    assert suite["problems"] == []
    assert "cuda: 3 failed or erred, by module" in done.stdout
    # (the module's name as junit gives it: with the path pytest derives from its root)
    assert re.search(r"^ +3 \S*test_fake_outcomes: failed: ", done.stdout, re.M), done.stdout

    demo = summary["steps"]["demo"]
    assert demo["status"] == "timed out" and demo["timed_out"] is True and demo["passed"] is False
    assert demo["limit_s"] == 3 and demo["seconds"] < 3 + 1 + 5
    assert "demo started" in demo["last_lines"][0]
    child = int(next(line for line in demo["last_lines"] if line.startswith("child")).split()[1])
    assert _gone(child), "the demo's child outlived the kill of its process group"

    throughput = summary["steps"]["throughput"]
    assert throughput["status"] == "passed" and throughput["rows_from"] == "log"
    assert throughput["rows"] == [{"config": "resident", "budget_fraction": None, "budget": None,
                                   "generate": ROW["generate"], "train": ROW["train"]}]
    assert summary["wall_seconds"] <= wall

    assert "timed out" in done.stdout and "NOT all steps passed" in done.stdout


def test_a_throughput_configuration_that_raised_fails_the_step(tmp_path):
    # gpu_throughput exits 0 when a configuration raises; the check must not call that a pass
    (tmp_path / "throughput.log").write_text(
        "\n".join(json.dumps(r) for r in (ROW, {**ROW, "config": "flow", "budget_fraction": 0.25,
                                                "train": {"error": "OutOfBudgetError: too big"}})) + "\n")
    found = gpu_check.throughput_findings(str(tmp_path / "throughput.log"), str(tmp_path / "missing.json"))
    assert [r["config"] for r in found["rows"]] == ["resident", "flow"]
    assert found["row_errors"] == ["flow 25% train: OutOfBudgetError: too big"]


def test_the_last_line_of_pytest_gives_the_counts_when_there_is_no_junit(tmp_path):
    log = tmp_path / "suite.log"
    log.write_text("...F\n!!! KeyboardInterrupt !!!\n= 1 failed, 3 passed, 2 skipped, 1 error, 4 deselected in 9.1s =\n"
                   "\n[gpu_check] timed out after 10.0 s (limit 9 s): process group killed\n")
    found = gpu_check.pytest_findings(str(log), str(tmp_path / "missing.xml"))
    assert found["counts_from"] == "last line"
    assert found["counts"] == {"passed": 3, "failed": 1, "errors": 1, "skipped": 2, "xfailed": 0, "xpassed": 0}
    assert found["deselected"] == 4


@pytest.mark.parametrize("args, message", [
    (["--skip", "demo,nosuch"], "unknown step 'nosuch'"),
    (["--command", "bench=python x.py"], "expected STEP=CMD"),
    (["--suite-limit", "0"], "--suite-limit must be a positive"),
])
def test_bad_arguments_name_what_is_accepted(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--out", "x", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("xdist, timeout_plugin", [(True, True), (False, False)])
def test_the_suite_runs_in_workers_with_a_limit_per_test_where_the_plugins_are_there(tmp_path, xdist, timeout_plugin):
    args = gpu_check.parse_args(["--out", str(tmp_path), "--workers", "8", "--test-timeout", "30"])
    argv = gpu_check.commands(args, str(tmp_path), "cuda", {"xdist": xdist, "pytest_timeout": timeout_plugin})
    suite = " ".join(argv["suite"])
    assert ("-n 8" in suite) == xdist
    assert ("--timeout 30" in suite) == timeout_plugin
    assert f"--junitxml {tmp_path}/suite.xml" in suite and "-rfE -p no:cacheprovider" in suite
    assert "--ignore tests/test_benchmarks.py" in suite  # (harness checks on "sim": CI runs them)
    assert argv["demo"][-5:] == ["demo", "--device", "cuda", "--out", f"{tmp_path}/demo"]
    assert " ".join(argv["throughput"]).endswith(
        f"benchmarks/gpu_throughput.py --device cuda --size small --json {tmp_path}/gpu_throughput.json")


@pytest.mark.parametrize("given, seen", [(None, "1"), ("0", "0")])
def test_the_suite_asks_the_device_after_every_op_unless_the_caller_says_otherwise(tmp_path, given, seen):
    show = tmp_path / "show.py"
    show.write_text("import os\nprint('check_device=' + os.environ.get('TORCHTENSORREF_CHECK_DEVICE', '-'))\n")
    done = _run(["--out", str(tmp_path / "out"), "--allow-cpu", "--skip", "cuda,demo,throughput",
                 "--command", f"suite={{python}} {show}"], TORCHTENSORREF_CHECK_DEVICE=given)
    log = (tmp_path / "out" / "suite.log").read_text()
    assert f"check_device={seen}" in log, done.stdout + done.stderr + log
