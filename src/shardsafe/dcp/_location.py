"""Where a DCP storage reader or writer points: a location given now or by DCP's
``checkpoint_id=`` later, opened once, on first use."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError
from ..storage import Location, Storage, open_storage

__all__ = ["Located"]


class Located:
    """The location half of :class:`~shardsafe.dcp.StorageReader` and ``StorageWriter``.

    ``_name`` is the class's public name and ``_dcp_call`` the DCP function that takes its
    ``checkpoint_id`` (both for messages).
    """

    _name: str
    _dcp_call: str

    def _set_location(self, path: Location | None, storage_options: dict[str, Any]) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)) and storage_options:
            raise TypeError(f"{self._name}: storage options apply to a URL, not to a Storage already opened")
        self._location = path
        self._options = storage_options
        self._storage: Storage | None = None

    def _relocate(self, checkpoint_id: str | os.PathLike | None) -> None:
        """DCP's ``reset(checkpoint_id)``: a new location, if one is given (the old one is closed)."""
        if checkpoint_id:
            if self._storage is not None:
                self._storage.close()
            self._location = checkpoint_id
            self._storage = None

    def _url(self) -> str:
        if self._storage is not None:
            return self._storage.url
        return str(self._location) if isinstance(self._location, (str, os.PathLike)) else getattr(self._location, "url", "?")

    def _open(self) -> Storage:
        if self._storage is None:
            if self._location is None:
                raise CheckpointError(f"{self._name} has no location: pass a path to it, or checkpoint_id= to {self._dcp_call}")
            self._storage = open_storage(self._location, **self._options)
        return self._storage
