"""Records that prove whose they are (issue 51, items 6 and "records that prove whose they are"):
a record is its folder's cell's only if its spec makes the folder's id, its tokens/s agrees with
its step time and tokens per step, and its cell is one a submit of the folder made. The records
are test_collect's (shaped as run.py writes them) and one real CPU run's; status and collect are
the real commands."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from conftest import run_torchrun_cell
from hpcfsdp.cli import main
from hpcfsdp.contracts.record import write_record
from hpcfsdp.contracts.validity import cell_id_of, figures_problem, identity_problem, record_state
from hpcfsdp.results.read import load_records
from hpcfsdp.sweep.define.matrix import cell_id
from test_collect import GPU_BASE, gpu_sweep, ok_record, spec_of

FASTEST = spec_of(GPU_BASE, strategy="fsdp2_zero2", batch_size=4)  # 14,000 tokens/s per GPU: the sweep's fastest
SLOW = spec_of(GPU_BASE, strategy="ddp", batch_size=1)  # 10,000


def record_of(sweep: Path, spec) -> dict:
    return json.loads((sweep / "cells" / cell_id(spec) / "result.json").read_text())


def test_a_record_relabelled_with_another_cells_id_is_corrupt_and_named_by_status_and_collect(tmp_path, capsys):
    sweep = gpu_sweep(tmp_path)
    relabelled = {
        **record_of(sweep, FASTEST),
        "cell_id": cell_id(SLOW),
    }  # the fastest's figures, in the slow one's folder
    write_record(sweep / "cells" / cell_id(SLOW) / "result.json", relabelled)
    planned = {"cell_id": cell_id(SLOW), "sweep": "gpu", "spec": SLOW.to_dict()}  # as submit writes it: status lists it
    (sweep / "cells" / cell_id(SLOW) / "spec.json").write_text(json.dumps(planned))
    state = record_state(sweep / "cells" / cell_id(SLOW) / "result.json", sweep, cell_id(SLOW))
    assert (
        state.status == "corrupt"
        and f"its spec makes the cell id {cell_id(FASTEST)}, not its folder's" in state.problem
    )
    collection = load_records(sweep)
    assert cell_id(SLOW) not in set(collection.frame["cell_id"])
    assert any(
        str(sweep / "cells" / cell_id(SLOW)) in line and cell_id(FASTEST) in line for line in collection.unreadable
    )
    assert main(["status", str(sweep)]) == 3
    out = capsys.readouterr()
    assert re.search(rf"^{cell_id(SLOW)} +ddp +corrupt ", out.out, re.M) and cell_id(FASTEST) in out.out + out.err


@pytest.mark.parametrize(
    "edit, problem",
    [
        ({"tokens_per_s_per_gpu": 20 * 10_000.0}, "tokens_per_s_per_gpu 200000.0 is not tokens_per_s / world size"),
        ({"tokens_per_s_per_gpu": 20 * 10_000.0, "tokens_per_s": 20 * 20_000.0}, "tokens_per_s 400000.0 is not"),
        ({"tokens_per_step": 1}, "tokens_per_step 1 is not batch_size x seq_len x grad_accum x world size = 8192"),
        (
            {"tokens_per_s": None, "tokens_per_s_per_gpu": 20 * 10_000.0},
            "tokens_per_s_per_gpu 200000.0 x world size 2 is",
        ),
        (
            {"window_step_time_s": 0.02},
            "tokens_per_s 20000 is not tokens_per_step / window_step_time_s = 8192 / 0.02",
        ),
    ],
)
def test_a_record_whose_tokens_per_s_disagrees_with_its_step_time_and_tokens_per_step_is_corrupt(
    tmp_path, edit, problem
):
    sweep = gpu_sweep(tmp_path)
    path = sweep / "cells" / cell_id(SLOW) / "result.json"
    write_record(path, {**record_of(sweep, SLOW), **edit})
    state = record_state(path, sweep, cell_id(SLOW))
    assert state.status == "corrupt" and problem in state.problem, state.problem
    assert cell_id(SLOW) not in set(load_records(sweep).frame["cell_id"])


def test_the_figures_and_ids_of_every_record_the_project_writes_agree_within_rounding(tmp_path):
    """A real CPU cell on 2 processes (figures per process and per job), timed each step and by its
    window, and test_collect's records (as run.py shapes them) all prove themselves."""
    for sync in (False, True):
        record = run_torchrun_cell(tmp_path / str(sync), 2, steps=4, warmup_steps=1, sync_each_step=sync)
        assert record["status"] == "ok" and record["world_size"] == 2
        assert figures_problem(record) == "" and cell_id_of(record["spec"]) == record["cell_id"]
    sweep = gpu_sweep(tmp_path / "fixture")
    for path in sweep.glob("cells/*/result.json"):
        state = record_state(path, sweep, path.parent.name)
        assert state.status != "corrupt" or path.parent.name in ("corrupt-cell", "future-cell"), state.problem


