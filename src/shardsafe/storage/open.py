"""Open the backend for a checkpoint location, chosen by URL scheme.

The backends import their clients lazily (obstore only when an object-store URL is opened), so
importing this module costs nothing more than importing the backends' modules.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import StorageError
from .base import STORAGE_METHODS, URL_SCHEME, Location, Storage, check_local_path
from .cloud_config import OBJECT_SCHEMES, ObjectStoreOptions
from .local import LocalStorage
from .memory import MemoryStorage
from .object_store import ObjectStorage

__all__ = ["open_storage"]


def open_storage(location: Location, **options: Any) -> Storage:
    """The backend for a checkpoint location.

    ``location`` is a local path, ``file://``, ``memory://``, an object-store URL
    (``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``), or a
    ``Storage`` already opened, which is returned as it is. ``options`` are the fields of
    :class:`~shardsafe.storage.ObjectStoreOptions` (``endpoint``, ``region``, ``profile``,
    ``credentials``, ...), for object-store URLs only. A local path that looks like a URL with
    one slash (``s3:/bucket/x``) is refused: it would create a local ``s3:`` directory.
    """
    if not isinstance(location, (str, os.PathLike)):
        if not all(callable(getattr(location, m, None)) for m in STORAGE_METHODS):
            raise TypeError(
                f"open_storage: argument 'location' must be a path, a URL or a Storage, got {type(location).__name__}"
            )
        if options:
            raise TypeError("open_storage: options apply to a URL, not to a Storage already opened")
        return location
    loc = os.fspath(location)
    m = URL_SCHEME.fullmatch(loc)
    scheme = m.group(1).lower() if m else "file"
    if scheme in OBJECT_SCHEMES:
        return ObjectStorage(loc, ObjectStoreOptions(**options))
    if options:
        raise TypeError(f"open_storage: options {sorted(options)} apply to object-store URLs only, not to {loc!r}")
    if scheme == "file":
        return LocalStorage(m.group(2) if m else check_local_path(loc))
    if scheme == "memory":
        return MemoryStorage(loc)
    raise StorageError(
        f"{loc}: no storage backend for scheme {scheme!r}; supported: local paths, file://, memory://, "
        "s3://, gs://, az://"
    )
