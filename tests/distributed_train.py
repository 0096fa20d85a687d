"""A DDP training script as users write it, for the torchrun tests: losses per rank to argv[1]."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 24), torch.nn.ReLU(),
                            torch.nn.Linear(24, 4))
ddp = DDP(model, bucket_cap_mb_list=[1024 / 2**20])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
lines = []
for step in range(3):
    torch.manual_seed(10 * step + rank)
    x = torch.randn(8, 16)
    loss = ddp(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    lines.append(f"{step} {loss.item()!r}")
lines.append(f"device {next(model.parameters()).device}")
with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
# (both ranks reach the teardown together: without this barrier, plain torch 2.13 aborted a
# rank in gloo's teardown in 1 of 60 runs on a 2-core machine; with it, in none of 40)
dist.barrier()
dist.destroy_process_group()