def test_a_searched_cells_record_proves_its_id_from_the_batch_its_search_started_at(tmp_path):
    """A `batch_size: auto` record holds the batch it found and the grad_accum derived from it, not
    those its id was made from: the id's own grad_accum and the search's first batch prove it."""
    planned = spec_of(GPU_BASE, batch_size="auto", auto_batch=True, global_batch_size=64, max_batch_size=16)
    found = planned.with_batch_size(8)
    record = {"status": "ok", "spec": found.to_dict(), "batch_search": {"first_batch": 1, "predicted_batch": None}}
    assert (found.grad_accum, cell_id_of(found.to_dict())) != (planned.grad_accum, cell_id(planned))
    assert identity_problem(record, cell_id(planned), dict) == ""
    other = spec_of(GPU_BASE, batch_size="auto", auto_batch=True, global_batch_size=64, max_batch_size=8)
    assert "its spec makes the cell id" in identity_problem(record, cell_id(other), dict)
    # Moved by a prediction, the first batch is not the spec's: the cell's spec.json says which it was.
    started = spec_of(GPU_BASE, batch_size=2, auto_batch=True, global_batch_size=64, max_batch_size=16)
    predicted = {**record, "batch_search": {"first_batch": 4, "predicted_batch": 4}}
    assert identity_problem(predicted, cell_id(started), lambda: started.to_dict()) == ""
    assert "its spec makes the cell id" in identity_problem(predicted, cell_id(started), dict)


def test_a_cell_no_plan_made_is_listed_apart_and_never_ranked_tabled_or_put_in_the_history(tmp_path, capsys):
    """issue 51, item 6: a folder added to cells/ holding a record whose id is its folder's and whose
    figures agree (tokens/s x20, its step time /20) won "Fastest" and entered the history."""
    sweep = gpu_sweep(tmp_path)
    added = spec_of(GPU_BASE, strategy="fsdp2_zero2", batch_size=4, seed=7)
    forged = ok_record(added, 20 * 14_000.0, 70)
    write_record(sweep / "cells" / cell_id(added) / "result.json", forged)
    assert record_state(sweep / "cells" / cell_id(added) / "result.json", sweep, cell_id(added)).status == "ok"
    history = tmp_path / "history.duckdb"
    assert main(["collect", str(sweep), "--history", str(history), "--json"]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert [line for line in document["unplanned"] if cell_id(added) in line and "in no plan of this folder" in line]
    assert f"warning: not ranked: {sweep / 'cells' / cell_id(added) / 'result.json'}" in captured.err
    assert cell_id(added) not in json.dumps(document["recommendation"]) and cell_id(FASTEST) in json.dumps(
        document["recommendation"]
    )
    assert cell_id(added) not in {cell["cell_id"] for cell in document["cells"]}
    assert cell_id(added) not in pd.read_csv(sweep / "report" / "results.csv")["cell_id"].tolist()
    summary = (sweep / "report" / "summary.md").read_text()
    apart = summary.split("## Cells no plan made (not ranked)\n", 1)[1].split("\n## ", 1)[0]
    assert cell_id(added) in apart and cell_id(added) not in summary.replace(apart, "")
    import duckdb

    with duckdb.connect(str(history), read_only=True) as db:
        (count,) = db.execute("select count(*) from runs where cell_id = ?", [cell_id(added)]).fetchone()
    assert count == 0
    # A folder without a manifest (records of `hpcfsdp run` by hand) has no plan: its records rank.
    shutil.rmtree(sweep / "report")
    (sweep / "manifest.json").unlink()
    assert cell_id(added) in set(load_records(sweep).frame["cell_id"]) and not load_records(sweep).unplanned
