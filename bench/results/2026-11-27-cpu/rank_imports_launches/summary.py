import glob
import json
import statistics

for side in ("before", "after"):
    rows = {}
    for f in sorted(glob.glob(f"/tmp/s49b/launch_{side}_*/results/launch_phases/cells/*/result.json")):
        with open(f) as record:
            r = json.load(record)
        for k in ("imports", "launcher_start", "process_group", "measurement", "teardown"):
            rows.setdefault(k, []).append(r["phases"].get(k, 0.0))
        rows.setdefault("launch_span_s", []).append(r.get("launch_span_s", 0.0))
        rows.setdefault("status_ok", []).append(r["status"] == "ok")
    n = len(rows.get("imports", []))
    print(
        side,
        "records",
        n,
        "ok",
        sum(rows.get("status_ok", [])),
        " ".join(
            f"{k} med {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
            for k, v in rows.items()
            if k != "status_ok"
        ),
    )
