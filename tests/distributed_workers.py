"""What each rank of the tests in ``test_distributed.py`` runs, in its own process.

Every worker builds the same model twice from the same per-rank seed, once plain (on the
CPU, inside ``torchTensorRef.disabled()``) and once managed, wraps each in its own engine
over one ``gloo`` process group, trains both the same way and asserts that losses,
gradients, parameters and buffers are bit-identical, and that the rank's manager stayed
within its budget.
"""

from __future__ import annotations

import contextlib
import copy
import gc

import torch
import torch.distributed as dist
from torch import nn

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager


class Net(nn.Module):
    """Linear layers, a batch norm (buffers, an int64 among them) and an unused layer."""

    def __init__(self, width: int = 24, unused: bool = False):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.norm = nn.BatchNorm1d(width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(6))
        self.out = nn.Linear(width, 8)
        if unused:
            self.unused = nn.Linear(8, 8)  # no gradient ever: find_unused_parameters must cope

    def forward(self, x):
        x = self.norm(self.inp(x)).relu()
        for layer in self.hidden:
            x = layer(x).relu()
        return self.out(x)



def returned_marker(init_file: str, rank: int) -> str:
    """The file ``returned`` writes once ``rank``'s worker has returned."""
    return f"{init_file}.returned{rank}"


def returned(rank: int, fn, world: int, init_file: str, *args) -> None:
    """``fn(rank, world, init_file, *args)``, then a mark that it returned: its checks all
    passed, and whatever kills the process from here on is its exit's."""
    fn(rank, world, init_file, *args)
    open(returned_marker(init_file, rank), "w").close()


def teardown() -> None:
    """Leave the process group with every rank at the same point: a rank leaving while its
    peer's gloo threads still talk to it can abort in gloo's teardown (plain torch too)."""
    dist.barrier()
    dist.destroy_process_group()

def values(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy of ``t``'s values."""
    with torchTensorRef.disabled():
        t = t.detach()
        if isinstance(t, TensorRef):
            t = t.target
        return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()


def check_same(plain, managed, where: str) -> None:
    a, b = values(plain), values(managed)
    assert (a.dtype, a.shape) == (b.dtype, b.shape), where
    assert torch.equal(a, b), f"rank {dist.get_rank()}: {where} differs"


def check_modules(plain: nn.Module, managed: nn.Module, where: str, grads: bool) -> None:
    for (name, p), (_n, m) in zip(plain.named_parameters(), managed.named_parameters()):
        assert isinstance(m, TensorRef), f"{name} is not managed"
        check_same(p, m, f"{where}: {name}")
        if grads:
            assert (p.grad is None) == (m.grad is None), f"{where}: {name}.grad presence"
            if p.grad is not None:
                check_same(p.grad, m.grad, f"{where}: {name}.grad")
    for (name, p), (_n, m) in zip(plain.named_buffers(), managed.named_buffers()):
        check_same(p, m, f"{where}: buffer {name}")


def setup(rank: int, world: int, init_file: str, device: str, backend: str = "gloo") -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)  # before the first tensor: "cuda" is this rank's GPU
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tensorsManager.device = device


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def ddp_worker(rank: int, world: int, init_file: str, device: str, runs: list, backend: str = "gloo") -> None:
    """For each ``(strategy, budget_fraction, options)`` of ``runs``: plain DDP beside managed DDP.

    The plain run is on the CPU, or on this rank's GPU when ``device`` is ``"cuda"``.
    """
    setup(rank, world, init_file, device, backend)
    if device == "cuda":
        # Read once a tensor exists, through the public setting: "cuda" is resolved to the
        # rank's GPU at the first tensor (the manager's own record was the CPU until then).
        probe = torch.zeros(1)
        assert tensorsManager.device == f"cuda:{rank}", tensorsManager.device
        assert probe.device == torch.device("cuda", rank), probe.device
        del probe
    for strategy, budget_fraction, options in runs:
        ddp_run(rank, world, strategy, budget_fraction, dict(options))
    teardown()


