"""Check the project on a CUDA GPU in one command, within 8 minutes: tests, GPU tests, demo, throughput.

    PYTHONPATH=. python benchmarks/gpu_check.py --out DIR

Runs four steps, each as a subprocess in its own process group, with its own time limit and
its output (stdout and stderr together) in ``DIR/<step>.log``:

- ``suite``: the test suite on CUDA in parallel workers, the device checked after every op
  (``TORCHTENSORREF_TEST_DEVICE=cuda TORCHTENSORREF_CHECK_DEVICE=1``
  ``python -m pytest -n N -q -rfE -p no:cacheprovider``, with
  ``--timeout`` per test where pytest-timeout is installed), junit XML in ``DIR/suite.xml``;
- ``cuda``: the GPU-marked tests (``python -m pytest -m cuda -q -rfE``), junit XML in ``DIR/cuda.xml``;
- ``demo``: ``python -m torchTensorRef demo --device cuda --out DIR/demo`` (the plot is written, never shown);
- ``throughput``: ``python benchmarks/gpu_throughput.py --size small --json DIR/gpu_throughput.json``.

A step past its limit is interrupted (SIGINT to its process group, so that pytest still writes
its junit XML and its summary line), then killed with its group after ``--grace`` seconds, and
marked timed out; the next step still runs. Limits are clipped to ``--total-limit``, so that the
whole run, with the grace periods, fits in 8 minutes. ``DIR/summary.json`` (rewritten after each
step) holds the date, the GPU, torch, CUDA, the driver, transformers, the commit and, per step,
the command, return code, wall seconds, whether it timed out, and what it found: test outcome
counts and the tests that failed or erred (printed by module at the end too: a console that
keeps only its last lines still names them), the demo's last lines, the throughput rows. Exit
status: 0 when every step that ran passed, 1 when one did not, 2 without CUDA (unless
``--allow-cpu``) or on a usage error.

``--allow-cpu`` checks the harness without a GPU: the steps run on ``"sim"`` in place of
``"cuda"`` (throughput with ``--size tiny``); narrow them with ``--suite-args``, ``--skip``
or ``--command``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("suite", "cuda", "demo", "throughput")
# Seconds per step. With the grace period of each (10 s) they add up to the default total
# limit, 465 s: the whole run, the environment probe included, fits in 8 minutes.
LIMITS = {"suite": 195, "cuda": 55, "demo": 35, "throughput": 140}
GRACE = 10.0
TOTAL_LIMIT = 465.0
PROBE_LIMIT = 120.0
COUNT_KEYS = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")
NEEDS_CUDA = ("gpu_check needs CUDA: torch.cuda.is_available() is False (torch {torch}, CUDA build {cuda}). "
              "Run it on a machine with an NVIDIA GPU, or pass --allow-cpu to check the harness on \"sim\" "
              "with a small selection (--suite-args, --skip, --command).")

# Run in the same Python as the steps, so that what it reports is what they ran with; apart
# from this process, which then never holds a CUDA context while the steps use the GPU.
PROBE = r"""
import importlib.metadata as md, importlib.util, json, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
info = {"python": sys.version.split()[0], "transformers": version("transformers"), "pytest": version("pytest"),
        "xdist": importlib.util.find_spec("xdist") is not None,
        "pytest_timeout": importlib.util.find_spec("pytest_timeout") is not None}
try:
    import torch
except Exception as e:
    info["error"] = f"import torch failed: {type(e).__name__}: {e}"
