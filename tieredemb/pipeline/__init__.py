"""Training pipelines: the next batches' host-to-device copy and prefetch overlapped with the step.

``TrainPipeline`` (single process) follows TorchRec's ``progress(dataloader_iter)`` convention; see
``docs/pipeline.md``.
"""

from tieredemb.pipeline.stash import Stash, StashConfig
from tieredemb.pipeline.train_pipeline import TrainPipeline

__all__ = ["Stash", "StashConfig", "TrainPipeline"]
