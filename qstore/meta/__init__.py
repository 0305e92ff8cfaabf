"""Queue metadata in RocksDB: key encodings, record encodings, the database wrapper.

See docs/meta-schema.md for every prefix and value layout.
"""

from . import _keys as keys
from . import _records as records
from ._db import Batch, MetaDB, new_batch

__all__ = ["Batch", "MetaDB", "keys", "new_batch", "records"]
