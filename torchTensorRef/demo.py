"""Run a GPT-2 model plain and under each strategy with a budget below its weights; compare.

``python -m torchTensorRef demo`` builds a ``transformers`` GPT-2 model from a small config
(random weights, nothing downloaded), runs one forward pass and a greedy ``generate()``
plain, then once per strategy in ``torchTensorRef.strategies.NAMES`` with the accelerator
budget at half the parameter bytes. It prints whether the outputs equal plain torch's,
the peak accelerator bytes against the budget, the bytes moved and the time, and writes a
memory-over-time plot and one Chrome trace per strategy.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

from . import strategies
from .core.errors import OutOfBudgetError
from .core.sizes import format_size, parse_size
from .integrations.manage import manage
from .integrations.plain import disabled
from .memory.manager import tensorsManager

#: model and run sizes: the default, and ``--quick`` (a smoke test in seconds)
SIZES = {
    "default": dict(layers=8, embd=256, heads=8, vocab=4096, prompt=32, tokens=24),
    "quick": dict(layers=2, embd=64, heads=4, vocab=256, prompt=8, tokens=4),
}
PLOT_HINT = 'pip install "torchTensorRef[plot]"'


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got: {text!r})")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    parser.add_argument("--device", metavar="D", default=None,
                        help='"cuda", "cuda:N" or "sim"; default: TORCHTENSORREF_DEVICE, else cuda '
                             'when available, else sim')
    parser.add_argument("--budget", metavar="B", default=None,
                        help='accelerator budget such as "8MiB"; default: what the device holds outside the manager '
                             '(library workspaces) plus half the parameter bytes')
    parser.add_argument("--out", metavar="DIR", default="torchTensorRef-demo",
                        help="folder for the plot and the traces (default: ./torchTensorRef-demo)")
    parser.add_argument("--layers", metavar="N", type=_positive_int, default=None,
                        help=f"transformer layers (default: {SIZES['default']['layers']})")
    parser.add_argument("--tokens", metavar="N", type=_positive_int, default=None,
                        help=f"tokens to generate (default: {SIZES['default']['tokens']})")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and few tokens: checks that everything works, in seconds")


class _Progress:
    """A one-line text progress bar on stderr (a ``generate()`` streamer too)."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done = label, total, 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._prompt_seen = False

    def step(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if self.tty:
            self._draw("\r")

    def _draw(self, prefix: str, end: str = "") -> None:
        width = 24
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"{prefix}  {self.label:<6} [{bar}] {self.done}/{self.total} steps  {elapsed:5.1f} s{end}")
        sys.stderr.flush()

    def close(self) -> None:
        self._draw("\r" if self.tty else "", "\n")

    # the streamer protocol of ``generate()``: the prompt first, then each new token
    def put(self, value) -> None:
        if self._prompt_seen:
            self.step()
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _config(size: dict):
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=size["layers"], n_embd=size["embd"], n_head=size["heads"], vocab_size=size["vocab"],
        n_positions=size["prompt"] + size["tokens"] + 8, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )


def _build(config, seed: int = 0):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(model, ids, tokens: int, progress: _Progress, device: torch.device):
    """One forward pass and a greedy ``generate()``; returns (logits, tokens, seconds)."""
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(ids).logits
        progress.step()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             streamer=progress, pad_token_id=0)
    _sync(device)
    return logits, out, time.perf_counter() - start


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    from .core.tensor_ref import TensorRef

    if isinstance(t, TensorRef):
        with disabled():
            return t.target.detach().cpu().clone()
    return t.detach().cpu()


def _compare(got: torch.Tensor, want: torch.Tensor) -> str:
    got, want = _plain_tensor(got), _plain_tensor(want)
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}"
    if torch.equal(got, want):
        return "identical"
    if got.is_floating_point():
        return f"max diff {(got.double() - want.double()).abs().max().item():.1e}"
    return f"{int((got != want).sum())} differ"


