"""The tiers a collection resolves its keys through, behind one protocol (``prefetch``, ``settle``,
``release``, ``read``, ``write``, ``export_chunks``, ``import_rows``, ``delete_rows``, ``flush``,
``stats``): ``DeviceTier`` (``device.py``: ``hbm_direct`` and ``hybrid``) and ``CacheTier``
(``cache.py``: a write-back cache over a ``GroupStore`` of backends); ``plan.py`` picks the mode and
builds them; ``parts.py`` holds the per-batch records they answer with."""
