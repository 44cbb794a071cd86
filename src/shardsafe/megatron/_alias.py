"""``shardsafe.megatron`` as the ``megatron.core.dist_checkpointing`` package (:func:`install`)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from .core import CheckpointingException

_MEGATRON = "megatron.core.dist_checkpointing"
_OURS = __name__.rpartition(".")[0]  # shardsafe.megatron


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``megatron.core.dist_checkpointing[.X]`` as ``shardsafe.megatron[.X]``: the same module
    object under both names, so a patch through either name (``mock.patch("megatron.core.
    dist_checkpointing.serialization.get_default_save_sharded_strategy")``) reaches our code."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MEGATRON and not fullname.startswith(_MEGATRON + "."):
            return None
        ours = _OURS + fullname[len(_MEGATRON):]
        if importlib.util.find_spec(ours) is None:
            return None  # Megatron's name for a module we do not have: ModuleNotFoundError, as for any other
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(_OURS + spec.name[len(_MEGATRON):])

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # already executed under its own name


def install() -> None:
    """Make ``shardsafe.megatron`` the ``megatron.core.dist_checkpointing`` package for this process.

    Call it first thing, before anything imports Megatron (at the top of a Megatron-LM training
    script, or in a ``sitecustomize``). Megatron-Core and Megatron-LM, unchanged, then save and load
    shardsafe checkpoints through their own ``dist_checkpointing`` calls, and every submodule they
    import (``mapping``, ``serialization``, ``strategies.torch``, ``optimizer``...) is shardsafe's.
    Calling it again does nothing.

    Raises:
        CheckpointingException: Megatron's own ``dist_checkpointing`` is already imported (modules
            already holding its classes would mix with ours); call ``install()`` earlier.
    """
    if any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        return
    already = sys.modules.get(_MEGATRON)
    if already is not None and already is not sys.modules.get(_OURS):
        raise CheckpointingException(
            f"{_MEGATRON} is already imported (from {getattr(already, '__file__', '?')}): call "
            f"shardsafe.megatron.install() before anything imports megatron, e.g. first thing in the training script"
        )
    sys.meta_path.insert(0, _AliasFinder())


def installed() -> bool:
    """Whether :func:`install` has made ``shardsafe.megatron`` the ``megatron.core.dist_checkpointing`` package."""
    return any(isinstance(f, _AliasFinder) for f in sys.meta_path)