def ddp_run(rank: int, world: int, strategy: str, budget_fraction, options: dict) -> None:
    """Three SGD steps (the first under ``no_sync`` if asked) of plain DDP and managed DDP."""
    where = f"{strategy}, budget {budget_fraction}, {options}"
    no_sync = options.pop("no_sync", False)
    with torchTensorRef.disabled():
        torch.manual_seed(rank)  # ranks start apart: DDP must broadcast rank 0's state
        plain = Net(unused=options.get("find_unused_parameters", False))
        managed = copy.deepcopy(plain)
        if tensorsManager.device_kind == "cuda":
            plain.cuda()
    torchTensorRef.manage(managed)
    budget = None if budget_fraction is None else int(budget_fraction * param_bytes(plain))
    tensorsManager.budget = None
    tensorsManager.strategy = strategy
    # (above what the device holds outside the manager: a GPU's workspaces, the plain model;
    # and room for what DDP and FSDP2 allocate on the device beside the manager's blocks,
    # which the budget covers as on CUDA: DDP's gradient buckets, FSDP2's all-gather
    # buffers, each up to the parameters' bytes, and the gradients they are copied from)
    room = 2 * param_bytes(plain)
    held = _budget_above_outside(room, budget)
    tensorsManager.reset_stats()
    from torch.nn.parallel import DistributedDataParallel as DDP

    engines = [DDP(plain, **options), DDP(managed, **options)]
    check_modules(plain, managed, f"{where}: after the initial broadcast", grads=False)
    for name, p in plain.named_parameters():
        gathered = [torch.empty_like(p) for _ in range(world)]
        with torchTensorRef.disabled():
            dist.all_gather(gathered, p.detach())
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{where}: {name} differs across ranks"
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (plain, managed)]
    for step in range(3):
        with torchTensorRef.disabled():
            torch.manual_seed(100 * step + rank)
            x = torch.randn(6, 16)
        plain_x = x.cuda() if tensorsManager.device_kind == "cuda" else x
        losses = []
        sync = not (no_sync and step == 0)
        for engine, opt, plain_run in zip(engines, optimizers, (True, False)):
            batch = plain_x if plain_run else torchTensorRef.manage(x.clone())
            with (engine.no_sync() if not sync else _nothing()):
                loss = engine(batch).square().mean()
                loss.backward()
            losses.append(loss)
            if sync:
                opt.step()
                opt.zero_grad(set_to_none=not options.get("gradient_as_bucket_view", False))
        check_same(losses[0], losses[1], f"{where}: loss of step {step}")
        check_modules(plain, managed, f"{where}: step {step}", grads=True)
    stats = tensorsManager.stats()
    assert stats["worst_overshoot_bytes"] == 0, (where, stats)
    if budget is not None:
        # (the manager may use the room left for DDP's and FSDP2's own buffers while they do
        # not exist; beside them nothing passed the budget: worst_overshoot_bytes above)
        assert stats["peak_device_bytes"] <= held, (where, stats["peak_device_bytes"], held)
        assert stats["evictions"] > 0, f"{where}: the budget did not make the manager page"
    del engines, optimizers, managed
    tensorsManager.budget = None


