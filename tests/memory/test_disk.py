"""The disk tier's files: checkpoint ranges checked at every read, the spill file's slots."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torchTensorRef
from torchTensorRef.memory.disk import (CheckpointChangedError, DiskError, FileRange, SpillFile, check_offload_dir,
                                        file_identity)


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


def _write_in_place(path, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` of ``path``, keeping its size, modification time and inode."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def test_a_range_written_in_place_since_its_first_read_is_refused_and_so_is_the_file(tmp_path):
    # A checkpoint written in place with its size and modification time kept was read again
    # without an error: the block came back with bytes it never had.
    path = tmp_path / "ckpt"
    path.write_bytes(bytes(range(256)) * 64)
    identity = file_identity(str(path))
    first, other = (FileRange(str(path), offset, 100, identity=identity) for offset in (5000, 9000))
    out = _buffer(100)
    first.read_into(out)
    assert out.tolist() == [(5000 + i) % 256 for i in range(100)]
    _write_in_place(path, 5050, b"\xff")  # (one byte, away from the file's samples)
    with pytest.raises(CheckpointChangedError, match=f"checkpoint {path} changed.*bytes 5000 to 5100 differ"):
        first.read_into(out)
    with pytest.raises(CheckpointChangedError, match=f"checkpoint {path} changed"):
        other.read_into(_buffer(100))  # (never read before: the file is known to have changed)
    again = FileRange(str(path), 5000, 100, identity=file_identity(str(path)))  # loaded again
    again.read_into(out)
    assert out.tolist() == [255 if i == 50 else (5000 + i) % 256 for i in range(100)]


def test_a_file_written_again_in_place_is_refused_at_a_first_read(tmp_path):
    # The same, for a range never read before: its first read took the new bytes.
    path = tmp_path / "ckpt"
    path.write_bytes(bytes(64 * 1024))
    r = FileRange(str(path), 20000, 100, identity=file_identity(str(path)))
    _write_in_place(path, 0, bytes([7]) * (64 * 1024))  # (all of it, as writing a checkpoint again does)
    with pytest.raises(CheckpointChangedError, match="written in place"):
        r.read_into(_buffer(100))


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


# Spills to a folder of the user's, then to a second one while the first file is still in
# use; checks the values read back against plain torch's, and exits normally.
_SPILL_AND_EXIT = """
import os, sys
import torch
import torchTensorRef
from torchTensorRef import tensorsManager as tm

tm.device = "sim"
tm.offload_dir = sys.argv[1]
tm.budget = tm.outside_bytes() + 5 * 2**20  # (beside emulated workspaces too)
tm.host_budget = "5MiB"
torch.manual_seed(0)
xs = [torch.randn(512, 1024) for _ in range(6)]  # 2 MiB each: past both budgets, spilled
tm.offload_dir = sys.argv[2]
xs += [torch.randn(512, 1024) for _ in range(6)]
with torchTensorRef.disabled():
    torch.manual_seed(0)
    expected = [torch.randn(512, 1024) for _ in range(12)]
    # (read as targets: numpy() would hold them outside the manager, dropping their disk copies)
    assert all(torch.equal(x.target, e) for x, e in zip(xs, expected))
xs += [torch.randn(512, 1024) for _ in range(6)]  # (the reads above brought some back)
print(tm.stats()["bytes_to_disk"], len(os.listdir(sys.argv[1])), len(os.listdir(sys.argv[2])))
"""


def test_spill_files_in_a_folder_of_the_users_are_removed_at_exit(tmp_path):
    # With offload_dir set by the user, the spill file stayed there after a normal exit (only
    # the default temporary folder was removed); its megabytes were left behind every run.
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    (first / "notes.txt").write_text("the user's")
    done = subprocess.run([sys.executable, "-c", _SPILL_AND_EXIT, str(first), str(second)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    to_disk, files_in_first, files_in_second = map(int, done.stdout.split())
    assert to_disk > 0 and files_in_first == 2 and files_in_second == 1  # (spill files were there)
    assert sorted(os.listdir(first)) == ["notes.txt"] and (first / "notes.txt").read_text() == "the user's"
    assert second.is_dir() and os.listdir(second) == []
