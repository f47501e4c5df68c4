"""tieredemb: embedding tables larger than GPU memory, keyed by raw int64 ids.

See ``README.md`` for the quick start and ``DESIGN.md`` (shared) for the contract.
"""

from tieredemb import checkpoint, init, optim, storage
from tieredemb.config import RESERVED_KEY, FrequencyAdmission, HotRows, StorageConfig, TableConfig
from tieredemb.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from tieredemb.modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    TableRows,
    TableStats,
)
from tieredemb.pipeline import Stash, StashConfig, TrainPipeline

__version__ = "0.1.0"

__all__ = [
    "RESERVED_KEY",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "FrequencyAdmission",
    "HotRows",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "Stash",
    "StashConfig",
    "StorageConfig",
    "TableConfig",
    "TableRows",
    "TableStats",
    "TrainPipeline",
    "checkpoint",
    "init",
    "optim",
    "storage",
]
