"""Checkpoints in object stores: S3 (moto), GCS (fake-gcs-server) and Azure (Azurite), real servers
on 127.0.0.1 behind a counting, fault-injecting proxy (``tests/servers.py``, ``tests/faulty_proxy.py``).

The byte-level contract every backend shares is in ``test_storage.py``; this module covers what
is particular to object stores: URLs and configuration, multipart uploads and ranged GETs,
multi-rank save and resharded load, bytes moved, retries and permanent failures.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import queue as queue_mod
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import (
    Checkpointer,
    CheckpointExistsError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
    verify,
)
from shardsafe.knobs import KNOBS
from shardsafe.storage import ObjectStoreOptions, open_storage
from shardsafe.storage.object_store import ObjectStorage

from .helpers import run_process, run_ranks
from .racing import race_puts
from .servers import AZURITE_ACCOUNT, AZURITE_KEY, CLOUDS, Cloud, azure_blob_names, cloud, fresh, s3_multipart_uploads

PART = 5 << 20  # the smallest part S3 allows, so that small test files still go in several parts
GET = 1 << 20


@pytest.fixture(params=CLOUDS)
def object_cloud(request) -> Cloud:
    yield from fresh(request.param)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No cloud settings from the machine running the tests."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "GOOGLE_", "AZURE_", "AZURITE_")) or name == "STORAGE_EMULATOR_HOST":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    return monkeypatch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _full(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=g).to(dtype)


def _open(c: Cloud, url: str | None = None, **extra) -> ObjectStorage:
    return open_storage(url or c.url(), **{**c.options, **extra})


def _overlap(records) -> int:
    """Most requests in flight at the same moment."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def _is_part(c: Cloud, r) -> bool:
    if c.name == "azure":
        return r.method == "PUT" and "comp=block" in r.query and "blocklist" not in r.query
    return r.method == "PUT" and "partNumber=" in r.query


# --- URLs and options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, expected",
    [
        ("s3://bkt/run/step-10", "s3://bkt/run/step-10"),
        ("s3a://bkt/run/step-10/", "s3://bkt/run/step-10"),
        ("S3://bkt//run", "s3://bkt/run"),
        ("gs://bkt/a/b", "gs://bkt/a/b"),
        ("gcs://bkt/a", "gs://bkt/a"),
        ("az://container/ckpt", "az://container/ckpt"),
        ("azure://container/ckpt", "az://container/ckpt"),
        ("s3://bkt", "s3://bkt"),
    ],
)
def test_object_urls_open_an_object_storage(clean_env, url: str, expected: str) -> None:
    s = open_storage(url, endpoint="http://127.0.0.1:9", credentials=_fake_credentials(expected))
    assert isinstance(s, ObjectStorage)
    assert s.url == expected


def _fake_credentials(url: str) -> dict[str, str]:
    if url.startswith("s3"):
        return {"access_key_id": "AKIAFAKE", "secret_access_key": "fake"}
    if url.startswith("gs"):
        return {"bearer_token": "fake"}
    return {"account_name": "fake", "account_key": AZURITE_KEY}


@pytest.mark.parametrize(
    "url, message",
    [
        ("s3:///prefix", "names no bucket"),
        ("gs://bkt/a/../b", "'..' segment"),
        ("az://c/a/./b", "'.' or '..' segment"),
    ],
)
def test_bad_object_urls_are_storage_errors(clean_env, url: str, message: str) -> None:
    with pytest.raises(StorageError, match=message) as info:
        open_storage(url)
    assert url in str(info.value)


def test_options_are_checked_and_only_for_object_urls(tmp_path) -> None:
    with pytest.raises(ValueError, match="part_bytes must be at least 5 MiB"):
        ObjectStoreOptions(part_bytes=1 << 20)
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        ObjectStoreOptions(concurrency=0)
    with pytest.raises(ValueError, match="endpoint must start with http:// or https://"):
        ObjectStoreOptions(endpoint="localhost:9000")
    with pytest.raises(TypeError, match="unexpected keyword argument 'endpont'"):
        open_storage("s3://bkt/x", endpont="http://x")
    with pytest.raises(TypeError, match="object-store URLs only"):
        open_storage(str(tmp_path), region="us-east-1")
    s = open_storage(str(tmp_path))
    assert open_storage(s) is s
    with pytest.raises(TypeError, match="not to a Storage already opened"):
        open_storage(s, region="us-east-1")