def _table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _plot(traces: Dict[str, object], budget: int, param_bytes: int, path: str) -> Optional[str]:
    """Resident accelerator bytes over time, one line per strategy; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.2))
    mib = 2**20
    for name, trace in traces.items():
        if not trace.resident:
            continue
        times = [0.0] + [(t - trace.t0) / 1e9 for t, _b in trace.resident]
        values = [trace.resident[0][1] / mib] + [b / mib for _t, b in trace.resident]
        ax.step(times, values, where="post", label=name, linewidth=1)
    ax.axhline(budget / mib, color="red", linestyle="--", linewidth=1, label="budget")
    ax.axhline(param_bytes / mib, color="gray", linestyle=":", linewidth=1, label="model parameters")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("accelerator memory in use (MiB)")
    ax.set_title(f"GPT-2 forward + generate(), budget {format_size(budget)}")
    top = max([param_bytes, budget] + [b for t in traces.values() for _t, b in t.resident]) / mib
    ax.set_ylim(0, top * 1.3)  # room above the lines for a one-row legend
    ax.legend(loc="upper center", ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _check_out(parser: argparse.ArgumentParser, out: str) -> None:
    """Make the ``--out`` folder and write a file there, or stop with a usage error."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        parser.error(f"--out must be a folder the demo can write its plot and traces to (got: {out!r}: "
                     f"{e.strerror or e}): give another folder")


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every strategy reproduced plain torch's outputs."""
    try:
        import transformers
    except ImportError:
        parser.error('the demo needs the transformers package: pip install "torchTensorRef[demo]" '
                     "(or pip install transformers)")
    transformers.logging.set_verbosity_error()
    _check_out(parser, args.out)  # (before the runs: they take minutes, then write there)
    from .running import default_device

    device_name = args.device or default_device()
    if device_name.strip().lower() == "cpu":
        parser.error('--device: the demo needs an accelerator to compare against: "cuda", "cuda:N" or "sim"')
    try:
        tensorsManager.device = device_name
    except ValueError as e:
        parser.error(f"--device: {e}")
    size = dict(SIZES["quick" if args.quick else "default"])
    for key in ("layers", "tokens"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    declared = tensorsManager.torch_device  # (resolves "cuda" to "cuda:N")
    compute = tensorsManager.backend.compute
    if compute.type == "cpu":
        # The ops of a model this small are too short for intra-op threads to pay off; on a
        # busy machine waking them dominates, and the timings would measure that.
        torch.set_num_threads(1)
    names = list(strategies.NAMES)
    config = _config(size)

    # -- plain torch: the reference ------------------------------------------------------
    # On the managed tensors' device: initialised by the same generator and run by the same
    # kernels (the CPU's own kernels differ from an accelerator's in the last bits).
    with disabled(device=declared):
        plain = _build(config)
        param_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
        ids = torch.randint(0, size["vocab"], (1, size["prompt"]), device="cpu",
                            generator=torch.Generator().manual_seed(1)).to(declared)
        try:
            asked = parse_size(args.budget) if args.budget is not None else None
        except ValueError as e:
            parser.error(f"--budget: {e}")
        layers = f"{size['layers']} layer{'s' if size['layers'] > 1 else ''}"
        print(f"GPT-2, {layers}, {size['embd']} wide, vocabulary {size['vocab']}: "
              f"{format_size(param_bytes)} of parameters, on {tensorsManager.device}; forward pass on "
              f"{size['prompt']} tokens, then generate() {size['tokens']} more.", file=sys.stderr)
        with torch.no_grad():  # generate()'s first call sets things up: keep it out of the timings
            plain.generate(ids[:, :2], max_new_tokens=1, pad_token_id=0)
        if compute.type == "cuda":
            torch.cuda.reset_peak_memory_stats(compute)
        progress = _Progress("plain", size["tokens"] + 1)
        want_logits, want_tokens, plain_time = _run(plain, ids, size["tokens"], progress, compute)
        progress.close()
        plain_peak = torch.cuda.max_memory_allocated(compute) if compute.type == "cuda" else None
        plain_ids = ids.cpu().clone()
        want_logits, want_tokens = want_logits.cpu(), want_tokens.cpu()
        del plain, ids

    # The budget covers what libraries keep allocated on the device (cuBLAS's workspaces, tens
    # of MiB on a GPU: Note [Budget on CUDA]), read once the reference model is gone (the
    # device counts a plain model's tensors too); by default half the weights on top.
    gc.collect()
    outside = tensorsManager.outside_bytes()
    budget = asked if asked is not None else outside + param_bytes // 2
    print(f"Budget {format_size(budget)} ({format_size(outside)} of it allocated outside the manager: "
          f"library workspaces), against {format_size(param_bytes)} of weights.", file=sys.stderr)

    rows = [["plain", "reference", "reference",
             format_size(plain_peak) if plain_peak is not None else f">= {format_size(param_bytes)} (weights)",
             "-", "-", "-", f"{plain_time:.1f} s"]]

    # -- the same code with TensorRefs, once per strategy ---------------------------------
    tensorsManager.strategy = names[0]
    tensorsManager.budget = None
    model = _build(config)  # torch is patched: every parameter is a TensorRef
    ids = manage(plain_ids)
    traces = {}
    ok = True
    for name in names:
        tensorsManager.evict_all()  # start each strategy with nothing resident
        tensorsManager.strategy = name
        try:
            tensorsManager.budget = budget
        except OutOfBudgetError as e:
            parser.error(f"--budget: {e}")
        tensorsManager.reset_stats()
        progress = _Progress(name, size["tokens"] + 1)
        try:
            with tensorsManager.recording() as trace:
                logits, tokens, seconds = _run(model, ids, size["tokens"], progress, compute)
        except OutOfBudgetError as e:
            progress.close()
            print(f"error: {e}\nThe budget must hold the largest single op; try --budget "
                  f"{format_size(e.needed).replace(' ', '')} or more.", file=sys.stderr)
            return 1
        progress.close()
        s = tensorsManager.stats()
        same_logits, same_tokens = _compare(logits, want_logits), _compare(tokens, want_tokens)
        ok = ok and same_logits == "identical" and same_tokens == "identical"
        # The peak the budget bounds: what the device had allocated (torch.cuda's reading
        # on CUDA; elsewhere the manager's blocks and what it last saw beside them).
        peak = s.get("max_memory_allocated", s["peak_device_bytes"] + s["outside_bytes"])
        rows.append([name, same_logits, same_tokens,
                     f"{format_size(peak)} ({100 * peak / max(budget, 1):.0f}%)",
                     format_size(s["bytes_to_device"]), format_size(s["bytes_to_host"]),
                     str(s["evictions"]), f"{seconds:.1f} s"])
        traces[name] = trace
        trace.save(os.path.join(args.out, f"trace-{name}.json"))

    print()
    print(_table(rows, ["run", "logits", "tokens", f"peak vs budget {format_size(budget)}",
                        "to accelerator", "to host", "evictions", "time"]))
    print()
    plot = _plot(traces, budget, param_bytes, os.path.join(args.out, "memory.png"))
    if plot is None:
        print(f"Memory plot skipped: matplotlib is not installed ({PLOT_HINT}).")
    else:
        print(f"Memory over time: {plot}")
    for name in traces:
        print(f"Chrome trace ({name}): {os.path.join(args.out, f'trace-{name}.json')}  "
              f"(open in https://ui.perfetto.dev)")
    if not ok:
        print("Some outputs differ from plain torch's.", file=sys.stderr)
    return 0 if ok else 1
