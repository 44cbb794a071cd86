"""The commit of a save: a compare-and-swap of ``metadata.json``, and the clean-up after it.

Shared by every writer of the format: :mod:`shardsafe.engine.writer` (``Checkpointer`` and
everything on it) and :mod:`shardsafe.dcp` (DCP's storage writer and the importer).
"""

from __future__ import annotations

import logging
import re

from ..errors import CheckpointError, CheckpointExistsError, StorageError
from ..format.metadata import METADATA_FILENAME
from ..storage import Storage

__all__ = ["CommitUnknownError", "committed_version", "is_our_data_file", "put_metadata", "sweep"]

log = logging.getLogger(__name__)
_OUR_FILES = re.compile(r"^shard-r\d+-[0-9a-f]+\.safetensors$")
_OUR_TEMP_FILES = re.compile(r"^metadata\.json\.tmp-[0-9a-f]{32}$")  # LocalStorage.put_atomic's, left by a crash


def is_our_data_file(name: str) -> bool:
    return bool(_OUR_FILES.fullmatch(name))


class CommitUnknownError(StorageError):
    """The store failed the commit and whether ``metadata.json`` is now this save's is unknown."""


def committed_version(storage: Storage) -> str | None:
    """The version token of the committed ``metadata.json``, or None if there is none."""
    try:
        return storage.read_versioned(METADATA_FILENAME)[1]
    except FileNotFoundError:
        return None


def put_metadata(storage: Storage, raw: bytes, *, seen: str | None, save_overwrite: bool) -> None:
    """Commit ``raw`` as ``metadata.json`` if that is still version ``seen`` (absent if None).

    Raises ``CheckpointExistsError`` if another save committed first. If the store reports an
    error, the outcome is read back: a ``metadata.json`` equal to ``raw`` is this save's commit
    (success); when that cannot be read either, ``CommitUnknownError``.
    """
    try:
        storage.put_atomic(METADATA_FILENAME, raw, overwrite=seen is not None, if_match=seen)
        return
    except FileExistsError:
        hint = "" if save_overwrite else "; pass save_overwrite=True to replace it"
        raise CheckpointExistsError(
            f"{storage.url}: another save committed a checkpoint there while this one ran, so this one did not commit "
            f"(a save commits only over the {METADATA_FILENAME} it found when it started, so that of two racing saves "
            f"one wins); this save's data files were removed{hint}"
        ) from None
    except StorageError as e:
        failed = e
    try:
        now = storage.read(METADATA_FILENAME)
    except FileNotFoundError:
        now = None
    except CheckpointError as e:
        raise CommitUnknownError(
            f"{storage.url}: committing {METADATA_FILENAME} failed ({failed}) and reading it back failed too ({e}): "
            "whether this save committed is unknown, so its data files were left in place; load the checkpoint to "
            "find out (the next save there removes them if they are not committed)"
        ) from failed
    if now != raw:
        raise failed
    log.warning("%s: the store reported an error (%s) but %s is this save's: committed", storage.url, failed, METADATA_FILENAME)


def sweep(storage: Storage, listed: list[str], *, keep: set[str]) -> None:
    """After this save committed, remove the files of earlier saves: the data files and commit
    temporaries in ``listed`` (taken while planning, before any of this save's files existed)
    that the new metadata does not name.

    None of them can be named by a committed ``metadata.json``, now or later: each was written
    by a save that read the committed version before writing it, so before this save's commit.
    Had that save committed since this one read the version, this one's compare-and-swap would
    have failed; it has not, and it no longer can, because the version it expects is gone.
    What remains is the checkpoint this save replaced and leftovers of failed or crashed saves.
    Files that appear after the listing (a save that started later) are never touched.
    """
    try:
        for name in listed:
            if (_OUR_FILES.fullmatch(name) or _OUR_TEMP_FILES.fullmatch(name)) and name not in keep:
                storage.delete(name)
    except (CheckpointError, OSError) as e:  # the save is committed: a failed clean-up must not undo that
        log.warning("%s: checkpoint committed, but removing the previous save's files failed: %s", storage.url, e)