def test_unknown_client_setting_is_a_storage_error(clean_env) -> None:
    with pytest.raises(StorageError, match=r"s3://bkt/x: cannot configure the s3 client: .*no_such_key"):
        open_storage("s3://bkt/x", endpoint="http://127.0.0.1:9", config={"no_such_key": "1"})


# --- credentials and endpoints from the environment ----------------------------------------------


def _touch(storage) -> None:
    storage.put_atomic("probe.json", b"{}", overwrite=True)
    assert storage.read("probe.json") == b"{}"


def test_s3_keys_region_and_endpoint_from_aws_variables(clean_env) -> None:
    c = cloud("s3")
    clean_env.setenv("AWS_ACCESS_KEY_ID", "AKIAFROMENV")
    clean_env.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    clean_env.setenv("AWS_REGION", "eu-central-1")
    clean_env.setenv("AWS_ENDPOINT_URL", c.proxy.url)
    c.proxy.reset_records()
    _touch(open_storage(c.url()))
    assert {(r.key_id, r.region) for r in c.proxy.snapshot()} == {("AKIAFROMENV", "eu-central-1")}

    c.proxy.reset_records()  # explicit options win over the environment
    _touch(open_storage(c.url(), region="ap-south-1", credentials={"access_key_id": "AKIAEXPLICIT", "secret_access_key": "s"}))
    assert {(r.key_id, r.region) for r in c.proxy.snapshot()} == {("AKIAEXPLICIT", "ap-south-1")}


def test_s3_profile_from_shared_files(clean_env, tmp_path) -> None:
    c = cloud("s3")
    creds, conf = tmp_path / "credentials", tmp_path / "config"
    creds.write_text("[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = d\n\n"
                     "[ci]\naws_access_key_id = AKIAPROFILE\naws_secret_access_key = p\n")
    conf.write_text(f"[default]\nregion = us-west-2\nendpoint_url = {c.proxy.url}\n\n"
                    f"[profile ci]\nregion = eu-west-3\nendpoint_url = {c.proxy.url}\n")
    clean_env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    clean_env.setenv("AWS_CONFIG_FILE", str(conf))

    def seen(storage) -> set:
        c.proxy.reset_records()
        _touch(storage)
        return {(r.key_id, r.region) for r in c.proxy.snapshot()}

    assert seen(open_storage(c.url())) == {("AKIADEFAULT", "us-west-2")}  # no variables: the default profile
    clean_env.setenv("AWS_PROFILE", "ci")
    assert seen(open_storage(c.url())) == {("AKIAPROFILE", "eu-west-3")}
    clean_env.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")  # keys in the environment beat AWS_PROFILE ...
    clean_env.setenv("AWS_SECRET_ACCESS_KEY", "e")
    assert seen(open_storage(c.url())) == {("AKIAENV", "eu-west-3")}
    assert seen(open_storage(c.url(), profile="default")) == {("AKIADEFAULT", "us-west-2")}  # ... an explicit one beats them
    with pytest.raises(StorageError, match=r"AWS profile 'nope' is not in .*credentials"):
        open_storage(c.url(), profile="nope")


def test_gcs_emulator_host_means_anonymous_unless_credentials_are_set(clean_env) -> None:
    c = cloud("gcs")
    clean_env.setenv("STORAGE_EMULATOR_HOST", c.proxy.url.removeprefix("http://"))
    c.proxy.reset_records()
    _touch(open_storage(c.url()))
    assert {r.key_id for r in c.proxy.snapshot()} == {None}
    clean_env.setenv("GOOGLE_BEARER_TOKEN", "token-from-env")
    c.proxy.reset_records()
    _touch(open_storage(c.url()))
    assert {r.key_id for r in c.proxy.snapshot()} == {"bearer:token-from-env"}


def test_azure_connection_string(clean_env) -> None:
    c = cloud("azure")
    endpoint = c.options["endpoint"]
    clean_env.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};",
    )
    c.proxy.reset_records()
    _touch(open_storage(c.url()))  # Azurite checks the shared-key signature
    assert {r.key_id for r in c.proxy.snapshot()} == {AZURITE_ACCOUNT}
    wrong = AZURITE_KEY[:-8] + "AAAAAAA="
    clean_env.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName={AZURITE_ACCOUNT};AccountKey={wrong};BlobEndpoint={endpoint}")
    with pytest.raises(StorageError, match=r"(?s)az://shardsafe-test/.*probe\.json: write failed: HTTP 403.*check the credentials"):
        _touch(open_storage(c.url()))


