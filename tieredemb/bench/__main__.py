"""``python -m tieredemb.bench hbm ...``: the same as ``tieredemb bench hbm ...``."""

from tieredemb.bench import main

raise SystemExit(main())
