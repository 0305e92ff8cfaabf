"""Queue metadata in RocksDB: key encodings, record encodings, the database wrapper.

See docs/meta-schema.md for every prefix and value layout.
"""

from . import _keys as keys
from . import _records as records
from ._db import (
    Batch,
    MetaDB,
    SstWriter,
    locked_by_another_process,
    new_batch,
    private_copy,
    space_to_open,
    write_sst,
)

__all__ = ["Batch", "MetaDB", "SstWriter", "keys", "locked_by_another_process", "new_batch",
           "private_copy", "records",
           "space_to_open",
           "write_sst"]