def _budget_above_outside(room: int, budget) -> int:
    """Set the budget to ``room + budget`` above what the device holds outside the manager now;
    the bytes the manager may hold under it. (What lies outside at this reading, a tensor an
    earlier run left to the collector, may be freed later: the manager may then use it.)"""
    gc.collect()  # (an earlier run's engines hold their buckets in reference cycles)
    outside = tensorsManager.outside_bytes()
    tensorsManager.budget = None if budget is None else outside + room + budget
    return outside + room + (budget or 0)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Stack(nn.Module):
    """Linear layers, one FSDP2 group each: a group's gathered parameters are a tenth of the model."""

    def __init__(self, width: int = 24, depth: int = 8):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, width)] + [nn.Linear(width, width) for _ in range(depth)]
                                    + [nn.Linear(width, 8)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = layer(x).relu()
        return self.layers[-1](x)


def fsdp_worker(rank: int, world: int, init_file: str, device: str, runs: list) -> None:
    """For each ``(strategy, budget_fraction, options)`` of ``runs``: plain FSDP2 beside managed FSDP2.

    ``fully_shard`` per layer and at the root, three AdamW steps; the plain model on a CPU
    mesh, the managed one on a mesh of ``device``, ``options`` given to ``fully_shard``
    (``mp_policy`` as ``(param_dtype, reduce_dtype)``) but ``no_sync``, which accumulates the
    first step's gradients into the second's, and ``prefetch``, which sets each layer's
    explicit forward and backward prefetch, and ``host_fraction``, which sets a host budget of
    that fraction of the parameter bytes. Losses, gradient shards, parameter shards and
    gathered parameters must agree bit for bit, and the rank's peaks stay within its budgets.
    """
    from torch.distributed.device_mesh import init_device_mesh

    backend = "cpu:gloo,sim:gloo" if device == "sim" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tensorsManager.device = device
    meshes = (init_device_mesh("cpu", (world,)), init_device_mesh(device, (world,)))
    for strategy, budget_fraction, options in runs:
        fsdp_run(rank, meshes, strategy, budget_fraction, dict(options))
    teardown()


def fsdp_run(rank: int, meshes, strategy: str, budget_fraction, options: dict) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    where = f"FSDP2 on {tensorsManager.device}, {strategy}, budget {budget_fraction}, {options}"
    no_sync = options.pop("no_sync", False)
    prefetch = options.pop("prefetch", False)
    host_fraction = options.pop("host_fraction", None)
    room_fraction = options.pop("room_fraction", 2.0)
    if "mp_policy" in options:
        param_dtype, reduce_dtype = options["mp_policy"]
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        plain = Stack()
        managed = copy.deepcopy(plain)
    torchTensorRef.manage(managed)
    budget = None if budget_fraction is None else int(budget_fraction * param_bytes(plain))
    tensorsManager.budget = None
    tensorsManager.strategy = strategy
    # (above what the device holds outside the manager: a GPU's workspaces, the plain model;
    # and room for what DDP and FSDP2 allocate on the device beside the manager's blocks,
    # which the budget covers as on CUDA: DDP's gradient buckets, FSDP2's all-gather
    # buffers and reduce-scatter inputs, each at most the parameters' bytes)
    room = int(room_fraction * param_bytes(plain))
    held = _budget_above_outside(room, budget)
    host_budget = None if host_fraction is None else int(host_fraction * param_bytes(plain))
    tensorsManager.host_budget = host_budget
    tensorsManager.reset_stats()
    for model, mesh in zip((plain, managed), meshes):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        if prefetch:
            for a, b in zip(model.layers, model.layers[1:]):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
    for p in managed.parameters():
        assert isinstance(p, DTensor) and isinstance(p.to_local(), TensorRef), type(p)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (plain, managed)]
    for step in range(3):
        with torchTensorRef.disabled():
            torch.manual_seed(10 * step + rank)
            x = torch.randn(6, 16)
        losses = []
        sync = not (no_sync and step == 0)
        for model, batch in ((plain, x), (managed, torchTensorRef.manage(x.clone()))):
            model.set_requires_gradient_sync(sync)
            loss = model(batch).square().mean()
            loss.backward()
            losses.append(loss)
        check_same(losses[0], losses[1], f"{where}: loss of step {step}")
        if not sync:
            continue  # (the gradients are unsharded, accumulating: compared after the next step)
        for (name, p), m in zip(plain.named_parameters(), managed.parameters()):
            check_same(p.grad.to_local(), m.grad.to_local(), f"{where}: step {step}: {name}.grad shard")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        for (name, p), m in zip(plain.named_parameters(), managed.parameters()):
            check_same(p.to_local(), m.to_local(), f"{where}: step {step}: {name} shard")
    stats = tensorsManager.stats()
    assert stats["worst_overshoot_bytes"] == 0, (where, stats)
    if budget is not None:
        # (the manager may use the room left for DDP's and FSDP2's own buffers while they do
        # not exist; beside them nothing passed the budget: worst_overshoot_bytes above)
        assert stats["peak_device_bytes"] <= held, (where, stats["peak_device_bytes"], held)
        assert stats["evictions"] > 0, f"{where}: the budget did not make the manager page"
    if host_budget is not None:
        assert stats["peak_host_bytes"] <= host_budget, (where, stats["peak_host_bytes"], host_budget)
        assert stats["bytes_to_disk"] > 0, f"{where}: the host budget did not make the manager spill"
    for (name, p), m in zip(plain.named_parameters(), managed.parameters()):
        check_same(p.full_tensor(), m.full_tensor(), f"{where}: {name} gathered")
    tensorsManager.budget = None
    tensorsManager.host_budget = None