# --- whole checkpoints, one process ------------------------------------------------------------


def test_every_api_works_on_a_url_configured_by_the_environment(object_cloud, clean_env) -> None:
    c = object_cloud
    for k, v in c.env.items():
        clean_env.setenv(k, v)
    url = c.url()
    src = {"w": _full("w", (300, 70), torch.float32), "h": _full("h", (64,), torch.bfloat16), "step": 5, "cfg": {"lr": 0.1}}
    meta, files = Checkpointer().save(url, src)
    (data_file,) = meta.data_files()
    assert files == [f"{url}/{data_file}"]
    assert open_storage(url).list() == sorted(["metadata.json", data_file])
    target = {"w": torch.zeros(300, 70), "h": torch.zeros(64, dtype=torch.bfloat16), "step": 0, "cfg": None}
    Checkpointer().load(url, target)
    for k in ("w", "h"):
        assert torch.equal(_bytes(target[k]), _bytes(src[k]))
    assert (target["step"], target["cfg"]) == (5, {"lr": 0.1})
    out = Checkpointer().unshard(url)
    assert torch.equal(_bytes(out["w"]), _bytes(src["w"])) and out["step"] == 5
    assert Checkpointer().get_metadata(url) == meta
    report = verify(url)
    assert report.ok and report.files == 1 and report.chunks == 2
    assert report.bytes == 300 * 70 * 4 + 64 * 2


def test_model_and_optimizer_functions_and_export_take_an_object_store(tmp_path) -> None:
    from safetensors.torch import load_file

    c = cloud("s3")
    storage = _open(c)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).sum().backward()
    optim.step()
    shardsafe.save_model_and_optim_state(storage, model, optim)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    shardsafe.load_model_and_optim_state(storage, fresh, fresh_optim)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(_bytes(a), _bytes(b))
    for a, b in zip(optim.state.values(), fresh_optim.state.values()):
        assert torch.equal(_bytes(a["exp_avg_sq"]), _bytes(b["exp_avg_sq"]))
    out = tmp_path / "model.safetensors"
    shardsafe.unshard_to_safetensors(storage, str(out), prefix="model.")
    exported = load_file(str(out))
    assert set(exported) == set(model.state_dict())
    assert torch.equal(_bytes(exported["0.weight"]), _bytes(model.state_dict()["0.weight"]))


def test_save_overwrite_false_refuses_and_true_replaces(object_cloud) -> None:
    c = object_cloud
    storage = _open(c)
    meta1, _ = Checkpointer().save(storage, {"w": torch.ones(10)})
    with pytest.raises(CheckpointExistsError, match=rf"{storage.url}: a checkpoint is already committed there"):
        Checkpointer().save(storage, {"w": torch.zeros(10)})
    meta2, _ = Checkpointer().save(storage, {"w": torch.full((10,), 2.0)}, save_overwrite=True)
    assert storage.list() == sorted(["metadata.json", *meta2.data_files()])  # the old data file is gone
    assert meta1.data_files() != meta2.data_files()
    out = Checkpointer().unshard(storage)
    assert torch.equal(out["w"], torch.full((10,), 2.0))


def test_a_commit_whose_answer_was_lost_is_recognised_as_ours(object_cloud) -> None:
    """The conditional create of metadata.json reaches the store but its answer is lost; the
    retry is refused (the object exists) and the storage sees that the object is its own."""
    c = object_cloud
    storage = _open(c)
    c.proxy.faults(1.0, ("lost",), methods={"PUT"}, path=r"metadata\.json$", limit=1)
    src = {"w": _full("w", (50, 3), torch.float32)}
    Checkpointer().save(storage, src)
    puts = [(r.fault, r.status) for r in c.proxy.snapshot() if r.path.endswith("metadata.json") and r.method == "PUT"]
    assert puts[0] == ("lost", 0) and len(puts) == 2 and puts[1][1] in (409, 412)
    with pytest.raises(FileExistsError):  # a first try that finds the object is refused as before
        storage.put_atomic("metadata.json", b"{}", overwrite=False)
    out = Checkpointer().unshard(storage)
    assert torch.equal(_bytes(out["w"]), _bytes(src["w"]))


