"""Key -> row-address indexes."""

from tieredemb.index.key_index import InsertResult, KeyIndex, Region, bucket_of

__all__ = ["InsertResult", "KeyIndex", "Region", "bucket_of"]
