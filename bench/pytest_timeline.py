"""A pytest plugin for finding where the test run's time goes: each test's worker, id, start and
end, one JSON line each, appended to $TIMELINE_OUT (xdist workers load it as the controller does).

    TIMELINE_OUT=/tmp/timeline.jsonl PYTHONPATH=bench .venv/bin/python -m pytest -n 2 --dist loadfile -p pytest_timeline

Lines whose worker is "main" are the controller's echo of the workers' reports."""

from __future__ import annotations

import json
import os
import time

_started: dict[str, float] = {}


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _started[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = {"w": worker, "id": nodeid, "s": _started.get(nodeid), "e": time.time()}
    with open(os.environ["TIMELINE_OUT"], "a") as out:
        out.write(json.dumps(line) + "\n")
