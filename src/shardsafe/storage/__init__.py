"""Byte storage: local filesystem, object stores (S3, GCS, Azure) and in-memory backends behind one
small interface."""

from .base import Directory, Location, Storage, Writer, open_storage
from .cloud_config import ObjectStoreOptions

__all__ = ["Directory", "Location", "ObjectStoreOptions", "Storage", "Writer", "open_storage"]
