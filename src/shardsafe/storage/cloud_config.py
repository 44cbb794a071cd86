"""Where an object-store URL points, and how its client is configured.

URL forms: ``s3://bucket/prefix`` (also ``s3a://``), ``gs://bucket/prefix`` (also ``gcs://``),
``az://container/prefix`` (also ``azure://``). The prefix may be empty (the bucket root).

Each store is configured from, in order of precedence:

1. explicit :class:`ObjectStoreOptions` (``endpoint``, ``region``, ``profile``, ``credentials``,
   ``config``, ``client_options``);
2. the cloud's standard environment, read by the client itself: ``AWS_*`` (keys, session token,
   region, ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, web identity, container credentials),
   ``GOOGLE_APPLICATION_CREDENTIALS`` / ``GOOGLE_SERVICE_ACCOUNT*`` / ``GOOGLE_BASE_URL``, and
   ``AZURE_STORAGE_*``; plus three this module reads itself: ``AWS_PROFILE`` with the shared
   ``~/.aws/credentials`` and ``~/.aws/config`` files, ``STORAGE_EMULATOR_HOST`` (GCS emulators)
   and ``AZURE_STORAGE_CONNECTION_STRING``;
3. the cloud's ambient identity (instance metadata, gcloud application-default credentials).

An ``http://`` endpoint turns on plain HTTP for that store; nothing else does.
"""

from __future__ import annotations

import configparser
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import StorageError

__all__ = ["OBJECT_SCHEMES", "ObjectLocation", "ObjectStoreOptions", "build_store", "parse_object_url"]

_CLOUDS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "azure": "azure"}
_CANONICAL = {"s3": "s3", "gcs": "gs", "azure": "az"}
OBJECT_SCHEMES = frozenset(_CLOUDS)
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://([^/?#]*)/*([^?#]*)$")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ObjectLocation:
    """A bucket (or Azure container) and a prefix inside it, with no leading or trailing slash."""

    cloud: str  # "s3" | "gcs" | "azure"
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        base = f"{_CANONICAL[self.cloud]}://{self.bucket}"
        return f"{base}/{self.prefix}" if self.prefix else base


def parse_object_url(url: str) -> ObjectLocation:
    m = _URL.match(url)
    if not m or m.group(1).lower() not in _CLOUDS:
        raise StorageError(f"{url}: not an object-store URL; expected s3://bucket/prefix, gs://bucket/prefix or az://container/prefix")
    scheme, bucket, prefix = m.group(1).lower(), m.group(2), m.group(3).strip("/")
    if not bucket:
        raise StorageError(f"{url}: the URL names no bucket; expected {scheme}://bucket/prefix")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise StorageError(f"{url}: the prefix has an empty, '.' or '..' segment")
    return ObjectLocation(_CLOUDS[scheme], bucket, prefix)


