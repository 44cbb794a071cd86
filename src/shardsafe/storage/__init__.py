"""Byte storage: local filesystem and in-memory backends behind one small interface."""

from .base import Storage, Writer, open_storage

__all__ = ["Storage", "Writer", "open_storage"]
