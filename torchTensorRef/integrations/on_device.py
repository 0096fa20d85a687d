"""safetensors' handles wrapped (``HandleWrapper``), and a file opened for "sim"
(``safe_open(..., device="sim")``, as peft's ``load_peft_weights`` opens one for the
model's device): safetensors knows only real devices, so the file is read on the host and
each tensor moved as ``.to`` moves it."""

from __future__ import annotations

import contextlib


class HandleWrapper:
    """A ``safe_open`` handle wrapped: a context manager as the handle is, and what is not
    overridden is the handle's."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.handle, name)


class OnDevice(HandleWrapper):
    """A ``safe_open`` handle read on the host, its tensors moved to ``device``: plain ones
    where it was opened inside ``disabled()``, in whichever thread reads them."""

    def __init__(self, handle, device: str, plain: bool):
        super().__init__(handle)
        self._device, self._plain = device, plain

    def moved(self, tensor):
        from .plain import disabled

        with disabled() if self._plain else contextlib.nullcontext():
            return tensor.to(self._device)

    def get_tensor(self, name):
        return self.moved(self.handle.get_tensor(name))

    def get_tensors(self):
        return {name: self.moved(t) for name, t in self.handle.get_tensors().items()}

    def get_slice(self, name):
        return OnDeviceSlice(self, self.handle.get_slice(name))


class OnDeviceSlice:
    """``get_slice(name)`` of an :class:`OnDevice`: indexing it gives the part on the device."""

    def __init__(self, file: OnDevice, handle_slice):
        self._file, self._slice = file, handle_slice

    def __getitem__(self, index):
        return self._file.moved(self._slice[index])

    def __getattr__(self, name):
        return getattr(self._slice, name)
