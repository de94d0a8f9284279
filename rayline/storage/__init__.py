"""Storage: where everything rayline writes lives, and how it is written safely.

- ``backends``: the seam: one object-store interface, a backend per scheme and the one retry and timeout
  policy; nothing outside this package builds a client;
- ``uris``: URIs to filesystems, whole-object reads and atomic writes, listings (this package's face:
  ``from rayline import storage``; ``storage.join(...)``, ``storage.read_json(...)``);
- ``conditional`` (and its ``conditional_probe``), ``fencing``, ``leases``: create-if-absent and
  compare-and-swap, fencing tokens, leases;
- ``folders``, ``manifests``: content-addressed output folders committed by typed manifests;
- ``listing``, ``listing_parts``, ``digests``, ``fetching``: a prefix's listing streamed into
  parts, set digests, many small reads;
- ``layout``: the names of the layout (``raw``, ``incoming/dt=…``, the tables, ``_staging``).

It imports only the cross-cutting modules at the top of ``rayline`` (errors, config, specs, ray_work):
never ``rayline.tables``, ``rayline.lineage`` or ``rayline.models``, which all build on it.
"""

from rayline.storage.backends import ObjectStore
from rayline.storage.uris import (
    SKIP_FOLDER_MARKER,
    SKIP_HIDDEN,
    Listing,
    ObjectInfo,
    arrow_filesystem,
    delta_options,
    delta_write_refusal,
    endpoint_of,
    exists,
    filesystem,
    hadoop_uri,
    is_remote,
    join,
    list_folders,
    list_inputs,
    list_names,
    list_objects,
    normalize,
    object_uri,
    read_bytes,
    read_json,
    read_parquet,
    remove_tree,
    skip_reason,
    split_s3,
    storage_error,
    storage_errors,
    storage_root,
    store,
    uri_of_path,
    write_bytes_atomic,
    write_json_atomic,
    write_parquet_atomic,
)

__all__ = [
    "ObjectStore",
    "SKIP_FOLDER_MARKER",
    "SKIP_HIDDEN",
    "Listing",
    "ObjectInfo",
    "arrow_filesystem",
    "delta_options",
    "delta_write_refusal",
    "endpoint_of",
    "exists",
    "filesystem",
    "hadoop_uri",
    "is_remote",
    "join",
    "list_folders",
    "list_inputs",
    "list_names",
    "list_objects",
    "normalize",
    "object_uri",
    "read_bytes",
    "read_json",
    "read_parquet",
    "remove_tree",
    "skip_reason",
    "store",
    "split_s3",
    "storage_error",
    "storage_errors",
    "storage_root",
    "uri_of_path",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_parquet_atomic",
]
