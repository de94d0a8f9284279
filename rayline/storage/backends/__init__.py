"""The storage seam: one object-store interface (``ObjectStore``) and a backend per URI scheme (docs/storage.md):
local paths (:class:`local.LocalStore`), ``s3://`` (s3fs), ``gs://`` (gcsfs) and ``az://`` (adlfs).

:func:`store_for` is the one place a URI's scheme picks a client, built with the one :class:`StoragePolicy`
(attempts and timeouts) from settings. Nothing outside ``rayline.storage`` tests a scheme or builds a client.
"""

from __future__ import annotations

from rayline.config import CLOUD_SCHEMES, get_settings
from rayline.errors import ConfigError
from rayline.extras import install_hint
from rayline.storage.backends.base import ObjectStore, Page, Stat, StoragePolicy, Versioned

__all__ = ["CLOUD_SCHEMES", "ObjectStore", "Page", "Stat", "StoragePolicy", "Versioned", "scheme_of", "store_for"]


def scheme_of(uri: str) -> str:
    """``s3``, ``gs`` or ``az`` for a cloud URI, ``file`` for anything else (a normalized local path)."""
    head, sep, _ = uri.partition("://")
    return head if sep and head in CLOUD_SCHEMES else "file"


def store_for(uri: str) -> ObjectStore:
    """The store that holds ``uri``, with this process's settings (its client is shared across calls)."""
    scheme = scheme_of(uri)
    policy = StoragePolicy.from_settings()
    if scheme == "s3":
        from rayline.storage.backends.s3 import S3Store

        settings = get_settings()
        return S3Store(settings.aws_endpoint_url, settings.aws_region, policy)
    if scheme == "gs":
        try:
            from rayline.storage.backends.gcs import GCSStore
        except ImportError as exc:
            raise ConfigError(f"{uri}: gs:// storage needs gcsfs: {install_hint('gcs')} ({exc})") from exc
        return GCSStore(policy)
    if scheme == "az":
        try:
            from rayline.storage.backends.azure import AzureStore
        except ImportError as exc:
            raise ConfigError(f"{uri}: az:// storage needs adlfs: {install_hint('azure')} ({exc})") from exc
        return AzureStore(policy)
    from rayline.storage.backends.local import LocalStore

    return LocalStore()
