"""One line a result of a bench report: the median, p10, mean and max step, peak device memory and
the process's huge pages (tools/ab_bench.sh prints it after each run).

    python3 tools/step_spread.py REPORT.json TAG
"""

import json
import statistics
import sys
from pathlib import Path

report, tag = sys.argv[1], sys.argv[2]
for r in json.loads(Path(report).read_text())["results"]:
    t = sorted(r.get("step_ms_all") or [])
    if t:
        extra = r.get("extra") or {}
        print(f"{tag}  {r['label']}: median {statistics.median(t):.3f} p10 {t[len(t) // 10]:.3f} "
              f"mean {statistics.mean(t):.3f} max {t[-1]:.3f} ms ({len(t)} steps), "
              f"peak device {(r.get('peak_device_bytes') or 0) / 2**30:.2f} GiB, "
              f"huge pages {(extra.get('huge_page_bytes') or 0) / 2**30:.2f} GiB")
