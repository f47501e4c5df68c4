"""Row storage: the row store, the tiers and the backing stores."""

from tieredemb.storage.backend import Backend, Fetched
from tieredemb.storage.backends import BackendSpec, HostMemory, Redis, RocksDB
from tieredemb.storage.errors import BackendError, ExistingRowsError

__all__ = ["Backend", "BackendError", "BackendSpec", "ExistingRowsError", "Fetched", "HostMemory",
           "RocksDB", "Redis"]
