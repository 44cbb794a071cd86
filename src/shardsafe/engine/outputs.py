"""Where an export goes, and how it appears: whole or not at all.

:class:`OutputFile` is one file, a local path (an fsynced temporary file beside it, moved into
place by :meth:`shardsafe.storage.local.LocalStorage.publish`) or an object-store URL (its
store's ``write_file``, whose object appears only once complete). :class:`OutputFolder` is a
folder as ``transformers``' ``save_pretrained`` writes one: the weights, the index last, and
``config.json`` when given; what an earlier export left there is removed once the new one is
complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from contextlib import AbstractContextManager
from typing import Any

from ..errors import CheckpointError, CheckpointExistsError, StorageError
from ..format import strict_json
from ..knobs import KNOBS, Knobs
from ..storage import Writer, open_storage
from ..storage.base import check_local_path, check_name, url_scheme
from ..storage.local import LocalStorage

__all__ = ["CONFIG_FILE", "INDEX_FILE", "SINGLE_FILE", "OutputFile", "OutputFolder", "config_json", "shard_file_name"]

log = logging.getLogger("shardsafe.engine.consolidate")

CONFIG_FILE = "config.json"  # transformers' model config, beside the weights
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def shard_file_name(i: int, n: int) -> str:
    """The name ``transformers`` gives shard ``i`` (from 0) of ``n``."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class OutputFile:
    """Where the output goes, and how it appears whole or not at all: a local path through an
    fsynced temporary file beside it, renamed into place; a URL through its store's
    ``write_file``, whose object appears only once complete and is removed on error."""

    def __init__(self, out_path: str, *, overwrite: bool, knobs: Knobs) -> None:
        self.overwrite, self.knobs = overwrite, knobs
        scheme = url_scheme(out_path)
        self.store = None
        if scheme not in (None, "file"):
            parent, _, name = out_path.rpartition("/")
            if "://" not in parent or not name:
                raise StorageError(f"{out_path}: an output URL needs a file name after its bucket or prefix, e.g. s3://bucket/model.safetensors")
            self.store, self.name = open_storage(parent), check_name(name)
            self.where = f"{self.store.url.rstrip('/')}/{name}"
            if not overwrite and name in self.store.list():
                raise CheckpointExistsError(f"{self.where}: object exists; pass overwrite=True to replace it")
            return
        self.where = os.path.abspath(out_path[len("file://") :] if scheme == "file" else check_local_path(out_path))
        if not overwrite and os.path.lexists(self.where):
            raise CheckpointExistsError(f"{self.where}: file exists; pass overwrite=True to replace it")
        self.parent, base = os.path.split(self.where)
        self.name = f"tmp-{uuid.uuid4().hex[:12]}-{base}"

    def writer(self) -> AbstractContextManager[Writer]:
        if self.store is not None:
            return self.store.write_file(self.name)
        os.makedirs(self.parent, exist_ok=True)
        return LocalStorage(self.parent, knobs=self.knobs).write_file(self.name)

    def publish(self) -> None:
        if self.store is None:
            try:
                LocalStorage(self.parent, knobs=self.knobs).publish(self.name, os.path.basename(self.where), overwrite=self.overwrite)
            except FileExistsError:
                raise CheckpointExistsError(f"{self.where}: file exists; pass overwrite=True to replace it") from None

    def discard(self) -> None:
        if self.store is None:
            try:
                os.unlink(os.path.join(self.parent, self.name))
            except FileNotFoundError:
                pass


class OutputFolder:
    """A Hugging Face style output folder: local or an object-store prefix."""

    def __init__(self, out: str, *, overwrite: bool, config: bytes | None = None) -> None:
        self.out, self.overwrite, self.config = out.rstrip("/") or out, overwrite, config
        scheme = url_scheme(out)
        if scheme not in (None, "file"):
            self.store = open_storage(self.out)
            self.where = self.store.url.rstrip("/")
            existing = self.store.list()
        else:
            self.where = os.path.abspath(out[len("file://") :] if scheme == "file" else check_local_path(out))
            if os.path.exists(self.where) and not os.path.isdir(self.where):
                raise CheckpointExistsError(f"{self.where}: a file is there; a sharded export writes a folder (name one that is not a file)")
            self.store = None
            existing = os.listdir(self.where) if os.path.isdir(self.where) else []
        self.existing = [f for f in existing if f in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.match(f)]
        if self.existing and not overwrite:
            raise CheckpointExistsError(
                f"{self.where}: an export is already there ({sorted(self.existing)[0]}); pass overwrite=True to replace it"
            )
        if config is not None and CONFIG_FILE in existing and not overwrite:
            raise CheckpointExistsError(f"{self.where}: a {CONFIG_FILE} is already there; pass overwrite=True to replace it")

    def _path(self, name: str) -> str:
        return f"{self.out}/{name}" if self.store is not None else os.path.join(self.where, name)

    def outputs(self, n: int, knobs: Knobs) -> list[OutputFile]:
        names = [SINGLE_FILE] if n == 1 else [shard_file_name(i, n) for i in range(n)]
        return [OutputFile(self._path(name), overwrite=self.overwrite, knobs=knobs) for name in names]

    def finish(self, groups: list[list[str]], outputs: list[OutputFile], total: int) -> None:
        """Write the index (sharded exports), last; then remove what an earlier export left."""
        written = {os.path.basename(o.where) for o in outputs}
        if self.config is not None:
            self._write(CONFIG_FILE, self.config)
        if len(outputs) > 1:
            weight_map = {name: os.path.basename(o.where) for names, o in zip(groups, outputs) for name in names}
            doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            self._write(INDEX_FILE, (json.dumps(doc, indent=2) + "\n").encode())
            written.add(INDEX_FILE)
        for name in self.existing:
            if name in written:
                continue
            try:
                if self.store is not None:
                    self.store.delete(name)
                else:
                    os.unlink(os.path.join(self.where, name))
            except (OSError, StorageError) as e:
                log.warning("%s: could not remove %s of an earlier export: %s", self.where, name, e)

    def _write(self, name: str, raw: bytes) -> None:
        """One small file of the folder, appearing whole (existing ones were checked in __init__)."""
        output = OutputFile(self._path(name), overwrite=True, knobs=KNOBS)
        done = False
        try:
            with output.writer() as w:
                w.write(memoryview(raw))
            output.publish()
            done = True
        finally:
            if not done:
                output.discard()


def config_json(config: Any) -> bytes:
    """The bytes of config.json for ``config``: a ``PretrainedConfig`` (anything with
    ``to_json_string``), or the path of a config.json or of a folder holding one."""
    if hasattr(config, "to_json_string") and not isinstance(config, (str, os.PathLike)):
        text = config.to_json_string()  # what PretrainedConfig.save_pretrained writes
        return text.encode() if isinstance(text, str) else bytes(text)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"unshard_to_safetensors: argument 'config' must be a transformers PretrainedConfig or the path of a "
            f"config.json, got {type(config).__name__}"
        )
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file: config= names the model's {CONFIG_FILE} (or a folder holding one)") from None
    except OSError as e:
        raise StorageError(f"{path}: cannot read the config: {e.strerror}") from e
    try:
        doc = strict_json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: not a JSON file ({e}); config= names the model's {CONFIG_FILE}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(doc).__name__}, a {CONFIG_FILE} holds an object")
    return raw