def test_verify_finds_a_damaged_object(object_cloud) -> None:
    c = object_cloud
    storage = _open(c)
    meta, _ = Checkpointer().save(storage, {"w": _full("w", (40, 40), torch.float32)})
    (name,) = meta.data_files()
    raw = bytearray(storage.read(name))
    raw[-3] ^= 0x10
    storage.put_atomic(name, bytes(raw), overwrite=True)
    report = verify(storage, collect_all=True)
    assert len(report.errors) == 1 and "checksum mismatch" in report.errors[0] and name in report.errors[0]
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        Checkpointer().load(storage, {"w": torch.zeros(40, 40)})


def _read_through_corruption(read: str, storage, tmp_path) -> None:
    if read == "load":
        Checkpointer().load(storage, {"w": torch.zeros(40, 40), "step": 0})
    elif read == "reshard":  # rows 0-19 only: part of the stored chunk
        part = shardsafe.ShardedTensor.from_rank_offsets("w", torch.zeros(20, 40), (0, 0, 2))
        Checkpointer().load(storage, {"w": part})
    elif read == "unshard":
        Checkpointer().unshard(storage)
    elif read == "export":
        shardsafe.unshard_to_safetensors(storage, tmp_path / "out.safetensors")
    else:
        verify(storage)


@pytest.mark.parametrize("read", ["load", "reshard", "unshard", "export", "verify"])
def test_a_body_corrupted_in_transit_is_caught_by_our_checksums(object_cloud, tmp_path, read: str) -> None:
    """The server answers 200/206 with its own length and ETag, so its checks pass; one byte of
    the chunk was flipped on the way. Every read path that returns that byte must refuse it,
    naming the file and the key."""
    c = object_cloud
    storage = _open(c)
    meta, _ = Checkpointer().save(storage, {"w": _full("w", (40, 40), torch.float32), "step": 1234})
    ((name, spec),) = list(meta.tensors["w"].chunks())
    c.proxy.corrupt(rf"/{name}$", at=spec.byte_range[0] + 4 * 7 + 2)  # row 0, element 7
    with pytest.raises(CorruptCheckpointError, match=rf"(?s)(?=.*{name})(?=.*'w')"):
        _read_through_corruption(read, storage, tmp_path)
    assert "corrupt" in {r.fault for r in c.proxy.snapshot()}


def test_metadata_corrupted_in_transit_is_caught_by_our_checksum(object_cloud) -> None:
    """One digit of a stored value changes on the way (the JSON stays valid): the checksum of
    metadata.json must catch it, not the caller's training loop."""
    c = object_cloud
    storage = _open(c)
    Checkpointer().save(storage, {"w": _full("w", (4, 4), torch.float32), "step": 1234})
    raw = storage.read("metadata.json")
    c.proxy.corrupt(r"/metadata\.json$", at=raw.index(b"1234") + 3)  # "1234" -> "1235"
    target = {"w": torch.zeros(4, 4), "step": 0}
    with pytest.raises(CorruptCheckpointError, match="metadata.json"):
        Checkpointer().load(storage, target)
    assert "corrupt" in {r.fault for r in c.proxy.snapshot()}


# --- uploads and ranged reads ------------------------------------------------------------------


def test_upload_goes_in_parts_with_several_in_flight(object_cloud) -> None:
    c = object_cloud
    storage = _open(c, part_bytes=PART, concurrency=4)
    payload = os.urandom(4 * PART + 12345)
    with storage.write_file("d.bin") as w:
        for pos in range(0, len(payload), 3 << 20):  # writes of a size unrelated to the part size
            w.write(memoryview(payload)[pos : pos + (3 << 20)])
    parts = [r for r in c.proxy.snapshot() if _is_part(c, r)]
    assert len(parts) == 5
    assert max(r.sent for r in parts) == PART  # never the whole file in one request
    assert _overlap(parts) >= 2
    assert storage.read("d.bin") == payload


def test_large_read_is_split_into_concurrent_ranged_gets(object_cloud) -> None:
    c = object_cloud
    storage = _open(c, get_bytes=GET, concurrency=4)
    payload = os.urandom(6 * GET + 100)
    storage.put_atomic("d.bin", payload, overwrite=False)
    c.proxy.reset_records()
    c.proxy.delay(0.05, path=r"/d\.bin$", methods={"GET"})  # a far store: the GETs overlap however busy this machine is
    try:
        a, b = bytearray(2 * GET + 7), bytearray(4 * GET)
        storage.read_into("d.bin", 50, [memoryview(a), memoryview(b)])
    finally:
        c.proxy.clear()
    assert bytes(a) + bytes(b) == payload[50 : 50 + 6 * GET + 7]
    gets = [r for r in c.proxy.snapshot() if r.method == "GET"]
    assert len(gets) == 7 and sum(r.received for r in gets) == 6 * GET + 7
    assert _overlap(gets) >= 2


