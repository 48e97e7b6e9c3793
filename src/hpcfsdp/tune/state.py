"""The search's state, in the sweep folder, so that `tune` can be stopped and run again:

    tune/state.json                the stages: which runs each holds (run id -> the grid's cell id),
                                   the Slurm jobs that ran them, what was pruned before anything ran
    tune/stage<k>/cells/<run>/     a probe rung's runs (spec.json, result.json, log.txt), as a sweep folder
    tune/launches/<stage>-<run>.json   one launch: launcher start and end, its GPUs, exit status
    cells/<grid id>/               the final stage: fresh cells with the grid's ids and specs
    tune/repeat/cells/<grid id>/   the final stage's cells within noise of its fastest, run once more
    tune.json                      the outcome (output.py)

A run is done when its launch is recorded and its record is one that stands (ok, oom, or a
failure other than an interrupt): resuming never repeats it. Spend is counted from the launches.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..contracts.files import RecordError, read_json_object, write_json
from ..contracts.fs.beneath import matching
from ..contracts.jsontypes import MOMENT_SLACK_S, shown
from ..contracts.names import is_job_id
from ..contracts.record import RECORD_NAME, read_record
from ..sweep.define.matrix import is_cell_id
from ..sweep.folder.layout import cell_dir

STATE_VERSION = 1
TUNE_DIR = "tune"
STATE_NAME = "state.json"
LAUNCHES_DIR = "launches"
FINAL = "final"
REPEAT = "repeat"  # after the final stage: its cells within noise of its fastest, run again as the grid's cells
# Statuses that say the run was stopped from outside before it measured anything: run it again.
INTERRUPTED = ("cancelled", "preempted", "node_fail", "boot_fail")


@dataclass
class Stage:
    """One stage: a probe rung (probes stop once tokens/s is stable, within a step budget that
    grows by eta each rung) or the final stage (the grid's own cells)."""

    name: str  # stage0, stage1, ..., final, or repeat
    runs: dict[str, str]  # run id -> the grid's cell id
    jobs: dict[str, list[str]] = field(default_factory=dict)  # Slurm job id -> its run ids

    @property
    def final(self) -> bool:
        return self.name == FINAL

    @property
    def as_grid(self) -> bool:
        """Whether its runs are the grid's own cells (final, repeat), not probes."""
        return self.name in (FINAL, REPEAT)


@dataclass
class TuneState:
    sweep: str
    grid: list[str]  # every cell id of the grid, in the YAML's order
    pruned: dict[str, str] = field(default_factory=dict)  # grid cell id -> why it was left out
    computed: dict[str, str] = field(default_factory=dict)  # grid cell id -> the cell it is computed from
    stages: list[Stage] = field(default_factory=list)
    version: int = STATE_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TuneState:
        """The state as state_problem has checked it."""
        stages = [Stage(stage["name"], dict(stage["runs"]), dict(stage.get("jobs", {}))) for stage in data["stages"]]
        return cls(data["sweep"], list(data["grid"]), dict(data["pruned"]), dict(data["computed"]), stages)


def state_problem(data: dict) -> str:
    """What makes a state.json one this search did not write ("" for none), checked as records are
    before anything is read from it: its keys and their types, every grid id a cell of its grid,
    every stage named as the search begins them (stage<k> in order, then final, then repeat:
    _expected_names), every run id a cell id (a probe's folder name; the final and repeat stages'
    runs are the grid's cells) and every job id Slurm's. A run id of another shape could name a
    folder out of the sweep folder, which resuming would train."""
    if data.get("version", STATE_VERSION) != STATE_VERSION:
        return f"version: expected {STATE_VERSION}, got {shown(data.get('version'))}"
    if not isinstance(data.get("sweep"), str):
        return f"sweep: expected text, got {shown(data.get('sweep'))}"
    grid = data.get("grid")
    if not isinstance(grid, list) or not all(is_cell_id(item) for item in grid):
        return f"grid: expected a list of cell ids, got {shown(grid)}"
    for key in ("pruned", "computed"):
        value = data.get(key, {})
        data.setdefault(key, value)
        if not isinstance(value, dict) or not all(isinstance(why, str) for why in value.values()):
            return f"{key}: expected an object of grid cell id -> text, got {shown(value)}"
        if problem := _not_in_grid(key, [*value, *(value.values() if key == "computed" else ())], grid):
            return problem
    stages = data.setdefault("stages", [])
    if not isinstance(stages, list):
        return f"stages: expected a list, got {shown(stages)}"
    names = [stage.get("name") if isinstance(stage, dict) else None for stage in stages]
    for index, stage in enumerate(stages):
        if problem := _stage_problem(f"stages[{index}]", stage, index, _expected_names(names, index), grid):
            return problem
    return ""


def _expected_names(names: list, index: int) -> tuple[str, ...]:
    """The names stages[index] may have, as the search begins its stages: stage0, stage1, ... in
    order, then final, then (after final only, and last) repeat. The final stage is last, or
    followed by the repeat stage alone; a search whose grid ran itself begins with final."""
    last = index == len(names) - 1
    before = names[index - 1] if index else None
    expected = [f"stage{index}"] if before in (None, f"stage{index - 1}") else []
    if last or (index == len(names) - 2 and names[-1] == REPEAT):
        expected.append(FINAL)
    if last and before == FINAL:
        expected.append(REPEAT)
    return tuple(expected)


def _stage_problem(where: str, stage: object, index: int, expected: tuple[str, ...], grid: list[str]) -> str:
    if not isinstance(stage, dict):
        return f"{where}: expected an object (name, runs, jobs), got {shown(stage)}"
    name, runs, jobs = stage.get("name"), stage.get("runs"), stage.setdefault("jobs", {})
    if name not in expected:
        return f"{where}.name: expected {' or '.join(expected) or 'no stage here'}, got {shown(name)}"
    if not isinstance(runs, dict) or not all(is_cell_id(run) and isinstance(g, str) for run, g in runs.items()):
        return f"{where}.runs: expected an object of run id (a cell id) -> grid cell id, got {shown(runs)}"
    if problem := _not_in_grid(f"{where}.runs", list(runs.values()), grid):
        return problem
    if name in (FINAL, REPEAT) and any(run != grid_id for run, grid_id in runs.items()):
        return f"{where}.runs: the {name} stage's runs are the grid's own cells, got {shown(runs)}"
    if not isinstance(jobs, dict) or not all(
        is_job_id(job) and isinstance(ids, list) and all(run in runs for run in ids) for job, ids in jobs.items()
    ):
        return f"{where}.jobs: expected an object of Slurm job id -> the stage's run ids, got {shown(jobs)}"
    return ""


def _not_in_grid(where: str, ids: list, grid: list[str]) -> str:
    stray = next((cell for cell in ids if cell not in grid), None)
    return f"{where}: {shown(stray)} is no cell of the grid" if stray is not None else ""


def tune_dir(sweep_dir: Path) -> Path:
    return Path(sweep_dir) / TUNE_DIR


def stage_dir(sweep_dir: Path, stage: str) -> Path:
    """Where a stage's runs live: a probe rung's own folder, the final stage the sweep's."""
    return Path(sweep_dir) if stage == FINAL else tune_dir(sweep_dir) / stage


def load_state(sweep_dir: Path) -> TuneState | None:
    """The state of an earlier `tune` of this folder; None before the first."""
    path = tune_dir(sweep_dir) / STATE_NAME
    try:
        data = read_json_object(path, root=sweep_dir, kind="tune state")
    except FileNotFoundError:
        return None
    except RecordError as exc:  # unreadable (not JSON, a lone surrogate, too big): the same way out
        raise RecordError(f"{exc}; remove tune/ to start again") from None
    if problem := state_problem(data):
        raise RecordError(f"{path}: not a state this search wrote ({problem}); remove tune/ to start again")
    return TuneState.from_dict(data)


def save_state(sweep_dir: Path, state: TuneState) -> None:
    write_json(tune_dir(sweep_dir) / STATE_NAME, state.to_dict())


@dataclass(frozen=True)
class Launch:
    """One launch of one run: from the launcher's start to its end (start-up, compile and warm-up
    included, which a record's duration_s leaves out), times the GPUs it held."""

    run: str
    stage: str
    started: float
    ended: float
    gpus: int
    returncode: int | None  # None: ended at its time limit
    executor: str
    job_id: str = ""

    @property
    def gpu_hours(self) -> float:
        return (self.ended - self.started) * self.gpus / 3600


def launch_path(sweep_dir: Path, stage: str, run: str) -> Path:
    return tune_dir(sweep_dir) / LAUNCHES_DIR / f"{stage}-{run}.json"


def write_launch(launches_dir: Path, launch: Launch) -> None:
    """Each launch its own file: probe jobs running side by side never write the same one."""
    write_json(Path(launches_dir) / f"{launch.stage}-{launch.run}.json", asdict(launch))


def read_launches(sweep_dir: Path) -> list[Launch]:
    """The launches recorded in the sweep folder; a file cut short, or whose values are not a
    launch's (types, times from 0 to a day after now, 1 GPU or more), is left out of the spend."""
    out = []
    for path in matching(tune_dir(sweep_dir) / LAUNCHES_DIR, "*.json"):
        try:
            launch = Launch(**read_json_object(path, root=sweep_dir, kind="tune launch"))
        except (RecordError, FileNotFoundError, TypeError):
            continue  # a launch file cut short: its run is not done, and runs again
        if _is_launch(launch):
            out.append(launch)
    return out


def _is_launch(launch: Launch) -> bool:
    texts = (launch.run, launch.stage, launch.executor, launch.job_id)
    times = (launch.started, launch.ended)
    return (
        all(isinstance(text, str) for text in texts)
        and all(type(moment) in (int, float) for moment in times)
        and 0 <= launch.started <= launch.ended <= time.time() + MOMENT_SLACK_S
        and type(launch.gpus) is int
        and 1 <= launch.gpus <= MAX_GPUS
        and (launch.returncode is None or type(launch.returncode) is int)
    )


MAX_GPUS = 1 << 20  # more than any allocation holds


def run_status(directory: Path) -> str:
    """The status of a run's record: 'missing' without a readable one."""
    try:
        return read_record(Path(directory) / RECORD_NAME)["status"]
    except (RecordError, FileNotFoundError):
        return "missing"


def run_record(sweep_dir: Path, stage: str, run: str) -> dict | None:
    """A run's record; None where it has none that can be read."""
    if not run:
        return None
    try:
        return dict(read_record(cell_dir(stage_dir(sweep_dir, stage), run) / RECORD_NAME))
    except (RecordError, FileNotFoundError):
        return None


def is_done(sweep_dir: Path, stage: str, run: str) -> bool:
    """Launched to its end by this search, with a record that stands."""
    status = run_status(cell_dir(stage_dir(sweep_dir, stage), run))
    return launch_path(sweep_dir, stage, run).is_file() and status not in ("missing", *INTERRUPTED)
