"""DataLoader workers forked from the manager's process (Note [Forked workers] in ``workers.py``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchTensorRef
from torchTensorRef import tensorsManager
from torchTensorRef.core.tensor_ref import block_of

from paired import assert_identical, sim_only

CPU = torch.device("cpu")


def _worker_batches(data):
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7),
                        num_workers=2, timeout=120)  # (a hung worker fails the test)
    return [batch for _epoch in range(2) for batch in loader]


# (where CUDA is available "sim" runs in its lenient form, which makes tensors on the host)
@pytest.mark.parametrize("where", [pytest.param("device", marks=sim_only), "host", "disk"])
def test_dataloader_workers_index_a_dataset_of_tensor_refs(where, tmp_path):
    # Fixed: a worker indexing a dataset built after the import (TensorRefs on "sim") crashed
    # with a segmentation fault: collate asked for shared memory on the accelerator.
    # On "sim" whatever the test device: on CUDA a forked worker cannot index a TensorRef at
    # all (indexing a tensor of a CUDA device sets the device first, and CUDA refuses a
    # forked child: "initialization error"), so this reads the bytes of each tier on "sim".
    tensorsManager.device = "sim"
    tensorsManager.strategy = "flow"
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    x = data.tensors[0]
    if where != "device":
        tensorsManager.evict_all()
    if where == "disk":
        tensorsManager.offload_dir = tmp_path
        tensorsManager.synchronize()  # (every write-back ended: the strategy's choice sees every host copy)
        tensorsManager.host_budget = sum(b.nbytes for b in tensorsManager.host_tier.hosted.values()) - x.nbytes
        tensorsManager.synchronize()
        assert block_of(x).host is None and block_of(x).disk is not None
    else:
        assert (block_of(x).dev is not None) is (where == "device")
    managed = _worker_batches(data)
    tensorsManager.host_budget = None
    with torchTensorRef.disabled():  # plain torch: a dataset of CPU tensors gives CPU batches
        torch.manual_seed(0)
        expected = _worker_batches(TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,))))
    assert all(type(t) is torch.Tensor and t.device == CPU for batch in managed for t in batch)
    assert_identical(expected, managed)
    assert_identical(torch.cat([batch[0] for batch in managed[:4]]).sort(0).values, x.cpu().target.sort(0).values)


class _Stored(torch.utils.data.Dataset):
    """Returns the tensors it holds as they are (no op runs in the worker)."""

    def __init__(self):
        self.items = [torch.full((3,), float(i)) for i in range(8)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("batch_size", [4, None], ids=["collated", "unbatched"])
def test_dataloader_workers_return_the_tensor_refs_a_dataset_holds(batch_size):
    # Fixed: collating them crashed the worker as above (an op-free dataset is collated apart).
    def load():
        return [b for b in DataLoader(_Stored(), batch_size=batch_size, num_workers=2, timeout=120)]

    managed = load()
    with torchTensorRef.disabled():
        expected = load()
    assert_identical(expected, [b.cpu().target if isinstance(b, torchTensorRef.TensorRef) else b for b in managed])
