"""What FSDP2 on TensorRefs costs each rank: the bytes of its own buffers, and the copies.

Two ranks over ``gloo`` on the simulated device, a stack of ``Linear(256, 256)`` layers,
``fully_shard`` per layer and at the root, AdamW. Each rank prints the bytes of every block
its manager holds (device or host) after each stage, and the bytes moved in a steady step
under Flow at half the parameter bytes, with FSDP2's frees turned into discards (what
torchTensorRef does) and, for comparison, ignored (the gathered parameters then stay
ordinary dirty blocks, written back when evicted).

    python benchmarks/fsdp_memory.py [--layers 8] [--width 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _block_bytes() -> int:
    from torchTensorRef import tensorsManager

    with tensorsManager.lock:
        return sum(b.nbytes for b in tensorsManager.books.blocks.values())


def _rank(rank: int, world: int, init_file: str, layers: int, width: int, discard: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from torchTensorRef import tensorsManager

    dist.init_process_group("cpu:gloo,sim:gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tensorsManager.device = "sim"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not discard:  # FSDP2's frees ignored: the comparison
        tensorsManager.discard = lambda ref: None
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    lines = [f"parameters {params} B"]

    def stage(name):
        lines.append(f"{name}: blocks {_block_bytes() - base} B ({(_block_bytes() - base) / params:.2f} x parameters)")

    base = _block_bytes() - params
    mesh = init_device_mesh("sim", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    stage("after fully_shard")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    tensorsManager.strategy = "flow"
    tensorsManager.budget = params // 2
    for step in range(4):
        if step == 3:
            tensorsManager.reset_stats()
        torch.manual_seed(step + rank)
        loss = model(torch.randn(8, width)).square().mean()
        loss.backward()
        if step == 0:
            stage("after forward and backward")
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            stage("after the optimizer step")
    s = tensorsManager.stats()
    lines.append(f"steady step, Flow at {params // 2} B: peak {s['peak_device_bytes']} B, to device "
                 f"{s['bytes_to_device']} B, to host {s['bytes_to_host']} B, write-backs {s['writebacks']}")
    print(f"rank {rank}, FSDP2 frees {'discarded' if discard else 'ignored'}:\n  " + "\n  ".join(lines), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    for discard in (True, False):
        init_file = os.path.join(tempfile.mkdtemp(prefix="ttr-fsdp-"), "init")
        mp.spawn(_rank, args=(2, init_file, args.layers, args.width, discard), nprocs=2)


if __name__ == "__main__":
    main()
