"""``python -m tieredemb.bench hbm ...``: the same as ``tieredemb bench hbm ...`` (the same errors too)."""

import sys

from tieredemb.cli import main

raise SystemExit(main(["bench", *sys.argv[1:]]))
