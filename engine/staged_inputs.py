"""Static inputs of CUDA graphs that the host fills and sends with one copy.

A graph reads its inputs at fixed addresses, so every replay first puts the pass's values there. Done
as device tensors copied into place, that is one launch per input, and before it the values must
become device tensors (a transfer, then a view per array): on an H200 the fused prefill spent ~0.6 ms of
host time on that before its first layer while the GPU sat idle. Here the inputs are typed views of
one device buffer, with a page-locked host buffer laid out the same: the host writes the values
straight into its numpy views and one non-blocking copy sends them all. The fused prefill's graphs
(``fusion/graphs.py``) and the decode graphs (``cuda_graphs.DecodeGraphs``) take their inputs so.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.float32: np.float32}
_ALIGN = 16  # bytes: every view starts aligned for any of the dtypes above (and vector loads)


class StagedInputs:
    """Named device tensors in one buffer (``device[name]``), filled from their host twins
    (``host()[name]``, numpy) by ``send``."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        spans: dict[str, tuple[int, int]] = {}
        total = 0
        for name, (shape, dtype) in fields.items():
            if dtype not in _NUMPY:
                raise TypeError(f"staged input {name!r}: unsupported dtype {dtype}")
            nbytes = math.prod(shape) * dtype.itemsize
            spans[name] = (total, nbytes)
            total += -(-nbytes // _ALIGN) * _ALIGN
        self._ends = {name: start + nbytes for name, (start, nbytes) in spans.items()}
        self._device_buf = torch.zeros(total, dtype=torch.uint8, device=device)
        self._host_buf = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        raw = self._host_buf.numpy()
        self.device: dict[str, torch.Tensor] = {}
        self._host: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in fields.items():
            start, nbytes = spans[name]
            self.device[name] = self._device_buf[start : start + nbytes].view(dtype).view(shape)
            self._host[name] = raw[start : start + nbytes].view(_NUMPY[dtype]).reshape(shape)
        self._sent: torch.cuda.Event | None = None  # the last copy out of the host buffer

    def host(self) -> dict[str, np.ndarray]:
        """The host twins, to write this pass's values into: once the previous ``send`` has read
        them (it is asynchronous), so a pass never changes values still on their way."""
        if self._sent is not None:
            self._sent.synchronize()
        return self._host

    def send(self, upto: tuple[str, int] | None = None) -> None:
        """Copy the host twins into their device tensors, in the current stream's order (the graphs
        replayed after it read the new values; the host goes on at once). ``upto=(name, rows)``
        sends only the buffer's bytes up to the end of field ``name``'s first ``rows`` rows, so the
        fields laid out after it are not sent either: a decode step copies the block-table rows of
        its own sequences, not the table's rows for the largest batch (2 MiB at 256 rows of a 32K
        context)."""
        end = self._device_buf.shape[0]
        if upto is not None:
            name, rows = upto
            field = self._host[name]
            if field.ndim == 0 or not 0 <= rows <= field.shape[0]:
                raise ValueError(f"staged input {name!r} of shape {field.shape}: cannot send {rows} rows")
            end = self._ends[name] - (field.shape[0] - rows) * field[0].nbytes
        self._device_buf[:end].copy_(self._host_buf[:end], non_blocking=True)
        if self._device_buf.is_cuda:
            self._sent = torch.cuda.Event()
            self._sent.record()
