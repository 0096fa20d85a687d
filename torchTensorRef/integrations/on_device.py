"""A safetensors file opened for "sim" (``safe_open(..., device="sim")``, as peft's
``load_peft_weights`` opens one for the model's device): safetensors knows only real
devices, so the file is read on the host and each tensor moved as ``.to`` moves it."""

from __future__ import annotations

import contextlib


class OnDevice:
    """A ``safe_open`` handle read on the host, its tensors moved to ``device``: plain ones
    where it was opened inside ``disabled()``, in whichever thread reads them. A context
    manager as the handle is; what is not overridden is the handle's."""

    def __init__(self, handle, device: str, plain: bool):
        self._handle, self._device, self._plain = handle, device, plain

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def moved(self, tensor):
        from .plain import disabled

        with disabled() if self._plain else contextlib.nullcontext():
            return tensor.to(self._device)

    def get_tensor(self, name):
        return self.moved(self._handle.get_tensor(name))

    def get_tensors(self):
        return {name: self.moved(t) for name, t in self._handle.get_tensors().items()}

    def get_slice(self, name):
        return OnDeviceSlice(self, self._handle.get_slice(name))


class OnDeviceSlice:
    """``get_slice(name)`` of an :class:`OnDevice`: indexing it gives the part on the device."""

    def __init__(self, file: OnDevice, handle_slice):
        self._file, self._slice = file, handle_slice

    def __getitem__(self, index):
        return self._file.moved(self._slice[index])

    def __getattr__(self, name):
        return getattr(self._slice, name)
