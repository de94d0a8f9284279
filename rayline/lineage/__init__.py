"""Lineage: which inputs, parameters and code produced which outputs, and the graph they make.

- ``records``: the typed records every stage writes beside its outputs (this package's face:
  ``from rayline import lineage``; ``lineage.write_record(...)``, ``lineage.DatasetRef``);
- ``written``: each dataset's schema and size, read back from what a run wrote;
- ``openlineage_events``, ``openlineage_facets``: the same runs as OpenLineage events (START, COMPLETE, FAIL,
  ABORT) and their datasets' facets;
- ``graph``, ``nights``: the upstream graph of any stored output, and the Delta tables' nights in it.

It sits on top of the core's subpackages: it may import ``rayline.storage``, ``rayline.tables`` and
``rayline.models`` (the graph reads tables and registry versions); none of them imports it.
"""

from rayline.lineage.records import (
    LINEAGE_DIR,
    Column,
    DatasetRef,
    DeclaresLineage,
    ErrorBudget,
    LineageRecord,
    RunContext,
    code_version,
    is_storage_uri,
    lineage_dir,
    normalize_uri,
    read_records,
    write_record,
)

__all__ = [
    "LINEAGE_DIR",
    "Column",
    "DatasetRef",
    "DeclaresLineage",
    "ErrorBudget",
    "LineageRecord",
    "RunContext",
    "code_version",
    "is_storage_uri",
    "lineage_dir",
    "normalize_uri",
    "read_records",
    "write_record",
]
