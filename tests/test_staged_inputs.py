"""Static graph inputs filled from host twins by one copy: every view gets its own values, aligned,
and keeps its address from one send to the next (the graphs read it there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ragfuse.engine.staged_inputs import StagedInputs

FIELDS = {
    "state": ((4, 33), torch.int64), "flags": ((7,), torch.bool), "table": ((1, 5), torch.int32),
    "share": ((2,), torch.float32), "tail": ((), torch.int64),
}


def _devices() -> list[pytest.param]:
    return [pytest.param("cpu"), pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", _devices())
def test_each_field_arrives_with_its_values_shape_and_dtype(device: str):
    staged = StagedInputs(FIELDS, torch.device(device))
    h = staged.host()
    h["state"][...] = np.arange(4 * 33).reshape(4, 33)
    h["flags"][...] = [True, False, True, True, False, False, True]
    h["table"][...] = [[9, 8, 7, 6, 5]]
    h["share"][...] = (0.5, 0.25)
    h["tail"][...] = 12
    staged.send()
    d = staged.device
    for name, (shape, dtype) in FIELDS.items():
        assert d[name].shape == shape and d[name].dtype == dtype and d[name].device.type == device
        assert d[name].data_ptr() % 16 == 0  # aligned for any dtype's vector loads
    assert torch.equal(d["state"].cpu(), torch.arange(4 * 33).view(4, 33))
    assert d["flags"].cpu().tolist() == [True, False, True, True, False, False, True]
    assert d["table"].cpu().tolist() == [[9, 8, 7, 6, 5]]
    assert d["share"].cpu().tolist() == [0.5, 0.25] and int(d["tail"]) == 12
    # a second pass's values replace the first's; the device views keep their addresses (graphs read them)
    ptr = d["state"].data_ptr()
    staged.host()["state"][...] = -1
    staged.send()
    assert d["state"].data_ptr() == ptr and bool((d["state"] == -1).all())
    assert d["table"].cpu().tolist() == [[9, 8, 7, 6, 5]]  # untouched fields are sent again as they were


@pytest.mark.parametrize("device", _devices())
def test_a_send_up_to_some_rows_leaves_the_rest_as_it_was(device: str):
    """``send(upto=(name, rows))`` sends the fields before ``name`` and its first ``rows`` rows only:
    a decode step sends its own block-table rows, not the whole table."""
    staged = StagedInputs(FIELDS, torch.device(device))
    staged.host()["state"][...] = 1
    staged.host()["table"][...] = 1
    staged.send()
    h = staged.host()
    h["state"][...] = np.arange(4 * 33).reshape(4, 33)
    h["flags"][...] = True
    h["table"][...] = 2
    staged.send(upto=("state", 2))
    d = staged.device
    assert torch.equal(d["state"][:2].cpu(), torch.arange(2 * 33).view(2, 33))
    assert bool((d["state"][2:] == 1).all()) and not bool(d["flags"].any()) and bool((d["table"] == 1).all())
    staged.send(upto=("flags", 7))
    assert bool(d["flags"].all()) and bool((d["table"] == 1).all())
    for bad in (("state", 5), ("tail", 0)):
        with pytest.raises(ValueError, match="cannot send"):
            staged.send(upto=bad)


def test_unsupported_dtypes_are_refused():
    with pytest.raises(TypeError, match="unsupported dtype"):
        StagedInputs({"x": ((2,), torch.float16)}, torch.device("cpu"))
