"""Models the command line trains: a small DLRM over an ``EmbeddingBagCollection``."""

from tieredemb.models.dlrm import DLRM, DLRMConfig, DotInteraction, make_tables

__all__ = ["DLRM", "DLRMConfig", "DotInteraction", "make_tables"]