else:
    info.update(torch=torch.__version__, cuda_version=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if info["cuda_available"]:
        info["device_count"] = torch.cuda.device_count()
        info["device_name"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
print(json.dumps(info))
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Steps: " + ", ".join(STEPS) + ". Default limits (s): "
                                       + ", ".join(f"{k} {v}" for k, v in LIMITS.items()) + ".")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the logs, the XML and summary.json")
    p.add_argument("-n", "--workers", type=int, default=8, metavar="N",
                   help="pytest-xdist workers for the suite (default: 8; 0 runs it in one process)")
    p.add_argument("--test-timeout", type=float, default=60, metavar="S",
                   help="pytest-timeout's limit per test in the suite, where it is installed (default: 60)")
    for step in STEPS:
        p.add_argument(f"--{step}-limit", type=float, default=LIMITS[step], metavar="S",
                       help=f"seconds for the {step} step (default: {LIMITS[step]})")
    p.add_argument("--total-limit", type=float, default=TOTAL_LIMIT, metavar="S",
                   help=f"seconds for all the steps together, grace periods included; a step's limit is clipped "
                        f"to what is left (default: {TOTAL_LIMIT:g})")
    p.add_argument("--grace", type=float, default=GRACE, metavar="S",
                   help=f"seconds between interrupting a step past its limit and killing it (default: {GRACE:g})")
    p.add_argument("--skip", default="", metavar="STEPS", help="comma-separated steps not to run, e.g. demo,throughput")
    p.add_argument("--suite-args", default="", metavar="ARGS",
                   help='more pytest arguments for the suite, e.g. "tests/core/test_sizes.py -k parse_size"')
    p.add_argument("--cuda-args", default="", metavar="ARGS", help="more pytest arguments for the cuda step")
    p.add_argument("--demo-args", default="", metavar="ARGS",
                   help="more arguments for the demo, e.g. --demo-args=--quick (with '=' where ARGS starts with '-')")
    p.add_argument("--throughput-args", default="", metavar="ARGS", help="more arguments for gpu_throughput.py")
    p.add_argument("--command", action="append", default=[], metavar="STEP=CMD",
                   help="run CMD (split as a shell would, no shell run) as STEP in place of its usual command; "
                        "{python} is this Python and {out} the output folder. For checking the harness")
    p.add_argument("--allow-cpu", action="store_true",
                   help='without CUDA, run the steps on "sim" rather than refusing (a check of the harness)')
    args = p.parse_args(argv)
    args.skip = [s.strip() for s in args.skip.split(",") if s.strip()]
    for s in args.skip:
        if s not in STEPS:
            p.error(f"--skip: unknown step {s!r}; the steps are {', '.join(STEPS)}")
    overrides = {}
    for item in args.command:
        name, sep, cmd = item.partition("=")
        if not sep or name not in STEPS or not cmd.strip():
            p.error(f"--command: expected STEP=CMD with STEP one of {', '.join(STEPS)} (got: {item!r})")
        overrides[name] = cmd
    args.command = overrides
    for step in STEPS:
        if getattr(args, f"{step}_limit") <= 0:
            p.error(f"--{step}-limit must be a positive number of seconds")
    if args.workers < 0 or args.total_limit <= 0 or args.grace < 0:
        p.error("--workers and --grace must be >= 0, --total-limit > 0")
    for name in ("suite_args", "cuda_args", "demo_args", "throughput_args"):
        try:
            setattr(args, name, shlex.split(getattr(args, name)))
        except ValueError as e:
            p.error(f"--{name.replace('_', '-')}: {e}")
    return args


# -- the environment ---------------------------------------------------------------------------

def probe(env: Dict[str, str]) -> dict:
    """torch, CUDA, the GPU and the test plugins, as the steps' Python sees them."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=PROBE_LIMIT)
    except subprocess.TimeoutExpired:
        return {"error": f"the environment probe (import torch, CUDA init) took more than {PROBE_LIMIT:g} s"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"the environment probe failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"}


def driver_version() -> Optional[str]:
    """The NVIDIA driver's version from nvidia-smi; None where there is none."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def git_commit() -> Optional[str]:
    """HEAD's commit, with "+changes" when tracked files differ from it; None outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if dirty else "")


# -- the steps ---------------------------------------------------------------------------------

def cuda_test_files() -> List[str]:
    """The test files that mark tests ``cuda``: collecting only them takes seconds, where
    collecting the whole suite (and importing what its modules import) took 30 s of the
    step's limit on a GPU machine."""
    found = []
    for folder, _dirs, files in os.walk(os.path.join(ROOT, "tests")):
        for name in sorted(files):
            path = os.path.join(folder, name)
            if not (name.startswith("test_") and name.endswith(".py")) or name == "test_gpu_check.py":
                continue
            with open(path, encoding="utf-8") as f:
                if "mark.cuda" in f.read():
                    found.append(os.path.relpath(path, ROOT))
    return sorted(found)


#: what a step's environment adds: the suite asks the device after every op whether it held
#: more than the budget (``tensorsManager.check_device``; a test where it did fails), unless
#: the caller's environment says otherwise
STEP_ENV = {"suite": {"TORCHTENSORREF_CHECK_DEVICE": "1"}}


def commands(args, out: str, device: str, info: dict) -> Dict[str, List[str]]:
    """Each step's argv."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    suite = pytest + ["--junitxml", os.path.join(out, "suite.xml")]
    if args.workers and info.get("xdist"):
        suite += ["-n", str(args.workers)]
    if args.test_timeout and info.get("pytest_timeout"):
        suite += ["--timeout", f"{args.test_timeout:g}"]
    # This file's own tests check the harness on the CPU: no GPU figure in them. So do the
    # benchmarks' (their tiny sizes on "sim", which a CUDA process runs in its lenient form):
    # on an H100 machine ten of them reached the 60 s limit per test, the suite's step with them
    suite += ["--ignore", os.path.join("tests", "test_gpu_check.py"),
              "--ignore", os.path.join("tests", "test_benchmarks.py")] + args.suite_args
    throughput = [py, os.path.join("benchmarks", "gpu_throughput.py"), "--device", device,
                  "--size", "small" if device == "cuda" else "tiny", "--json", os.path.join(out, "gpu_throughput.json")]
    argv = {
        "suite": suite,
        "cuda": pytest + ["-m", "cuda", "--junitxml", os.path.join(out, "cuda.xml")] + args.cuda_args
                + ([] if any(os.path.exists(a) for a in args.cuda_args) else cuda_test_files()),
        "demo": [py, "-m", "torchTensorRef", "demo", "--device", device, "--out", os.path.join(out, "demo")]
                + args.demo_args,
        "throughput": throughput + args.throughput_args,
    }
    for step, cmd in args.command.items():
        argv[step] = [a.replace("{python}", py).replace("{out}", out) for a in shlex.split(cmd)]
    return argv


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_step(argv: List[str], env: Dict[str, str], log_path: str, limit: float, grace: float) -> dict:
    """Run ``argv`` in a new process group, output to ``log_path``; interrupt, then kill it past ``limit``."""
    start = time.monotonic()
    timed_out = interrupted = False
    with open(log_path, "wb") as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
            except KeyboardInterrupt:
                interrupted = True
            if proc.poll() is None:
                # SIGINT to the whole group: pytest (and its xdist workers) then write the junit
                # XML and the summary line of what ran; whatever is left is killed after the grace.
                kill_group(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            # The group's leftovers too (workers, children of the step), whatever happened
            kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
        seconds = time.monotonic() - start
        note = ("timed out" if timed_out else "interrupted") if timed_out or interrupted else None
        if note:
            log.write(f"\n[gpu_check] {note} after {seconds:.1f} s (limit {limit:g} s): process group killed\n"
                      .encode())
    return {"returncode": proc.returncode, "seconds": round(seconds, 2), "timed_out": timed_out,
            "interrupted": interrupted}


# -- what each step found ----------------------------------------------------------------------

def junit_counts(path: str) -> Optional[dict]:
    """Outcome counts from a pytest junit XML, as pytest's summary counts them; None if unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = dict.fromkeys(COUNT_KEYS, 0)
    for case in root.iter("testcase"):
        if case.get("name") is None:  # placeholders xdist leaves for tests interrupted mid-run
            continue
        tags = [child.tag for child in case]
        errors = [child for child in case if child.tag == "error"]
        counts["errors"] += len(errors)
        if "failure" in tags:
            counts["failed"] += 1
        elif "skipped" in tags:
            skipped = next(child for child in case if child.tag == "skipped")
            counts["xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"] += 1
        elif not any((e.get("message") or "").startswith(("failed on setup", "collection failure"))
                     for e in errors):
            # a test that errs only in teardown has passed as well (pytest counts both); an
            # xpass that is not strict is written as a pass, so xpassed stays 0 here
            counts["passed"] += 1
    return counts


def junit_problems(path: str, most: int = 500) -> Optional[List[dict]]:
    """The tests that failed or erred, from a pytest junit XML: ``test`` (``module.Class::name``),
    ``outcome`` ("failed", or "error" at setup or teardown) and the first line of its
    ``message``; at most ``most`` of them. None if the XML is unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    found: List[dict] = []
    for case in root.iter("testcase"):
        name = case.get("name")
        if name is None:
            continue
        test = case.get("classname", "") + "::" + name
        for child in case:
            if child.tag in ("failure", "error") and len(found) < most:
                message = (child.get("message") or "").strip().splitlines()
                found.append({"test": test, "outcome": "failed" if child.tag == "failure" else "error",
                              "message": message[0][:300] if message else ""})
    return found


def problems_by_module(problems: List[dict], most: int = 40) -> List[str]:
    """One line per test module (or class), the most problems first: their count and the
    first message, so that a console that keeps only its last lines still names what failed."""
    modules: Dict[str, List[dict]] = {}
    for p in problems:
        modules.setdefault(p["test"].split("::")[0], []).append(p)
    ranked = sorted(modules.items(), key=lambda kv: -len(kv[1]))
    return [f"{len(ps):4} {name}: {ps[0]['outcome']}: {ps[0]['message'][:110]}" for name, ps in ranked[:most]]


SUMMARY_WORDS = {"passed": "passed", "failed": "failed", "error": "errors", "errors": "errors",
                 "skipped": "skipped", "xfailed": "xfailed", "xpassed": "xpassed"}


def summary_line(log_path: str) -> Optional[str]:
    """pytest's final line (``3 passed, 1 failed in 2.1s``), or None."""
    for line in reversed(read_lines(log_path)):
        text = line.strip().strip("=").strip()
        if re.search(r"\bin [\d.]+s\b", text) and (re.search(r"\d+ (passed|failed|errors?|skipped|xfailed|"
                                                              r"xpassed|deselected)\b", text)
                                                   or text.startswith("no tests ran")):
            return text
    return None


def line_counts(line: Optional[str]) -> Optional[dict]:
    """The outcome counts in pytest's last line (deselected tests are not outcomes); None without one."""
    if line is None:
        return None
    counts = dict.fromkeys(COUNT_KEYS, 0)
    for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b", line):
        counts[SUMMARY_WORDS[word]] = int(n)
    return counts


def read_lines(path: str) -> List[str]:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    # progress bars redraw with \r: the last state of each line is what a terminal shows
    return [line.split("\r")[-1] for line in text.splitlines()]


def pytest_findings(log_path: str, xml_path: str) -> dict:
    line = summary_line(log_path)
    counts = junit_counts(xml_path)
    found = {"summary_line": line, "counts": counts, "counts_from": "junit" if counts is not None else None,
             "problems": junit_problems(xml_path)}
    if counts is None:
        found["counts"] = line_counts(line)
        found["counts_from"] = "last line" if line is not None else None
    deselected = re.search(r"(\d+) deselected\b", line or "")
    if deselected:
        found["deselected"] = int(deselected.group(1))
    return found


def demo_findings(log_path: str, n: int = 15) -> dict:
    # (past the command this harness wrote first, and not its own note of a timeout)
    lines = [line.rstrip() for line in read_lines(log_path)[1:] if line.strip() and not line.startswith("[gpu_check]")]
    return {"last_lines": lines[-n:]}


def throughput_findings(log_path: str, json_path: str) -> dict:
    """The rows of gpu_throughput: from its JSON, else from the line it prints per configuration."""
    rows, checks, source = None, None, None
    try:
        with open(json_path) as f:
            result = json.load(f)
        rows, checks, source = result.get("rows"), result.get("checks"), "json"
    except (OSError, ValueError):
        pass
    if rows is None:
        rows = []
        for line in read_lines(log_path):
            if line.startswith('{"config"'):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
        source = "log" if rows else None
    compact, errors = [], []
    for r in rows:
        row = {"config": r.get("config"), "budget_fraction": r.get("budget_fraction"), "budget": r.get("budget")}
        for workload in ("generate", "train"):
            m = r.get(workload) or {}
            row[workload] = {k: m[k] for k in ("tokens_per_s", "seconds", "moved", "peak", "bound_to_measured",
                                               "to_accelerate", "to_resident", "peak_to_budget", "error", "skipped")
                             if k in m}
            if "error" in m:
                frac = r.get("budget_fraction")
                where = r.get("config") if frac is None else f"{r.get('config')} {frac:.0%}"
                errors.append(f"{where} {workload}: {m['error']}")
        compact.append(row)
    found = {"rows": compact, "rows_from": source, "row_errors": errors}
    if checks is not None:
        found["checks"] = checks
    return found


def describe(step: dict) -> str:
    """One line for the table."""
    counts = step.get("counts")
    if counts:
        text = ", ".join(f"{counts[k]} {k}" for k in COUNT_KEYS if counts.get(k))
        return text or "no tests ran"
    if "rows" in step:
        text = f"{len(step['rows'])} rows"
        if step["row_errors"]:
            text += f", {len(step['row_errors'])} raised"
        return text
    if step.get("last_lines"):
        return step["last_lines"][-1][:70]
    return step.get("reason", "")


def table(summary: dict) -> str:
    lines = [f"{'step':<11} {'status':<10} {'rc':>4} {'seconds':>8} {'limit':>6}  found"]
    for name, s in summary["steps"].items():
        rc = "-" if s.get("returncode") is None else str(s["returncode"])
        secs = "-" if s.get("seconds") is None else f"{s['seconds']:.1f}"
        limit = "-" if s.get("limit_s") is None else f"{s['limit_s']:g}"
        lines.append(f"{name:<11} {s['status']:<10} {rc:>4} {secs:>8} {limit:>6}  {describe(s)}")
    return "\n".join(lines)


def write_summary(path: str, summary: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["MPLBACKEND"] = "Agg"  # the demo's plot goes to a file; no window, on any machine
    info = probe(env)
    if "error" in info:
        print(f"gpu_check: {info['error']}", file=sys.stderr)
        return 2
    if info["cuda_available"]:
        device = "cuda"
    elif args.allow_cpu:
        device = "sim"
        print('gpu_check: no CUDA; --allow-cpu: running the steps on "sim" (a check of the harness, no GPU figure)',
              file=sys.stderr)
    else:
        print(NEEDS_CUDA.format(torch=info.get("torch"), cuda=info.get("cuda_version")), file=sys.stderr)
        return 2
    # every step: the cuda-marked tests too, whose fixtures would otherwise select "sim"
    # (registering it in a CUDA process breaks CUDA backward)
    env["TORCHTENSORREF_TEST_DEVICE"] = device
    argv_of = commands(args, out, device, info)
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/gpu_check.py"] + list(sys.argv[1:] if argv is None else argv)),
        "device": device,
        "device_name": info.get("device_name"),
        "device_count": info.get("device_count"),
        "capability": info.get("capability"),
        "torch": info.get("torch"),
        "cuda_version": info.get("cuda_version"),
        "driver": driver_version() if device == "cuda" else None,
        "transformers": info.get("transformers"),
        "python": info.get("python"),
        "commit": git_commit(),
        "pytest_timeout": info.get("pytest_timeout"),
        "xdist": info.get("xdist"),
        "step_env": {"TORCHTENSORREF_TEST_DEVICE": device, "MPLBACKEND": "Agg", "PYTHONPATH": ROOT},
        "total_limit_s": args.total_limit,
        "grace_s": args.grace,
        "finished": False,
        "steps": {},
    }
    summary_path = os.path.join(out, "summary.json")
    deadline = started + args.total_limit
    interrupted = False
    for name in STEPS:
        step = {"command": shlex.join(argv_of[name]), "log": os.path.join(out, f"{name}.log")}
        summary["steps"][name] = step
        if name in args.skip or interrupted:
            step.update(status="skipped", returncode=None, seconds=None, timed_out=False, limit_s=None,
                        reason="--skip" if name in args.skip else "interrupted before it started")
            continue
        limit = min(getattr(args, f"{name}_limit"), deadline - time.monotonic() - args.grace)
        if limit < 1:
            step.update(status="timed out", returncode=None, seconds=0.0, timed_out=True, limit_s=0,
                        reason=f"not started: --total-limit {args.total_limit:g} s reached")
            write_summary(summary_path, summary)
            continue
        step["limit_s"] = round(limit, 1)
        print(f"gpu_check: {name} (limit {limit:.0f} s): {step['command']}", file=sys.stderr, flush=True)
        step.update(run_step(argv_of[name], STEP_ENV.get(name, {}) | env, step["log"], limit, args.grace))
        if name in ("suite", "cuda"):
            step.update(pytest_findings(step["log"], os.path.join(out, f"{name}.xml")))
        elif name == "demo":
            step.update(demo_findings(step["log"]))
        else:
            step.update(throughput_findings(step["log"], os.path.join(out, "gpu_throughput.json")))
        ok = step["returncode"] == 0 and not step["timed_out"] and not step["interrupted"]
        if name == "throughput":  # a configuration that raised is a failure even when the script exits 0
            ok = ok and bool(step["rows"]) and not step["row_errors"]
        step["passed"] = ok
        step["status"] = ("timed out" if step["timed_out"] else "interrupted" if step["interrupted"]
                          else "passed" if ok else "failed")
        interrupted = step["interrupted"]
        write_summary(summary_path, summary)
    ran = [s for s in summary["steps"].values() if s["status"] != "skipped"]
    summary["passed"] = bool(ran) and all(s["status"] == "passed" for s in ran) and not interrupted
    summary["wall_seconds"] = round(time.monotonic() - started, 2)
    summary["finished"] = True
    write_summary(summary_path, summary)
    print(f"\n{summary['device_name'] or device}, torch {summary['torch']}, CUDA {summary['cuda_version']}, "
          f"commit {summary['commit']}")
    for name, s in summary["steps"].items():
        if s.get("problems"):
            print(f"{name}: {len(s['problems'])} failed or erred, by module (every one in summary.json):")
            print("\n".join(problems_by_module(s["problems"])))
    print(table(summary))
    print(f"{'all steps passed' if summary['passed'] else 'NOT all steps passed'} in {summary['wall_seconds']:.0f} s; "
          f"logs and {os.path.basename(summary_path)} in {out}")
    if interrupted:
        return 130
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
