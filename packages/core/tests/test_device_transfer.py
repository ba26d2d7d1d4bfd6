"""Host-to-device batch copies (pinned + non-blocking on CUDA, plain elsewhere)."""

from __future__ import annotations

import pytest
import torch

from longboat.core.device.transfer import batch_to_device, to_device


def test_batch_to_device_on_cpu_keeps_values_and_host_keys() -> None:
    batch = {
        "tokens": torch.arange(6).view(2, 3),
        "frames": [torch.ones(2), torch.zeros(3)],
        "grid": torch.tensor([[1, 2, 2]]),
        "captions": ["a", "b"],
        "mask": None,
    }
    out = batch_to_device(batch, torch.device("cpu"), keep_on_host=("grid",))
    assert torch.equal(out["tokens"], batch["tokens"])
    assert isinstance(out["frames"], list) and torch.equal(out["frames"][1], torch.zeros(3))
    assert out["grid"] is batch["grid"]
    assert out["captions"] == ["a", "b"] and out["mask"] is None
    cast = to_device(torch.ones(2, dtype=torch.float32), torch.device("cpu"), torch.bfloat16)
    assert cast.dtype == torch.bfloat16


@pytest.mark.gpu
def test_cuda_copies_are_pinned_and_equal() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(1024, 1024)
    y = to_device(x, torch.device("cuda"), torch.bfloat16)
    assert y.device.type == "cuda" and torch.equal(y.cpu(), x.to(torch.bfloat16))
    pinned = x.pin_memory()
    assert torch.equal(to_device(pinned, torch.device("cuda")).cpu(), x)
