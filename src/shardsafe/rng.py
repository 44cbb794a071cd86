"""``RNGState``: this process's random number generators, as an ``extra`` object of
:class:`shardsafe.CheckpointManager`."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError

__all__ = ["RNGState"]

log = logging.getLogger(__name__)


class RNGState:
    """The state of Python's ``random``, NumPy's global generator, torch's CPU generator, every
    CUDA device's generator (when CUDA is in use in this process) and the ``generators`` given.

    Pass it in ``extra=`` of :meth:`CheckpointManager.save` and :meth:`~CheckpointManager.restore`:
    it is stored per rank, so after a restore every rank draws the numbers it would have drawn
    had the run not stopped. On a world size that grew, a rank the save did not have keeps its
    generators as they are, unless every saved rank had the same state (then it gets that), and
    a warning names the rank (``shardsafe_missing_rank = "keep"``). CUDA states are restored on
    the first ``min(saved, present)`` devices; a warning says when some could not be. Nothing is
    pickled: the states are tensors and integers.
    """

    shardsafe_missing_rank = "keep"

    def __init__(self, generators: dict[str, torch.Generator] | None = None) -> None:
        if generators is not None and not (
            isinstance(generators, dict) and all(isinstance(g, torch.Generator) for g in generators.values())
        ):
            raise TypeError(f"RNGState: argument 'generators' must be a dict of name -> torch.Generator or None, got {generators!r}")
        self.generators = dict(generators or {})

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = random.getstate()
        algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
            "numpy": {
                "algorithm": algorithm, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                "has_gauss": int(has_gauss), "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
            # an uninitialised CUDA has drawn nothing since its (deferred) seeding; asking would create a context per device
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        }
        if self.generators:
            out["generators"] = {name: g.get_state() for name, g in self.generators.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            py, npy = state["python"], state["numpy"]
            py_state = (py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"])
            np_state = (npy["algorithm"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
            cpu, cuda, named = state["torch"], list(state["cuda"]), dict(state.get("generators", {}))
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"RNGState.load_state_dict: not a state RNGState.state_dict() returned ({type(e).__name__}: {e})") from None
        missing = sorted(set(self.generators) - set(named))
        if missing:
            raise CheckpointError(f"RNGState.load_state_dict: the state holds no generator named {missing} (it holds {sorted(named)})")
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda:
            present = torch.cuda.device_count() if torch.cuda.is_available() else 0
            for i, s in enumerate(cuda[:present]):
                torch.cuda.set_rng_state(s, i)
            if present < len(cuda):
                log.warning("RNGState: %d CUDA generator state(s) saved, %d CUDA device(s) here: the saved states of devices "
                            "%s are not restored", len(cuda), present, list(range(present, len(cuda))))
        for name, g in self.generators.items():
            g.set_state(named[name].to(torch.uint8))
