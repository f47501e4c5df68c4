"""Row storage: the row store, the tiers and the backing stores."""

from tieredemb.storage.backends import BackendSpec, HostMemory, Redis, RocksDB

__all__ = ["BackendSpec", "HostMemory", "RocksDB", "Redis"]