def test_many_separate_ranges_are_fetched_concurrently_and_exactly(object_cloud) -> None:
    c = object_cloud
    storage = _open(c)
    payload = os.urandom(1 << 20)
    storage.put_atomic("d.bin", payload, overwrite=False)
    c.proxy.reset_records()
    spans = [(i * 10_000 + 7, memoryview(bytearray(3000))) for i in range(60)]  # rows of a strided box
    storage.read_spans_into("d.bin", spans)
    assert all(bytes(v) == payload[o : o + 3000] for o, v in spans)
    gets = c.proxy.snapshot()
    assert len(gets) == 60 and sum(r.received for r in gets) == 60 * 3000  # none merged: no byte over-read
    assert _overlap(gets) >= 2
    with pytest.raises(CorruptCheckpointError, match=r"d\.bin: truncated: .*1048576 bytes"):
        storage.read_spans_into("d.bin", [(0, memoryview(bytearray(4))), ((1 << 20) - 2, memoryview(bytearray(4)))])
    with pytest.raises(CorruptCheckpointError, match=r"gone\.bin: data file named in the metadata is missing"):
        storage.read_spans_into("gone.bin", [(0, memoryview(bytearray(4)))])


def test_a_strided_load_reads_the_checksum_blocks_of_its_rows_and_no_byte_more() -> None:
    """Columns out of row-major chunks: every byte returned is checked, so the load reads the
    whole checksum blocks that hold its rows, and nothing outside them."""
    c = cloud("s3")
    storage = _open(c)
    full = _full("m", (64, 4096), torch.float32)  # rows of 16 KiB
    block = 64 << 10  # 4 rows per checksum block
    meta, _ = Checkpointer(knobs=dataclasses.replace(KNOBS, checksum_block_bytes=block)).save(storage, {"m": full})
    c.proxy.reset_records()
    target = torch.full((16, 1024), float("nan"))  # rows [8, 24), columns [1024, 2048): blocks 2 to 5
    st = shardsafe.ShardedTensor("m", target, (64, 4096), (8, 1024), (16, 1024))
    Checkpointer().load(storage, {"m": st}, no_dist=True)
    assert torch.equal(_bytes(target), _bytes(full[8:24, 1024:2048]))
    gets = [r for r in c.proxy.snapshot() if r.path.endswith(".safetensors")]
    (info,) = meta.file_table
    sums = 8 * (64 * 4096 * 4 // block)  # the file's checksum entry: one digest per block
    assert sum(r.received for r in gets) == info.header_bytes + sums + 4 * block  # its header and checksum entry, then the blocks


def test_an_interrupted_upload_is_aborted(object_cloud) -> None:
    c = object_cloud
    storage = _open(c, part_bytes=PART, concurrency=2)
    prefix = storage.location.prefix
    with pytest.raises(KeyboardInterrupt):
        with storage.write_file("d.bin") as w:
            for _ in range(4):
                w.write(memoryview(os.urandom(PART)))
            raise KeyboardInterrupt
    assert [r for r in c.proxy.snapshot() if _is_part(c, r)], "the test meant parts to have been uploaded"
    assert storage.list() == []
    _assert_no_upload_left(c, prefix)


def _assert_no_upload_left(c: Cloud, prefix: str) -> None:
    if c.name == "s3":
        assert [k for k in s3_multipart_uploads(c) if k.startswith(prefix)] == []
    elif c.name == "gcs":
        assert [k for k in c.proxy.pending_uploads() if k.startswith(prefix)] == []
    else:  # Azure has no abort: uncommitted blocks never become a blob, and expire
        assert azure_blob_names(c, prefix, uncommitted=False) == []


def test_a_part_refused_for_good_fails_the_upload_and_aborts_it(object_cloud) -> None:
    c = object_cloud
    storage = _open(c, part_bytes=PART, concurrency=2)
    part = r"comp=block(&|$)" if c.name == "azure" else r"partNumber="
    c.proxy.deny(rf"d\.bin\?.*{part}", 403, methods={"PUT"}, after=1)  # the first part goes through
    start = time.monotonic()
    with pytest.raises(StorageError, match=rf"(?s){storage.url}/d\.bin: upload failed: HTTP 403 Forbidden \(AccessDenied"):
        with storage.write_file("d.bin") as w:
            for _ in range(12):
                w.write(memoryview(os.urandom(PART)))
    assert time.monotonic() - start < 30
    assert storage.list() == []
    _assert_no_upload_left(c, storage.location.prefix)


# --- many ranks --------------------------------------------------------------------------------

# saved by 2 ranks, loaded by 4 with other placements: rows to rows, rows to columns, replicated
# (moto reads a whole object for every ranged GET, so the row-to-column case is kept small)
SAVE = {"emb": ((5120, 1024), torch.float32, "S0"), "proj": ((32, 16384), torch.bfloat16, "S0"),
        "norm": ((4096,), torch.float32, "R"), "bias": ((1000,), torch.float64, "S0")}
LOAD = {"emb": "S0", "proj": "S1", "norm": "R", "bias": "S0"}


def _dtensors(spec: dict[str, tuple], fill: float | None):
    import torch.distributed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    out = {}
    for key, (shape, dtype, placement) in spec.items():
        p = Replicate() if placement == "R" else Shard(int(placement[1:]))
        dt = distribute_tensor(_full(key, shape, dtype), mesh, [p], src_data_rank=None)
        if fill is not None:
            dt.to_local().fill_(fill)
        out[key] = dt
    return out


def _save_on_ranks(rank, ws, url, env, save):
    os.environ.update(env)
    sd = {**_dtensors(save, None), "step": 11}
    _, files = Checkpointer().save(open_storage(url, part_bytes=PART), sd)
    return files


def _load_on_ranks(rank, ws, url, env, save, load):
    """Load resharded; check every element, bit for bit; return the bytes this rank needs."""
    os.environ.update(env)
    spec = {k: (shape, dtype, load[k]) for k, (shape, dtype, _) in save.items()}
    sd = {**_dtensors(spec, float("nan")), "step": 0}
    Checkpointer().load(open_storage(url, get_bytes=GET), sd)
    expected = _dtensors(spec, None)
    for k in spec:
        assert torch.equal(_bytes(sd[k].to_local()), _bytes(expected[k].to_local())), k
    assert sd["step"] == 11
    return sum(sd[k].to_local().numel() * sd[k].to_local().element_size() for k in spec)


def _save_expecting_error(rank, ws, url, env, save):
    os.environ.update(env)
    try:
        Checkpointer().save(open_storage(url, part_bytes=PART), {**_dtensors(save, None), "step": 11})
    except shardsafe.CheckpointError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_save_on_2_ranks_load_resharded_on_4_moves_only_the_bytes_needed(object_cloud) -> None:
    c = object_cloud
    url = c.url()
    files = run_ranks(2, _save_on_ranks, url, c.env, SAVE)
    saved = c.proxy.snapshot()
    assert len({f[0] for f in files}) == 2
    for (file,) in files:  # each rank streamed its own file in parts, several in flight
        name = file.rsplit("/", 1)[1]
        parts = [r for r in saved if r.path.endswith(name) and _is_part(c, r)]
        assert len(parts) >= 2 and max(r.sent for r in parts) <= PART
        assert not [r for r in saved if r.path.endswith(name) and r.sent > PART]
    commits = [r for r in saved if r.path.endswith("metadata.json") and r.method == "PUT"]
    assert len(commits) == 1 and commits[0].start >= max(r.end for r in saved if r.path.endswith(".safetensors"))

    c.proxy.reset_records()
    needs = run_ranks(4, _load_on_ranks, url, c.env, SAVE, LOAD)
    loaded = c.proxy.snapshot()
    assert [r.method for r in loaded if r.path.endswith("metadata.json")] == ["GET"]  # read once, broadcast
    data = [r for r in loaded if r.path.endswith(".safetensors")]
    assert {r.method for r in data} == {"GET"} and {r.status for r in data} == {206}
    moved, need = sum(r.received for r in data), sum(needs)
    # every byte returned is checked, so each rank reads the whole 1 MiB checksum blocks it touches:
    # emb rows to rows: half of a stored chunk, block-aligned: exactly what it needs (4 x 5 MiB);
    # proj rows to columns: every row, so both stored 512 KiB chunks whole (4 x 1 MiB);
    # norm, replicated: all of it on every rank (4 x 16 KiB); bias: the 4000-byte chunk holding its half (4 x 4000)
    # and, before any of it, the header and the checksum entry of each file it needs (both files, on every rank)
    meta = Checkpointer().get_metadata(_open(c, url), no_dist=True)
    index = [f.header_bytes + 8 * len(meta.resolver.file(i).digests) for i, f in enumerate(meta.file_table)]
    assert moved == 4 * (5 << 20) + 4 * (1 << 20) + 4 * 16384 + 4 * 4000 + 4 * sum(index), (moved, need, index)
    assert need == 4 * (5 << 20) + (1 << 20) + 4 * 16384 + 8000
    assert _overlap(data) >= 2


def test_save_and_load_on_ranks_ride_out_throttling_5xx_and_resets() -> None:
    c = cloud("s3")  # the other stores: the one-process test below
    c.proxy.reset_records()
    url = c.url()
    c.proxy.faults(0.3, ("503", "500", "reset", "cut"))
    run_ranks(2, _save_on_ranks, url, c.env, SAVE)
    run_ranks(3, _load_on_ranks, url, c.env, SAVE, {k: "S0" for k in SAVE})
    faults = Counter(r.fault for r in c.proxy.snapshot() if r.fault)
    c.proxy.clear()
    assert set(faults) == {"503", "500", "reset", "cut"} and sum(faults.values()) >= 8, faults


def test_save_and_load_ride_out_throttling_5xx_and_resets(object_cloud) -> None:
    c = object_cloud
    storage = _open(c, part_bytes=PART, get_bytes=256 << 10)
    src = {"a": _full("a", (1536, 1024), torch.float32), "b": _full("b", (3, 1000), torch.bfloat16), "step": 3}
    c.proxy.faults(0.4, ("503", "500", "reset", "cut"))
    Checkpointer().save(storage, src)  # a 6 MiB file: two parts
    target = {"a": torch.full((1536, 1024), float("nan")), "b": torch.zeros(3, 1000, dtype=torch.bfloat16), "step": 0}
    Checkpointer().load(storage, target)
    for k in ("a", "b"):
        assert torch.equal(_bytes(target[k]), _bytes(src[k])), k
    assert target["step"] == 3
    faults = Counter(r.fault for r in c.proxy.snapshot() if r.fault)
    assert set(faults) == {"503", "500", "reset", "cut"} and sum(faults.values()) >= 4, faults
    assert [r for r in c.proxy.snapshot() if _is_part(c, r) and r.fault is None] != []


def test_a_permanent_403_fails_every_rank_fast_and_leaves_nothing_that_loads() -> None:
    c = cloud("s3")  # the other stores: test_access_denied_is_a_storage_error_at_once
    url = c.url()
    c.proxy.deny(r"shard-r00001-", 403, methods={"PUT", "POST"})
    start = time.monotonic()
    results = run_ranks(2, _save_expecting_error, url, c.env, SAVE)
    assert time.monotonic() - start < 60
    for kind, msg in results:
        assert kind == "StorageError", (kind, msg)
        assert f"{url}/shard-r00001-" in msg and "HTTP 403 Forbidden (AccessDenied: Access Denied)" in msg
    c.proxy.clear()
    storage = _open(c, url)
    assert storage.list() == []  # rank 0's finished file was removed too
    with pytest.raises(IncompleteCheckpointError):
        Checkpointer().load(storage, {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype, _) in SAVE.items()})
    _assert_no_upload_left(c, storage.location.prefix)


