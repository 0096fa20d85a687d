"""A model larger than its host budget, decoded from its checkpoint on disk.

A Llama-style model of about 2.3 GB (random weights, float32) is written as a safetensors
checkpoint by a plain-torch process, which also decodes a few tokens greedily as the
reference. This process then loads it with ``from_pretrained`` under torchTensorRef on
``"sim"``, with a host budget of a third of the weights and a device budget of a tenth, and
decodes the same tokens three times (Flow learns the period in the first two calls and
follows its plan in the third, which is recorded). It prints:

- whether the tokens equal plain torch's;
- the peak resident memory of the process (sampled every 5 ms) above what it held before
  loading, beside the host budget and the simulated device's budget (on ``"sim"`` the device
  is host memory too; on a GPU it is not);
- bytes read from disk per forward pass of the recorded call, beside the offline reference
  on the same trace (``offline.reference_disk_moves``);
- the rate of those reads beside a sequential read of the same file (its page-cache pages
  dropped first), measured in the same run.

    python benchmarks/disk_tier.py [--layers 10] [--tokens 4] [--json docs/benchmarks/disk_tier.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = [[1, 306, 4966, 263, 931, 12892, 727, 471]]


def config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, vocab_size=16000,
                       max_position_embeddings=256, tie_word_embeddings=False)


def write(folder: str, layers: int, tokens: int) -> None:
    """(In a plain-torch process) build, save and decode the reference."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config(layers)).eval()
    model.save_pretrained(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=tokens, do_sample=False)
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump({"tokens": out.tolist()}, f)


