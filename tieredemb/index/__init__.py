"""Key -> row-address indexes."""

from tieredemb.index.key_index import InsertResult, KeyIndex, bucket_of

__all__ = ["InsertResult", "KeyIndex", "bucket_of"]
