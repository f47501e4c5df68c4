"""The embedding collections."""

from tieredemb.modules.collection import EmbeddingBagCollection, EmbeddingCollection
from tieredemb.storage.tiers.parts import TableRows, TableStats

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "TableRows", "TableStats"]