# --- permanent errors, one process -------------------------------------------------------------


def test_access_denied_is_a_storage_error_at_once(object_cloud) -> None:
    c = object_cloud
    storage = _open(c)
    storage.put_atomic("metadata.json", b"{}", overwrite=True)
    c.proxy.reset_records()
    c.proxy.deny(r".", 403)
    hint = "check the credentials and their permissions"
    start = time.monotonic()
    ops = {
        "read failed": lambda: storage.read("metadata.json"),
        "list failed": storage.list,
        "write failed": lambda: storage.put_atomic("x.json", b"1", overwrite=False),
        "read of bytes \\[0, 4\\) failed": lambda: storage.read_into("metadata.json", 0, [memoryview(bytearray(4))]),
        "delete failed": lambda: storage.delete("metadata.json"),
    }
    for action, op in ops.items():
        with pytest.raises(StorageError, match=rf"(?s)^{storage.url}.*: {action}: HTTP 403 Forbidden \(AccessDenied: Access Denied\); {hint}"):
            op()
    with pytest.raises(StorageError, match="HTTP 403"):
        Checkpointer().load(storage, {"w": torch.zeros(1)})
    assert time.monotonic() - start < 10  # nothing was retried
    assert {r.status for r in c.proxy.snapshot()} == {403}


