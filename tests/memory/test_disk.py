"""The disk tier's files: checkpoint ranges checked at every read, the spill file's slots."""

from __future__ import annotations

import os

import pytest
import torch

import torchTensorRef
from torchTensorRef.memory.disk import CheckpointChangedError, DiskError, FileRange, SpillFile, check_offload_dir, file_identity


def _bytes(data: bytes) -> torch.Tensor:
    with torchTensorRef.disabled():
        return torch.tensor(list(data), dtype=torch.uint8)


def _buffer(n: int) -> torch.Tensor:
    with torchTensorRef.disabled():
        return torch.zeros(n, dtype=torch.uint8)


def test_a_checkpoint_range_reads_its_bytes(tmp_path):
    path = tmp_path / "ckpt"
    path.write_bytes(bytes(range(100)))
    r = FileRange(str(path), 10, 20, identity=file_identity(str(path)))
    out = _buffer(20)
    r.read_into(out)
    assert out.tolist() == list(range(10, 30))


@pytest.mark.parametrize("change", ["rewritten", "truncated", "removed"])
def test_a_checkpoint_changed_while_in_use_is_refused(tmp_path, change):
    path = tmp_path / "ckpt"
    path.write_bytes(bytes(100))
    r = FileRange(str(path), 10, 20, identity=file_identity(str(path)))
    if change == "rewritten":
        os.utime(path, ns=(1, 1))
    elif change == "truncated":
        with open(path, "r+b") as f:
            f.truncate(15)
    else:
        path.unlink()
    with pytest.raises(CheckpointChangedError, match=str(path)):
        r.read_into(_buffer(20))


def test_a_range_past_the_end_of_an_unchecked_file_says_it_was_truncated(tmp_path):
    path = tmp_path / "ckpt"
    path.write_bytes(bytes(15))
    with pytest.raises(CheckpointChangedError, match="truncated"):
        FileRange(str(path), 10, 20).read_into(_buffer(20))


def test_spill_slots_are_reused_by_size_and_the_file_goes_at_close(tmp_path):
    spill = SpillFile(str(tmp_path))
    a, b = spill.allocate(8), spill.allocate(8)
    assert a != b and spill.used == 16
    spill.write(a, _bytes(b"abcdefgh"))
    spill.write(b, _bytes(b"ABCDEFGH"))
    out = _buffer(8)
    spill.read(a, out)
    assert bytes(out.tolist()) == b"abcdefgh"
    spill.free(a, 8)
    assert spill.allocate(8) == a and spill.allocate(4) not in (a, b)
    assert os.path.exists(spill.path)
    spill.close()
    assert not os.path.exists(spill.path)


def test_a_full_disk_is_a_disk_error_naming_the_setting(tmp_path):
    spill = SpillFile(str(tmp_path))
    spill.path = "/dev/full"  # every write: no space left on device
    with pytest.raises(DiskError, match="disk is full.*offload_dir"):
        spill.write(spill.allocate(8), _bytes(b"abcdefgh"))


def test_offload_dir_must_be_a_writable_folder(tmp_path):
    assert check_offload_dir(tmp_path / "new") == str(tmp_path / "new")  # made
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="offload_dir"):
        check_offload_dir(a_file / "below")
    with pytest.raises(ValueError, match="offload_dir"):
        check_offload_dir(a_file)
    with pytest.raises(ValueError, match="offload_dir must be a folder path"):
        check_offload_dir(3)
