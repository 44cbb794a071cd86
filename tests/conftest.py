"""Fixtures shared by several test modules (helpers that are not fixtures live in ``helpers.py``)."""

from __future__ import annotations

import os

import pytest

from .helpers import built_once, megatron_torch_dist_save, run_ranks


@pytest.fixture
def s3(monkeypatch):
    """The S3 server, with the standard AWS variables set to reach it (and no others)."""
    from .servers import fresh

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    for c in fresh("s3"):
        for k, v in c.env.items():
            monkeypatch.setenv(k, v)
        yield c


@pytest.fixture(scope="session")
def torch_dist_dir(tmp_path_factory) -> str:
    """A ``torch_dist`` checkpoint written by real megatron-core on 2 gloo ranks
    (:func:`tests.helpers.megatron_torch_dist_save`), built once per test run for every worker:
    read it, never change it (copy it first)."""
    pytest.importorskip("megatron.core.dist_checkpointing")
    return built_once(tmp_path_factory, "megatron-torch-dist/iter_0000007", lambda path: run_ranks(2, megatron_torch_dist_save, path, timeout=240))