def test_missing_bucket_is_a_storage_error_not_an_empty_checkpoint(object_cloud) -> None:
    c = object_cloud
    url = f"{c.scheme}://no-such-bucket/ckpt"
    storage = _open(c, url)
    with pytest.raises(StorageError, match=rf"{url}: list failed: HTTP 404 Not Found.*does not exist"):
        Checkpointer().save(storage, {"w": torch.ones(3)})
    with pytest.raises(StorageError, match=rf"{url}/metadata.json: read failed: HTTP 404"):
        Checkpointer().load(storage, {"w": torch.ones(3)})


def test_retries_give_up_after_max_retries_with_the_cause(object_cloud) -> None:
    c = object_cloud
    storage = _open(c, max_retries=2)
    storage.put_atomic("m.json", b"x", overwrite=True)
    c.proxy.faults(1.0, ("503",))
    with pytest.raises(StorageError, match=r"m\.json: read failed: HTTP 503 Service Unavailable \(SlowDown: .*\), after 2 retries"):
        storage.read("m.json")
    assert len(c.proxy.snapshot()) == 1 + 3


def test_concurrent_commits_one_wins(object_cloud) -> None:
    c = object_cloud
    storage = _open(c)
    race_puts(storage, "metadata.json", overwrite=False)


# --- fork ---------------------------------------------------------------------------------------