@dataclass(frozen=True, kw_only=True)
class ObjectStoreOptions:
    """Explicit settings for an object store; each one overrides the environment."""

    endpoint: str | None = None
    """Service URL: an S3-compatible store (MinIO, R2, Ceph), a GCS emulator, or an Azure blob
    endpoint (``http://host:port/account`` for Azurite). ``http://`` allows plain HTTP."""

    region: str | None = None
    """S3 region (else ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, the profile's, ``us-east-1``)."""

    profile: str | None = None
    """S3: a profile of the shared AWS config files to take keys, region and endpoint from."""

    credentials: Mapping[str, str] | None = None
    """Credentials under the client's key names: S3 ``access_key_id``, ``secret_access_key``,
    ``session_token``; GCS ``service_account_path``, ``service_account_key``,
    ``application_credentials``, ``bearer_token``; Azure ``account_name``, ``account_key``,
    ``sas_key``, ``token``, ``client_id``/``client_secret``/``tenant_id``."""

    config: Mapping[str, Any] | None = None
    """Any other setting of the client's store config (obstore ``S3Config``, ``GCSConfig``,
    ``AzureConfig`` keys), e.g. ``{"conditional_put": "disabled"}``."""

    client_options: Mapping[str, Any] | None = None
    """HTTP client settings (obstore ``ClientConfig``): ``timeout``, ``connect_timeout``,
    ``proxy_url``, ``allow_http``, ..."""

    max_retries: int | None = None
    """Retries of a failed request (throttling, 5xx, resets, timeouts); default: knob
    ``object_max_retries``."""

    retry_timeout_s: float | None = None
    """No retry starts later than this after the first try; default: knob ``object_retry_timeout_s``."""

    part_bytes: int | None = None
    """Multipart upload part size; default: knob ``object_part_bytes``."""

    get_bytes: int | None = None
    """Largest single ranged GET; bigger reads are split; default: knob ``object_get_bytes``."""

    concurrency: int | None = None
    """Requests in flight per uploaded file, and ranged GETs in flight per storage; default: knob
    ``object_concurrency``."""

    coalesce_gap_bytes: int = 0
    """Rows of a strided read closer than this are fetched as one range, gaps included. 0: every
    row is its own ranged GET (all in flight together), so a load moves only the bytes it needs;
    raise it to trade bytes for fewer requests."""

    def __post_init__(self) -> None:
        for name in ("max_retries", "part_bytes", "get_bytes", "concurrency", "coalesce_gap_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"ObjectStoreOptions.{name} must be a non-negative int, got {v!r}")
        if self.part_bytes is not None and self.part_bytes < 5 << 20:
            raise ValueError(f"ObjectStoreOptions.part_bytes must be at least 5 MiB (the S3 minimum), got {self.part_bytes}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"ObjectStoreOptions.concurrency must be at least 1, got {self.concurrency}")
        if self.retry_timeout_s is not None and self.retry_timeout_s <= 0:
            raise ValueError(f"ObjectStoreOptions.retry_timeout_s must be positive, got {self.retry_timeout_s}")
        if self.endpoint is not None and not re.match(r"^https?://", self.endpoint):
            raise ValueError(f"ObjectStoreOptions.endpoint must start with http:// or https://, got {self.endpoint!r}")


def build_store(loc: ObjectLocation, opts: ObjectStoreOptions, *, max_retries: int, retry_timeout_s: float) -> Any:
    """The obstore client for ``loc``: configuration resolved as the module docstring says."""
    try:
        from obstore.store import AzureStore, GCSStore, S3Store
    except ImportError as e:  # pragma: no cover - obstore is a dependency
        raise StorageError(f"{loc.url}: object stores need the 'obstore' package: {e}") from e
    config: dict[str, Any] = {}
    endpoint = opts.endpoint
    if loc.cloud == "s3":
        endpoint = _s3_config(loc, opts, config, endpoint)
    elif loc.cloud == "gcs":
        endpoint = _gcs_config(opts, config, endpoint)
    else:
        endpoint = _azure_config(loc, opts, config, endpoint)
    config.update(opts.credentials or {})
    config.update(opts.config or {})
    client = dict(opts.client_options or {})
    if endpoint and endpoint.startswith("http://"):
        client.setdefault("allow_http", True)
    retry = {
        "max_retries": max_retries,
        "retry_timeout": timedelta(seconds=retry_timeout_s),
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2},
    }
    kwargs: dict[str, Any] = {"prefix": loc.prefix or None, "client_options": client or None, "retry_config": retry}
    provider = config.pop("_credential_provider", None)
    if provider is not None:
        kwargs["credential_provider"] = provider
    # obstore retries inside its own (Rust) client and does not report each retry: what is logged
    # is the policy; a request that still fails is raised as StorageError naming the object
    log.debug(
        "%s: %s client, endpoint %s, up to %d retries within %s s (backoff 0.1 s doubling to 15 s)",
        loc.url, loc.cloud, endpoint or "default", max_retries, retry_timeout_s,
    )
    try:
        if loc.cloud == "s3":
            return S3Store(loc.bucket, config=config, **kwargs)
        if loc.cloud == "gcs":
            return GCSStore(loc.bucket, config=config, **kwargs)
        return AzureStore(loc.bucket, config=config, **kwargs)
    except Exception as e:  # obstore raises its own errors (unknown key, bad value) and ValueError
        raise StorageError(f"{loc.url}: cannot configure the {loc.cloud} client: {str(e).splitlines()[0]}") from e


# --- S3 ----------------------------------------------------------------------------------------


def _s3_config(loc: ObjectLocation, opts: ObjectStoreOptions, config: dict[str, Any], endpoint: str | None) -> str | None:
    env = os.environ
    profile_name = opts.profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    explicit_profile = opts.profile is not None
    profile = _aws_profile(profile_name or "default", required=explicit_profile or bool(profile_name), url=loc.url)
    creds = opts.credentials or {}
    has_keys = "access_key_id" in creds or "secret_access_key" in creds
    if profile and not has_keys and (explicit_profile or "AWS_ACCESS_KEY_ID" not in env):
        if "aws_access_key_id" in profile:
            config["access_key_id"] = profile["aws_access_key_id"]
            config["secret_access_key"] = profile.get("aws_secret_access_key", "")
            if "aws_session_token" in profile:
                config["session_token"] = profile["aws_session_token"]
        elif explicit_profile or profile_name:
            config["_credential_provider"] = _boto3_provider(profile_name or "default", loc.url)
    if opts.region:
        config["region"] = opts.region
    elif profile and "region" in profile and not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")):
        config["region"] = profile["region"]
    if endpoint is None:
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT")
        if endpoint is None and profile:
            endpoint = profile.get("endpoint_url")
    if endpoint:
        config["endpoint"] = endpoint
        config["aws_endpoint_url_s3"] = endpoint  # else an AWS_ENDPOINT_URL_S3 variable would win
    return endpoint


def _aws_profile(name: str, *, required: bool, url: str) -> dict[str, str] | None:
    """Settings of profile ``name`` from the shared credentials and config files (credentials win)."""
    home = os.path.expanduser("~")
    cred_file = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
    conf_file = os.environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")
    merged: dict[str, str] = {}
    found = False
    for path, section in ((conf_file, name if name == "default" else f"profile {name}"), (cred_file, name)):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except configparser.Error as e:
            raise StorageError(f"{url}: cannot parse AWS config file {path}: {e}") from e
        if parser.has_section(section):
            found = True
            merged.update({k.lower(): v.strip() for k, v in parser.items(section)})
    if not found:
        if required:
            raise StorageError(f"{url}: AWS profile {name!r} is not in {cred_file} or {conf_file}")
        return None
    return merged


def _boto3_provider(profile: str, url: str) -> Any:
    """Profiles that assume a role, use SSO or a credential process: resolved by boto3."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise StorageError(
            f"{url}: AWS profile {profile!r} has no static keys (role, SSO or credential process); "
            "install boto3 to resolve it, or set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        ) from None
    return Boto3CredentialProvider(boto3.Session(profile_name=profile))


# --- GCS ---------------------------------------------------------------------------------------

_GCS_CREDENTIAL_VARS = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH",
                        "GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_BEARER_TOKEN")


def _gcs_config(opts: ObjectStoreOptions, config: dict[str, Any], endpoint: str | None) -> str | None:
    env = os.environ
    emulator = env.get("STORAGE_EMULATOR_HOST")
    if endpoint is None and emulator:
        endpoint = emulator if "://" in emulator else f"http://{emulator}"
        has_creds = bool(opts.credentials) or any(v in env for v in _GCS_CREDENTIAL_VARS)
        if not has_creds:  # emulators take anonymous requests; never ask a metadata server for a token
            # (obstore 0.12's GCS client ignores skip_signature; a key with disable_oauth is the way)
            config["service_account_key"] = json.dumps(
                {"disable_oauth": True, "gcs_base_url": endpoint, "client_email": "", "private_key": "", "private_key_id": ""}
            )
    if "GOOGLE_BEARER_TOKEN" in env and not opts.credentials:
        config["bearer_token"] = env["GOOGLE_BEARER_TOKEN"]  # documented by obstore, not read from the environment by 0.12
    if endpoint is None:
        endpoint = env.get("GOOGLE_BASE_URL")
    if endpoint:
        config["base_url"] = endpoint.rstrip("/")
    return endpoint


# --- Azure -------------------------------------------------------------------------------------


def _azure_config(loc: ObjectLocation, opts: ObjectStoreOptions, config: dict[str, Any], endpoint: str | None) -> str | None:
    raw = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    creds = opts.credentials or {}
    if raw and "account_name" not in creds:
        parts = _parse_connection_string(raw, loc.url)
        if parts.get("usedevelopmentstorage", "").lower() == "true":
            parts.setdefault("accountname", "devstoreaccount1")
            parts.setdefault("blobendpoint", os.environ.get("AZURITE_BLOB_STORAGE_URL", "http://127.0.0.1:10000") + "/devstoreaccount1")
            parts.setdefault("accountkey", _AZURITE_KEY)
        if "accountname" in parts:
            config["account_name"] = parts["accountname"]
        if "accountkey" in parts:
            config["account_key"] = parts["accountkey"]
        if "sharedaccesssignature" in parts:
            config["sas_key"] = parts["sharedaccesssignature"]
        if endpoint is None and "blobendpoint" in parts:
            endpoint = parts["blobendpoint"]
        elif endpoint is None and "endpointsuffix" in parts and "accountname" in parts:
            proto = parts.get("defaultendpointsprotocol", "https")
            endpoint = f"{proto}://{parts['accountname']}.blob.{parts['endpointsuffix']}"
    if endpoint is None:
        endpoint = os.environ.get("AZURE_STORAGE_ENDPOINT") or os.environ.get("AZURE_ENDPOINT")
    if endpoint:
        config["endpoint"] = endpoint.rstrip("/")
    return endpoint


# The documented, public key of the Azurite emulator's built-in account.
_AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _parse_connection_string(raw: str, url: str) -> dict[str, str]:
    out = {}
    for item in raw.strip().strip(";").split(";"):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise StorageError(f"{url}: AZURE_STORAGE_CONNECTION_STRING has an item without '=': {key.strip()!r}")
        out[key.strip().lower()] = value.strip()
    return out