class PeakRSS:
    """Samples the process's resident memory every ``every`` seconds; ``peak`` is the largest
    seen, ``peak_less_device`` the largest less the simulated device's bytes at that moment
    (on ``"sim"`` device memory is host memory; on a GPU those bytes would not be resident)."""

    def __init__(self, every: float = 0.005):
        import psutil

        self._process = psutil.Process()
        self.peak = self.peak_less_device = self._process.memory_info().rss
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        from torchTensorRef import tensorsManager as tm

        while not self._stop.is_set():
            device = tm.accounting.resident + tm.accounting.pending_bytes  # (read without the lock: a sample)
            rss = self._process.memory_info().rss
            device = min(device, tm.accounting.resident + tm.accounting.pending_bytes)  # (either side of the reading)
            self.peak = max(self.peak, rss)
            self.peak_less_device = max(self.peak_less_device, rss - device)
            time.sleep(self._every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


def sequential_read_rate(path: str, chunk: int = 16 << 20) -> float:
    """Bytes per second reading ``path`` start to end, its cached pages dropped first."""
    import numpy as np

    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buffer = memoryview(np.empty(chunk, dtype=np.uint8))
        start, total = time.perf_counter(), 0
        while True:
            n = os.readv(fd, [buffer])
            if not n:
                break
            total += n
        seconds = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return total / seconds
    finally:
        os.close(fd)


def measure(folder: str, tokens: int, device_fraction: float, host_fraction: float, warmup: int) -> dict:
    import psutil
    import torch
    import transformers

    import torchTensorRef
    from torchTensorRef.memory import disk
    from torchTensorRef import tensorsManager as tm
    from torchTensorRef.analysis.offline import reference_disk_moves

    files = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors")]
    for path in files:  # (the writer left them in the page cache: start from the disk)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    weights = sum(os.path.getsize(p) for p in files)
    tm.device = "sim"
    tm.strategy = "flow"
    tm.budget = int(weights * device_fraction)
    tm.host_budget = int(weights * host_fraction)

    read_seconds = [0.0]
    read_bytes = [0]
    plain_read = disk.FileRange.read_into

    def timed_read(self, buffer):
        start = time.perf_counter()
        plain_read(self, buffer)
        read_seconds[0] += time.perf_counter() - start
        read_bytes[0] += self.nbytes

    disk.FileRange.read_into = timed_read
    before = psutil.Process().memory_info().rss
    with PeakRSS() as rss:
        load_start = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        load_seconds = time.perf_counter() - load_start
        loaded = tm.stats()
        after_load = psutil.Process().memory_info().rss
        prompt = torch.tensor(PROMPT)
        with torch.no_grad():
            first_start = time.perf_counter()
            first = model.generate(prompt, max_new_tokens=tokens, do_sample=False)
            first_seconds = time.perf_counter() - first_start
            for _ in range(warmup - 1):  # (Flow follows its plan once a whole call repeated)
                model.generate(prompt, max_new_tokens=tokens, do_sample=False)
            tm.reset_stats()
            read_seconds[0], read_bytes[0] = 0.0, 0
            with tm.recording() as trace:
                second_start = time.perf_counter()
                second = model.generate(prompt, max_new_tokens=tokens, do_sample=False)
                second_seconds = time.perf_counter() - second_start
        stats = tm.stats()
    disk.FileRange.read_into = plain_read
    reference = reference_disk_moves(trace, tm.budget, tm.host_budget)
    with open(os.path.join(folder, "reference.json")) as f:
        expected = json.load(f)["tokens"]
    file_rate = sequential_read_rate(max(files, key=os.path.getsize))
    forwards = tokens  # (greedy generate: one forward pass per new token)
    return {
        "weights_bytes": weights,
        "host_budget": tm.host_budget,
        "device_budget": tm.budget,
        "tokens_equal_plain": first.tolist() == expected and second.tolist() == expected,
        "load_seconds": load_seconds,
        "bytes_read_while_loading": loaded["bytes_from_disk"],
        "first_call_seconds": first_seconds,
        "recorded_call_seconds": second_seconds,
        "peak_rss_above_start": rss.peak - before,
        "peak_rss_less_sim_device_above_start": rss.peak_less_device - before,
        "rss_added_by_loading": after_load - before,
        "peak_host_bytes": stats["peak_host_bytes"],
        "peak_device_bytes": stats["peak_device_bytes"],
        "bytes_from_disk_per_forward": stats["bytes_from_disk"] / forwards,
        "reference_bytes_from_disk_per_forward": reference["bytes_from_disk"] / forwards,
        "bytes_to_disk": stats["bytes_to_disk"],
        "read_rate": read_bytes[0] / read_seconds[0] if read_seconds[0] else None,
        "sequential_read_rate": file_rate,
        "torchTensorRef": torchTensorRef.__version__,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10, help="decoder layers (10: about 2.3 GB)")
    parser.add_argument("--tokens", type=int, default=4, help="new tokens per generate() call")
    parser.add_argument("--warmup", type=int, default=3, help="generate() calls before the recorded one")
    parser.add_argument("--device-fraction", type=float, default=0.1, help="device budget / weights")
    parser.add_argument("--host-fraction", type=float, default=1 / 3, help="host budget / weights")
    parser.add_argument("--folder", default=None, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--write", default=None, help=argparse.SUPPRESS)  # (the plain-torch writer)
    args = parser.parse_args(argv)
    if args.write:
        write(args.write, args.layers, args.tokens)
        return 0
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        subprocess.run([sys.executable, __file__, "--write", folder, "--layers", str(args.layers),
                        "--tokens", str(args.tokens)], check=True)
        result = measure(folder, args.tokens, args.device_fraction, args.host_fraction, args.warmup)
    gib = 2**30
    r = result
    print(f"weights {r['weights_bytes'] / gib:.2f} GiB on disk; host budget {r['host_budget'] / gib:.2f} GiB, "
          f"device budget {r['device_budget'] / gib:.2f} GiB (sim: in host memory too)")
    print(f"tokens equal plain torch: {r['tokens_equal_plain']}")
    print(f"loading read {r['bytes_read_while_loading']} bytes in {r['load_seconds']:.1f} s and added "
          f"{r['rss_added_by_loading'] / gib:.2f} GiB to the process (the model's Python objects)")
    print(f"peak resident memory above the start: {r['peak_rss_above_start'] / gib:.2f} GiB = "
          f"{r['peak_rss_above_start'] / r['host_budget']:.2f}x the host budget, "
          f"{r['peak_rss_above_start'] / (r['host_budget'] + r['device_budget']):.2f}x host + device budgets")
    print(f"the same less the simulated device's bytes (device memory on a GPU): "
          f"{r['peak_rss_less_sim_device_above_start'] / gib:.2f} GiB = "
          f"{r['peak_rss_less_sim_device_above_start'] / r['host_budget']:.2f}x the host budget")
    print(f"read from disk per forward: {r['bytes_from_disk_per_forward'] / gib:.3f} GiB = "
          f"{r['bytes_from_disk_per_forward'] / r['reference_bytes_from_disk_per_forward']:.3f}x the offline "
          f"reference ({r['reference_bytes_from_disk_per_forward'] / gib:.3f} GiB)")
    if r["read_rate"]:
        print(f"read rate {r['read_rate'] / 1e9:.2f} GB/s = {r['read_rate'] / r['sequential_read_rate']:.2f}x "
              f"a sequential read of the file ({r['sequential_read_rate'] / 1e9:.2f} GB/s)")
    print(f"generate({args.tokens} tokens): first call {r['first_call_seconds']:.1f} s, "
          f"recorded call (after {args.warmup}) {r['recorded_call_seconds']:.1f} s")
    if args.json:
        from benchmarks import common  # (not at the top: the writer process imports no torchTensorRef)

        common.write_result(args.json, "benchmarks/disk_tier.py", argv, "sim", result)
    return 0 if result["tokens_equal_plain"] else 1


if __name__ == "__main__":
    sys.exit(main())