def _load_in_forked_child(storage: ObjectStorage, options: dict, queue) -> None:
    out = []
    for how in ("inherited", "opened anew"):
        s = storage if how == "inherited" else open_storage(storage.url, **options)
        start = time.monotonic()
        try:
            Checkpointer().unshard(s)
            out.append((how, "loaded", time.monotonic() - start))
        except StorageError as e:
            out.append((how, str(e), time.monotonic() - start))
    queue.put(out)


def test_a_process_forked_after_use_fails_at_once_instead_of_hanging() -> None:
    """The client's I/O runtime does not survive fork(): in the child every request, through the
    inherited storage or a new one, would wait forever. It fails at once with the way out."""
    c = cloud("s3")
    storage = _open(c)
    src = {"w": _full("w", (300, 70), torch.float32)}
    Checkpointer().save(storage, src)
    assert torch.equal(_bytes(Checkpointer().unshard(storage)["w"]), _bytes(src["w"]))

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_load_in_forked_child, args=(storage, c.options, queue), daemon=True)
    child.start()
    try:
        got = queue.get(timeout=30)
    except queue_mod.Empty:
        pytest.fail("the forked child's object-store request hung")
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
            child.join()
    forked = rf"this process \(pid {child.pid}\) was forked from process {os.getpid()} after that process had used an object store"
    for how, message, seconds in got:
        assert re.search(rf"^{re.escape(storage.url)}: {forked}", message), (how, message)
        assert "'spawn' or 'forkserver'" in message and seconds < 5
    assert [how for how, _, _ in got] == ["inherited", "opened anew"]
    assert torch.equal(_bytes(Checkpointer().unshard(storage)["w"]), _bytes(src["w"]))  # the parent goes on


_FORK_FIRST = r"""
import json, os, sys
import torch
from shardsafe import Checkpointer
from shardsafe.storage import open_storage

url, options = sys.argv[1], json.loads(sys.argv[2])
pid = os.fork()  # before this process used the object store: the child has a working client
if pid == 0:
    out = Checkpointer().unshard(open_storage(url, **options))
    os._exit(0 if torch.equal(out["w"], torch.arange(1000.0)) else 3)
_, status = os.waitpid(pid, 0)
out = Checkpointer().unshard(open_storage(url, **options))
sys.exit(os.waitstatus_to_exitcode(status) or (0 if torch.equal(out["w"], torch.arange(1000.0)) else 4))
"""


def test_a_process_forked_before_any_use_works() -> None:
    c = cloud("s3")
    storage = _open(c)
    Checkpointer().save(storage, {"w": torch.arange(1000.0)})
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    done = run_process([sys.executable, "-c", _FORK_FIRST, storage.url, json.dumps(c.options)], env=env, timeout=120)
    assert done.returncode == 0
