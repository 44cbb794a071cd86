"""shardsafe for torch.distributed.checkpoint (DCP) users.

- :class:`StorageWriter` / :class:`StorageReader`: DCP's storage plugin interfaces, so that
  ``dcp.save(sd, storage_writer=shardsafe.dcp.StorageWriter(path))`` writes a shardsafe
  checkpoint and ``dcp.load(sd, storage_reader=shardsafe.dcp.StorageReader(path))`` reads any
  shardsafe checkpoint, or a checkpoint DCP's own writers wrote. DCP's planners,
  ``get_state_dict`` / ``set_state_dict``, ``Stateful`` objects and ``async_save`` work unchanged.
- :func:`convert`: a DCP checkpoint into a shardsafe one, streamed chunk by chunk.

DCP's ``.metadata`` is a pickle; it is only ever read through an allowlist of DCP's metadata
classes (anything else raises :class:`~shardsafe.errors.UnsafePickleError`, nothing of it run).
"""

from ..errors import UnsafePickleError
from .convert import convert
from .storage_reader import StorageReader
from .storage_writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter", "UnsafePickleError", "convert"]
