"""Byte storage: local filesystem, object stores (S3, GCS, Azure) and in-memory backends behind one
small interface."""

from .base import Directory, Location, Storage, Writer
from .cloud_config import ObjectStoreOptions
from .held import HeldFiles
from .open import open_storage

__all__ = ["Directory", "HeldFiles", "Location", "ObjectStoreOptions", "Storage", "Writer", "open_storage"]
