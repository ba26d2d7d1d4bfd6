"""Capture and restore every random number generator a training run draws from.

A resumed run continues the exact loss curve of an uninterrupted one only if
dropout masks, data augmentation and sampling see the same random streams, so
the checkpoint carries the states of python ``random``, numpy's global RNG, the
torch CPU generator and the accelerator's generator.

The captured state holds only tensors, ints, strings and tuples, so it loads
with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from longboat.core.device import Accelerator

__all__ = ["RNGState", "seed_everything"]

_FORMAT = 1


def _default_accelerator() -> Accelerator:
    from longboat.core.device import get_accelerator

    return get_accelerator()


def _capture(accelerator: Accelerator) -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "format": _FORMAT,
        "python": (version, tuple(mt_state), gauss),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            # int64 tensor: weights_only loading refuses numpy arrays.
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch_cpu": torch.get_rng_state(),
        "device_type": accelerator.device_type,
    }
    # On CPU the "device" generator is the CPU generator captured above.
    if accelerator.device_type != "cpu":
        state["device"] = accelerator.get_rng_state()
    return state


def _restore(state: dict[str, Any], accelerator: Accelerator) -> None:
    if state.get("format") != _FORMAT:
        raise ValueError(
            f"RNG state has format {state.get('format')!r}, this longboat reads format {_FORMAT}; "
            "the checkpoint was written by an incompatible version"
        )
    # Checked before any RNG is touched: a refused state must leave every stream as it was.
    if "device" in state and state["device_type"] != accelerator.device_type:
        raise ValueError(
            f"RNG state was captured on a {state['device_type']!r} device but this run uses "
            f"{accelerator.device_type!r}; resume on the same accelerator type for an exact "
            "continuation (or drop 'rng' from the state to resume with fresh device RNG)"
        )
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {
                "key": np_state["key"].numpy().astype(np.uint32),
                "pos": np_state["pos"],
            },
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch_cpu"])
    if "device" in state:
        accelerator.set_rng_state(state["device"])


class RNGState:
    """The states of python, numpy, torch CPU and accelerator RNGs.

    Two ways to use it:

    * ``RNGState(accelerator)`` with no snapshot is *live*: put it in a checkpoint
      ``state`` dict; ``state_dict()`` captures the RNGs at save time and
      ``load_state_dict()`` restores them.
    * ``snap = RNGState.capture(accelerator)`` freezes the RNGs now;
      ``snap.restore()`` rewinds to that point (any number of times).
    """

    def __init__(
        self, accelerator: Accelerator | None = None, state: dict[str, Any] | None = None
    ) -> None:
        self.accelerator = accelerator if accelerator is not None else _default_accelerator()
        self._state = state

    @classmethod
    def capture(cls, accelerator: Accelerator | None = None) -> RNGState:
        """Snapshot every RNG now."""
        acc = accelerator if accelerator is not None else _default_accelerator()
        return cls(acc, _capture(acc))

    def restore(self) -> None:
        """Set every RNG back to the snapshot."""
        if self._state is None:
            raise RuntimeError(
                "this RNGState holds no snapshot; create it with RNGState.capture() "
                "or call load_state_dict() first"
            )
        _restore(self._state, self.accelerator)

    def state_dict(self) -> dict[str, Any]:
        """The snapshot, or the RNGs' current states for a live object."""
        return _capture(self.accelerator) if self._state is None else self._state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the RNGs from ``state_dict`` (and keep it as the snapshot if one was held)."""
        _restore(state_dict, self.accelerator)
        if self._state is not None:
            self._state = state_dict


def seed_everything(seed: int, accelerator: Accelerator | None = None) -> None:
    """Seed python, numpy, torch CPU and the accelerator from one integer."""
    acc = accelerator if accelerator is not None else _default_accelerator()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    acc.manual_seed(seed)
