"""hpcfsdp for scripts and schedulers (issue 34, items 9 to 12): `--version`, `--json` answers read
back by a typed reader (pydantic, strict, no unknown keys) from one strict JSON document, the exit
statuses of docs/submit.md's table, usage errors, the words of a CPU sweep, collect's progress and
the examples the package carries."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

from conftest import ROOT, slurm
from hpcfsdp.cli import main
from hpcfsdp.contracts.record import STATUSES, CellState, write_record
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.folder.layout import write_cell_spec
from hpcfsdp.sweep.track.status import cells_exit_status
from test_collect import CPU_BASE, GPU_BASE, failed_record, ok_record, put, spec_of

Number = float | None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- the typed readers: what each --json answer promises (docs/submit.md, "--json") ---------------


class StatusCell(Strict):
    cell_id: str
    strategy: str
    status: Literal[tuple(state.value for state in CellState)]  # type: ignore[valid-type]
    job_id: str
    slurm: str
    reason: str
    advice: str
    blocked: bool
    preempted: int
    resources: str  # "" when the cell ran on what it asked for, else its resource_problems as one line
    progress: str


class StatusAnswer(Strict):
    sweep_dir: str
    cluster: str
    exit_status: Literal[0, 3, 4]
    counts: dict[str, int]
    cells: list[StatusCell]
    warnings: list[str]
    collect_job: str


class PlanArray(Strict):
    array: int
    nodes: int
    ranks_per_node: int
    rank: Literal["GPU", "process"]
    cells: int


class PlanMemory(Strict):
    batch_size: int
    states_gib: Number
    gathered_gib: Number
    activations_gib: Number
    loss_gib: Number
    peak_gib: Number
    peak_at: str | None
    host_gib_per_node: Number
    fit: Literal["fits", "tight", "oom"] | None
    note: str


class PlanCell(Strict):
    cell_id: str
    array: int
    spec: dict
    memory: PlanMemory | None = None


class PlanAnswer(Strict):
    sweep: str
    cluster: str
    exit_status: Literal[0, 2]
    cells: list[PlanCell]
    arrays: list[PlanArray]
    upper_bound_hours: float
    hours_of: Literal["GPU", "process"]
    time_min: int
    max_requeue: int
    problems: list[str]
    sbatch_from_shell: dict[str, str]
    not_to_the_jobs: list[str]
    cluster_checks_skipped: str


class CollectCell(Strict):
    cell_id: str
    status: str
    job_id: str | None
    reason: str | None
    strategy: str | None
    fields: dict
    tokens_per_s_per_gpu: Number
    step_time_s: Number
    mfu: Number
    peak_memory_gib: Number
    final_loss: Number
    tokens_per_s_spread: dict[str, float] | None
    invalid_reasons: list[str]


class CollectAnswer(Strict):
    sweep_dir: str
    exit_status: Literal[0, 1]
    cells: list[CollectCell]
    recommendation: list[str]
    untrusted: list[str]
    regressions: list[str]
    notes: list[str]
    unreadable: list[str]
    unplanned: list[str]
    history_unchecked: str | None
    files: list[str]


class HistoryRun(Strict):
    started_at: str
    sweep: str
    cluster: str | None
    gpu: str | None
    model: str
    strategy: str
    batch_size: int
    grad_accum: int
    world_size: int
    status: str
    tokens_per_s_per_gpu: Number
    mfu: Number
    peak_memory_gib: Number
    torch_version: str | None
    setup: str
    cell_id: str
    job_id: str | None
    git_commit: str | None
    sweep_dir: str
    reason: str | None


class HistoryAnswer(Strict):
    history: str
    exit_status: Literal[0]
    runs: list[HistoryRun]
    count: int
    setups: int


def strict_document(text: str) -> dict:
    """stdout as one JSON document, read as RFC 8259 has it: NaN and Infinity are refused."""

    def refuse(word: str) -> None:
        raise ValueError(f"not JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def answer(capsys, argv: list[str]) -> tuple[int, dict, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, strict_document(captured.out), captured.err


# -- --version, usage ---------------------------------------------------------------------------


def test_version_prints_the_package_version_and_exits_0():
    from hpcfsdp import __version__

    proc = subprocess.run([sys.executable, "-m", "hpcfsdp", "--version"], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"hpcfsdp {__version__}")


def test_an_unknown_export_target_and_a_status_no_record_has_are_usage_errors(tmp_path, capsys):
    sweep = tmp_path / "s"
    put(sweep, ok_record(spec_of(GPU_BASE, strategy="ddp"), 10000, 40))
    assert main(["export", str(sweep), "--to", "csv", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == ("error: export: --to: csv: expected one of tensorboard, mlflow, wandb")
    with pytest.raises(SystemExit) as stopped:
        main(["history", "--status", "bogus"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "argument --status: invalid choice: 'bogus'" in err and all(status in err for status in STATUSES)


class ErrorAnswer(BaseModel):
    """What every --json command prints on stdout when it fails, usage errors included."""

    model_config = ConfigDict(extra="forbid", strict=True)
    error: str
    exit_status: int


@pytest.mark.parametrize(
    "command, exit_status, said",
    [
        (["plan", "--json"], 2, "hpcfsdp plan: the following arguments are required: jobs"),
        (["plan", "nosuch.yaml", "--json"], 2, "nosuch.yaml: no such jobs file"),
        (["plan", "jobs/smoke.yaml", "--json", "--sbatch"], 2, "plan: --json and --sbatch: give one"),
        (["status", "{missing}", "--json", "--bogus"], 2, "hpcfsdp: unrecognized arguments: --bogus"),
        (["history", "--json", "--status", "bogus"], 2, "hpcfsdp history: argument --status: invalid choice"),
        (["collect", "{missing}", "--json"], 2, "missing: no such sweep folder"),
    ],
)
def test_a_json_command_that_fails_answers_one_json_document_on_stdout_usage_errors_included(
    command, exit_status, said, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(ROOT)
    argv = [word.format(missing=tmp_path / "missing") for word in command]
    assert main(argv) == exit_status
    captured = capsys.readouterr()
    document = strict_document(captured.out)
    if "problems" in document:  # a jobs file plan refuses: plan's own document, the refusal its one problem
        plan = PlanAnswer.model_validate(document)
        assert plan.exit_status == exit_status and said in plan.problems[0] and not plan.cells, plan
        assert captured.err.strip() == f"error: {plan.problems[0]}"
        return
    answer = ErrorAnswer.model_validate(document)
    assert answer.exit_status == exit_status and said in answer.error, answer
    assert captured.err.strip() == f"error: {answer.error}"  # and the one line on stderr, as without --json


def test_download_of_a_jobs_yaml_that_needs_nothing_from_the_hub_says_so(tmp_path, capsys):
    assert main(["download", str(ROOT / "jobs/smoke.yaml"), "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"nothing to download: the cells of {ROOT / 'jobs/smoke.yaml'} use preset models")
    assert "give a jobs YAML" not in out


# -- exit statuses ------------------------------------------------------------------------------


def test_every_state_but_ok_pending_and_running_exits_3_and_in_flight_alone_exits_4():
    """Derived from the states, not a list: a status added to CellState (the lead's `hang`) is 3."""
    in_flight = {CellState.PENDING, CellState.RUNNING}
    assert cells_exit_status([]) == 0 and cells_exit_status(["ok", "ok"]) == 0
    for state in in_flight:
        assert cells_exit_status(["ok", state]) == 4
    for state in set(CellState) - in_flight - {CellState.OK}:
        assert cells_exit_status(["ok", state]) == 3, state
        assert cells_exit_status([CellState.RUNNING, state]) == 3, state  # a failure outranks the wait
    assert cells_exit_status(["ok", "hang"]) == 3  # a status this code has never heard of


@pytest.mark.slurm
def test_status_json_and_exit_status_follow_the_cells_from_pending_to_failed(slurm_cluster, tmp_path, capsys):
    jobs = tmp_path / "three.yaml"
    jobs.write_text("name: three\nbase: {model: tiny, device: cpu}\nmatrix: {batch_size: [1, 2, 3]}\n")
    first, second, third = load_sweep(jobs).cells
    sweep_dir = tmp_path / "results" / "three"
    held = slurm(
        "sbatch", "--parsable", "--hold", "--time=5", "--job-name=hpcfsdp-test-scripting",
        f"--output={tmp_path}/held.out", "--wrap", "sleep 300",
    ).strip().split(";")[0]  # fmt: skip
    try:
        for cell in (first, second, third):
            spec = {"cell_id": cell.id, "sweep": "three", "spec": cell.spec.to_dict()}
            (sweep_dir / "cells" / cell.id).mkdir(parents=True)
            (sweep_dir / "cells" / cell.id / "spec.json").write_text(json.dumps(spec))
        (sweep_dir / "manifest.json").write_text(
            json.dumps({second.id: {"executor": "slurm", "job_id": held, "submitted_at": 0}})
        )
        write_record(sweep_dir / "cells" / first.id / "result.json", {"status": "ok", "spec": first.spec.to_dict()})
        write_record(sweep_dir / "cells" / third.id / "result.json", {"status": "ok", "spec": third.spec.to_dict()})

        code, document, _ = answer(capsys, ["status", str(sweep_dir), "--json"])
        status = StatusAnswer.model_validate(document)
        assert code == status.exit_status == 4 and status.counts == {"ok": 2, "pending": 1}
        pending = {c.cell_id: c for c in status.cells}[second.id]
        assert (pending.status, pending.job_id, pending.slurm) == ("pending", held, "PENDING")
        assert pending.reason in ("JobHeldUser", "JobHeldAdmin"), pending.reason
        assert main(["status", str(sweep_dir)]) == 4  # the table too
        assert capsys.readouterr().out.startswith(f"{sweep_dir}: 3 cell(s): ok 2, pending 1")

        failed = {"status": "oom", "stage": "train", "error": "CUDA out of memory\nmore", "spec": third.spec.to_dict()}
        write_record(sweep_dir / "cells" / third.id / "result.json", failed)
        code, document, _ = answer(capsys, ["status", str(sweep_dir), "--json"])
        status = StatusAnswer.model_validate(document)
        assert code == status.exit_status == 3  # a failure outranks the cell still waiting
        assert {c.cell_id: c.reason for c in status.cells}[third.id] == "CUDA out of memory"
    finally:
        subprocess.run(["scancel", held], capture_output=True, timeout=60)


# -- plan, collect, history ----------------------------------------------------------------------


def test_plan_json_is_every_cell_with_its_array_and_memory_in_words_of_a_cpu_sweep(capsys):
    code, document, _ = answer(capsys, ["plan", str(ROOT / "jobs/smoke.yaml"), "--json", "--memory"])
    plan = PlanAnswer.model_validate(document)
    assert code == plan.exit_status == 0 and len(plan.cells) == 8 and plan.hours_of == "process"
    assert plan.arrays == [PlanArray(array=0, nodes=1, ranks_per_node=2, rank="process", cells=8)]
    assert all(cell.memory is not None and cell.memory.fit is None for cell in plan.cells)  # on CPU: no fit
    assert all(cell.spec["device"] == "cpu" for cell in plan.cells)
    # The printed plan speaks of processes too.
    assert main(["plan", str(ROOT / "jobs/smoke.yaml")]) == 0
    out = capsys.readouterr().out
    assert "array 0: 8 cell(s) on 1 node(s) x 2 process(es)" in out and "process-hours" in out
    assert "GPU" not in out and "gpus" not in out


def cpu_and_failed_sweep(root: Path) -> tuple[Path, dict[str, str]]:
    """Two ok CPU cells (one at lr 1e30), an error and a diverged cell with a NaN loss."""
    sweep = root / "cpu"
    fast, slow, broken, nan = (
        spec_of(CPU_BASE, strategy="ddp"),
        spec_of(CPU_BASE, strategy="fsdp2_zero3", lr=1e30),
        spec_of(CPU_BASE, strategy="fsdp2_zero2"),
        spec_of(CPU_BASE, strategy="fsdp2_zero2", batch_size=2),
    )
    ids = {
        "fast": put(sweep, ok_record(fast, 900, 1.5, device="cpu")),
        "slow": put(sweep, ok_record(slow, 700, 1.2, device="cpu")),
        "error": put(sweep, failed_record(broken, "error", "model", "RuntimeError: boom\ntrace", device="cpu")),
    }
    diverged = {**failed_record(nan, "diverged", "train", "loss is nan at step 2", device="cpu"), "losses": [9.0]}
    ids["diverged"] = put(sweep, {**diverged, "final_loss": math.nan})
    return sweep, ids


def test_collect_json_gives_each_cell_its_status_job_reason_and_figures_and_the_table_goes_to_stderr(tmp_path, capsys):
    sweep, ids = cpu_and_failed_sweep(tmp_path)
    code, document, err = answer(capsys, ["collect", str(sweep), "--json", "--no-history", "--no-plots"])
    collected = CollectAnswer.model_validate(document)
    assert code == collected.exit_status == 0
    cells = {c.cell_id: c for c in collected.cells}
    assert [c.cell_id for c in collected.cells[:2]] == [ids["fast"], ids["slow"]]  # the table's order
    assert cells[ids["fast"]].tokens_per_s_per_gpu == 900 and cells[ids["fast"]].job_id == "4242_1"
    assert cells[ids["error"]].status == "error" and cells[ids["error"]].reason == "RuntimeError: boom"
    assert cells[ids["diverged"]].final_loss is None  # NaN in, null out
    assert cells[ids["slow"]].fields["lr"] == 1e30
    assert "| strategy" in err and "tokens/s/process" in err  # what collect prints, beside the document


def test_collect_json_lists_a_cell_whose_record_is_corrupt_marked_corrupt_with_the_file(tmp_path, capsys):
    sweep, ids = cpu_and_failed_sweep(tmp_path)
    broken = sweep / "cells" / "torn-cell" / "result.json"
    broken.parent.mkdir()
    broken.write_text('{"status": "ok", "spec": ')  # a write cut short
    code, document, _ = answer(capsys, ["collect", str(sweep), "--json", "--no-history", "--no-plots"])
    collected = CollectAnswer.model_validate(document)
    cells = {c.cell_id: c for c in collected.cells}
    assert code == collected.exit_status
    assert set(cells) == {*ids.values(), "torn-cell"} and cells["torn-cell"].status == "corrupt"
    assert str(broken) in (cells["torn-cell"].reason or "") and cells["torn-cell"].tokens_per_s_per_gpu is None


def test_collect_of_a_cpu_sweep_speaks_of_processes_and_an_lr_of_1e30_stays_short(tmp_path, capsys):
    sweep, _ = cpu_and_failed_sweep(tmp_path)
    assert main(["collect", str(sweep), "--no-history", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s/process" in out and "process(es) x" in out and "process-hours per billion" in out
    assert "GPU" not in out and "tokens/s/gpu" not in out
    assert "1e+30" in out and "1000000000000000019884624838656" not in out
    summary = (sweep / "report" / "summary.md").read_text()
    assert "tokens/s per process" in summary and "per GPU" not in summary and "GPU-hours" not in summary


def test_history_json_lists_the_runs_with_their_job_and_reason(tmp_path, capsys):
    sweep, ids = cpu_and_failed_sweep(tmp_path)
    history = tmp_path / "history.duckdb"
    assert main(["collect", str(sweep), "--history", str(history), "--no-plots"]) == 0
    capsys.readouterr()
    code, document, _ = answer(capsys, ["history", "--history", str(history), "--json"])
    listed = HistoryAnswer.model_validate(document)
    assert code == 0 and listed.count == len(listed.runs) == 4
    runs = {run.cell_id: run for run in listed.runs}
    assert runs[ids["error"]].reason == "RuntimeError: boom" and runs[ids["error"]].job_id == "4242_1"
    assert runs[ids["fast"]].git_commit == "0123abcd" and runs[ids["fast"]].sweep_dir == str(sweep.resolve())
    for run in listed.runs:  # a time that says its zone: what a reader elsewhere takes for UTC, not its own
        started = datetime.fromisoformat(run.started_at)
        assert run.started_at.endswith("+00:00") and started.utcoffset() == timedelta(0)
    code, document, _ = answer(capsys, ["history", "--history", str(history), "--json", "--status", "diverged"])
    assert [run["cell_id"] for run in document["runs"]] == [ids["diverged"]]


# -- progress -----------------------------------------------------------------------------------


def test_a_long_collect_says_how_far_it_is_in_plain_lines_when_stderr_is_a_file(tmp_path):
    """Silent below 500 records and a second: here 400 records, with neither bound."""
    sweep = tmp_path / "many"
    for batch in range(1, 401):
        put(sweep, ok_record(spec_of(CPU_BASE, strategy="ddp", batch_size=batch), 900 + batch, 1.0, device="cpu"))
    script = (
        "import sys; from hpcfsdp import progress; progress.QUIET_S = 0.0; progress.LINE_EVERY_S = 0.0; "
        "from hpcfsdp.results import collect; collect.PROGRESS_MIN_RECORDS = 1; "
        "from hpcfsdp.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    with open(tmp_path / "err.log", "w") as err:
        proc = subprocess.run(
            [sys.executable, "-c", script, "collect", str(sweep), "--no-history", "--no-plots"],
            stdout=subprocess.PIPE, stderr=err, text=True, timeout=300,
        )  # fmt: skip
    assert proc.returncode == 0
    lines = (tmp_path / "err.log").read_text().splitlines()
    assert "\r" not in "".join(lines) and "\033" not in "".join(lines)  # no bar in a log
    counts = [line for line in lines if line.startswith("reading records: ")]
    assert counts[0] == "reading records: 1/400" and counts[-1] == "reading records: 400/400"
    assert "writing the report ..." in lines and lines[-1].startswith("collect: done in ")
    assert "reading records" not in proc.stdout  # stdout holds what it held


def test_on_a_terminal_collect_draws_one_bar_redrawn_in_place(tmp_path):
    """stderr a pseudo-terminal: the bar is redrawn with a carriage return, its line ended once."""
    import os
    import pty

    sweep = tmp_path / "many"
    for batch in range(1, 201):
        put(sweep, ok_record(spec_of(CPU_BASE, strategy="ddp", batch_size=batch), 900 + batch, 1.0, device="cpu"))
    script = (
        "import sys; from hpcfsdp import progress; progress.QUIET_S = 0.0; progress.REDRAW_S = 0.0; "
        "from hpcfsdp.results import collect; collect.PROGRESS_MIN_RECORDS = 1; "
        "from hpcfsdp.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "collect", str(sweep), "--no-history", "--no-plots"],
        stdout=subprocess.DEVNULL, stderr=follower,
    )  # fmt: skip
    os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal's other end closed: the command ended
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    assert proc.wait(timeout=300) == 0
    text = drawn.decode()
    assert "\r\x1b[Kreading records [" in text and "] 200/200" in text
    assert "reading records: " not in text  # no log lines on a terminal
    assert text.splitlines()[-1].startswith("collect: done in ")


# -- the examples the package carries --------------------------------------------------------------


def test_examples_lists_each_example_by_its_whole_first_sentence_and_none_compares_with_a_ddp_it_lacks(capsys):
    assert main(["examples"]) == 0
    listed = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines()[:-1])
    assert all(text.endswith(".") for text in listed.values()), listed  # a sentence, never cut inside one
    assert listed["multinode"].startswith("Multi-node: FSDP2 ZeRO-3 vs hybrid sharding (FSDP2 HSDP and FSDP1")
    for path in sorted((ROOT / "jobs").glob("*.yaml")):
        header = "".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        strategies = {cell.spec.strategy for cell in load_sweep(path).cells}
        assert "ddp" in strategies or not ("vs DDP" in header or "DDP vs" in header), path.name


def test_the_seeds_example_jobs_ask_the_optimizer_order_and_the_smollm3_mfu_questions():
    """Seed 003 (the optimizer built before or after FSDP2 sharding, and the fix) and seed 004
    (SmolLM3-3B at seq 8192, ZeRO-2 vs ZeRO-3 vs HSDP, scaling 4 -> 16 GPUs, MFU on H100s)."""
    order = load_sweep(ROOT / "jobs/optimizer_order.yaml").cells
    assert {c.spec.optimizer_order for c in order} == {"after_shard", "before_shard", "before_shard_fixed"}
    assert all(c.spec.data == "tinystories" and c.spec.gpus_per_node == 8 for c in order)  # losses show convergence
    sweep = load_sweep(ROOT / "jobs/smollm3_mfu.yaml")
    assert {c.spec.strategy for c in sweep.cells} == {"fsdp2_zero2", "fsdp2_zero3", "fsdp2_hsdp"}
    # As the blog ran it (issue 54, item 3): the preset, whose config needs no download; batch 1 at
    # seq 8192, no checkpointing or compile, 5 warm-up steps; 4, 8 and 16 GPUs for the Scaling table.
    assert {(c.spec.model, c.spec.seq_len, c.spec.gpus_per_node) for c in sweep.cells} == {("smollm3-3b", 8192, 4)}
    assert {(c.spec.batch_size, c.spec.compile, c.spec.activation_checkpointing) for c in sweep.cells} == {
        (1, False, "none")
    }
    assert {c.spec.warmup_steps for c in sweep.cells} == {5}
    assert {(c.spec.strategy, c.spec.nodes) for c in sweep.cells} == {
        *((strategy, nodes) for strategy in ("fsdp2_zero2", "fsdp2_zero3") for nodes in (1, 2, 4)),
        ("fsdp2_hsdp", 2),
    }
    assert sweep.resources.gpu_name == "h100"  # MFU against the H100's bf16 peak


def test_examples_lists_prints_and_copies_and_plan_takes_an_examples_name(tmp_path, capsys, monkeypatch):
    assert main(["examples"]) == 0
    listed = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in listed[:-1]]
    assert names == [*sorted(p.stem for p in (ROOT / "jobs").glob("*.yaml")), "fsdp_job.sbatch"]
    assert main(["examples", "smoke"]) == 0
    assert capsys.readouterr().out == (ROOT / "jobs/smoke.yaml").read_text()
    assert main(["examples", "fsdp_job.sbatch", "--copy-to", str(tmp_path / "mine")]) == 0
    assert (tmp_path / "mine/fsdp_job.sbatch").read_text() == (ROOT / "slurm/fsdp_job.sbatch").read_text()
    assert main(["examples", "fsdp_job.sbatch", "--copy-to", str(tmp_path / "mine")]) == 2  # never over a file
    monkeypatch.chdir(tmp_path)  # no jobs/ here: the README's command plans the packaged example
    capsys.readouterr()
    assert main(["plan", "jobs/smoke.yaml"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("smoke: 8 cell(s) in 1 array(s)")
    assert "using the packaged example" in captured.err


def test_status_and_plan_memory_show_the_fields_that_tell_cells_apart_and_every_state_whole(tmp_path, capsys):
    """Cells alike but for optimizer_order or cpu_offload get those columns; `cancelled` and
    `node_fail` fit the state column, which no column runs into."""
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "name: apart\nbase: {model: tiny, device: cuda, precision: bf16_mixed, seq_len: 64, gpus_per_node: 2, "
        "strategy: fsdp2_zero3}\nmatrix:\n  optimizer_order: [after_shard, before_shard]\n"
        "include:\n  - {optimizer_order: after_shard, cpu_offload: true}\n"
    )
    assert main(["plan", str(jobs), "--memory"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()[1:5]
    assert header.split()[4:7] == ["seq", "cpu_offload", "optimizer_order"]
    assert [row.split()[5:7] for row in rows] == [
        ["false", "after_shard"], ["false", "before_shard"], ["true", "after_shard"]
    ]  # fmt: skip
    sweep = load_sweep(jobs)
    for cell, status in zip(sweep.cells, ("cancelled", "node_fail", "ok")):
        write_cell_spec(tmp_path / "apart" / "cells" / cell.id, cell.spec, cell.id, "apart", cell.sources)
        record = ok_record(cell.spec, 1000.0, 0.4, device="cpu") if status == "ok" else failed_record(
            cell.spec, status, "train", f"{status} by Slurm", device="cpu"
        )  # fmt: skip
        put(tmp_path / "apart", record)
    main(["status", str(tmp_path / "apart")])
    header, *rows = capsys.readouterr().out.splitlines()[1:4]
    assert header.split()[:6] == ["cell", "strategy", "state", "job", "cpu_offload", "optimizer_order"]
    assert sorted(row.split()[1:6] for row in rows) == [
        ["fsdp2_zero3", "cancelled", "-", "false", "after_shard"],
        ["fsdp2_zero3", "node_fail", "-", "false", "before_shard"],
    ]
    assert all(row.index("cancelled" if "cancelled" in row else "node_fail") == header.index("state") for row in rows)


def test_each_seeds_question_has_an_example_that_examples_lists_and_docs_seeds_walks(capsys):
    """Issue 54, item 5: for each of the five public documents, a jobs file in jobs/ (packaged),
    listed by `hpcfsdp examples` with the seed it answers, and walked in docs/seeds.md (linked from
    the README), whose memory table is what `plan --memory` predicts for seed 004's file."""
    from hpcfsdp.sweep.define.examples import SEED_EXAMPLES

    assert sorted(SEED_EXAMPLES) == ["000", "001", "002", "003", "004"]
    assert main(["examples"]) == 0
    listed = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines()[:-1])
    seeds = (ROOT / "docs/seeds.md").read_text()
    for seed, name in SEED_EXAMPLES.items():
        assert (ROOT / "jobs" / f"{name}.yaml").is_file() and listed[name].startswith(f"[seed {seed}] ")
        assert f"## Seed {seed}:" in seeds and f"`jobs/{name}.yaml`" in seeds
        load_sweep(ROOT / "jobs" / f"{name}.yaml")  # plans as it is
    assert "docs/seeds.md" in (ROOT / "README.md").read_text()
    assert main(["plan", str(ROOT / "jobs/smollm3_mfu.yaml"), "--memory"]) == 2  # the tokenizer and data not cached
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("fsdp2_zero")]
    one_node = {row[1]: row[6:11] for row in rows if row[5] == "1"}  # states, gathered, activ., loss, peak
    for strategy, column in (("fsdp2_zero2", "ZeRO-2"), ("fsdp2_zero3", "ZeRO-3")):
        states, gathered, activations, loss, peak = one_node[strategy]
        assert f"{peak} GiB" in seeds, (column, peak)
        for term, value in (("states", states), ("gathered", gathered), ("activations", activations), ("loss", loss)):
            row = next(line for line in seeds.splitlines() if line.startswith(f"| {term} |"))
            assert f" {value} " in row, (term, value, row)