def fsdp_refused_worker(rank: int, world: int, init_file: str, device: str) -> None:
    """``fully_shard`` with ``CPUOffloadPolicy`` on a managed module is refused and leaves it as it was."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("cpu:gloo,sim:gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tensorsManager.device = device
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    torchTensorRef.manage(model)
    before = dict(model.named_parameters())
    saved = {name: values(p) for name, p in before.items()}
    state = {id(m): dict(vars(m)) for m in model.modules()}
    mesh = init_device_mesh(device, (world,))
    for target in (model[0], model, [model[0], model[2]]):
        try:
            fully_shard(target, mesh=mesh, offload_policy=CPUOffloadPolicy())
        except ValueError as e:
            assert "FSDP2 (fully_shard) with offload_policy=CPUOffloadPolicy() on TensorRefs" in str(e), e
            assert "Leave offload_policy out and set tensorsManager.budget" in str(e), e
        else:
            raise AssertionError("fully_shard ran with CPUOffloadPolicy")
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    for name, p in after.items():
        assert p is before[name], f"{name} was replaced"
        assert isinstance(p, TensorRef) and not isinstance(p, DTensor), type(p)
        check_same(saved[name], p, f"{name} after the refused fully_shard")
    for m in model.modules():
        assert not isinstance(m, FSDPModule), type(m)
        assert vars(m) == state[id(m)], f"{type(m).__name__}'s attributes changed"
    teardown()


def collectives_worker(rank: int, world: int, init_file: str, device: str) -> None:
    """torch.distributed's collectives on TensorRefs under Genoa and a small budget, against plain."""
    setup(rank, world, init_file, device)
    tensorsManager.strategy = "genoa"
    # Genoa sends every tensor back after each op: all are paged
    tensorsManager.budget = tensorsManager.outside_bytes() + 4096

    def both(fn):
        with torchTensorRef.disabled():
            torch.manual_seed(rank)
            plain = fn()
        torch.manual_seed(rank)
        managed = fn()
        return plain, managed

    def run(name, make, collective):
        plain, managed = both(make)
        for tensors in (plain, managed):
            with torchTensorRef.disabled() if tensors is plain else contextlib.nullcontext():
                work = collective(tensors)
            if work is not None:
                work.wait()  # (the plain one too: an asynchronous reduction still running differs)
        for i, (p, m) in enumerate(zip(plain, managed)):
            assert isinstance(m, TensorRef), f"{name}: {type(m)}"
            check_same(p, m, f"{name}[{i}]")

    run("all_reduce", lambda: [torch.rand(64)], lambda t: dist.all_reduce(t[0]))
    run("all_reduce async", lambda: [torch.rand(64)], lambda t: dist.all_reduce(t[0], async_op=True))
    run("broadcast", lambda: [torch.rand(8, 8)], lambda t: dist.broadcast(t[0], src=1))
    run("all_gather", lambda: [torch.rand(16)] + [torch.zeros(16) for _ in range(world)],
        lambda t: dist.all_gather(t[1:], t[0]))
    run("all_gather_into_tensor", lambda: [torch.rand(16), torch.zeros(16 * world)],
        lambda t: dist.all_gather_into_tensor(t[1], t[0]))
    run("a view", lambda: [torch.rand(8, 8)], lambda t: dist.all_reduce(t[0][2]))
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    for name, fn in (("functional all_reduce", lambda t: funcol.all_reduce(t, "sum", group)),
                     ("functional all_gather", lambda t: funcol.all_gather_tensor(t, 0, group)),
                     ("functional reduce_scatter", lambda t: funcol.reduce_scatter_tensor(t, "sum", 0, group))):
        plain, managed = both(lambda: torch.rand(16))
        with torchTensorRef.disabled():
            expected = fn(plain).wait()  # (an AsyncCollectiveTensor)
        got = fn(managed)
        assert isinstance(got, TensorRef), f"{name}: {type(got)}"
        check_same(expected, got, name)
    stats = tensorsManager.stats()
    assert stats["peak_device_bytes"] <= 4096 and stats["worst_overshoot_bytes"] == 0, stats
    if device != "cpu":  # (pass-through never moves anything)
        assert stats["evictions"] > 0, stats
    teardown()
