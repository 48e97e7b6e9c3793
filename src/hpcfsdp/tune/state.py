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

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..contracts.files import RecordError, read_json_object, write_json
from ..contracts.record import RECORD_NAME, read_record
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
        stages = [Stage(**stage) for stage in data.get("stages", [])]
        return cls(
            data["sweep"],
            list(data["grid"]),
            dict(data.get("pruned", {})),
            dict(data.get("computed", {})),
            stages,
            data.get("version", 1),
        )


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
    try:
        return TuneState.from_dict(data)
    except (KeyError, TypeError) as exc:
        why = f"not a tune state ({exc}); remove the tune/ folder to start the search again"
        raise RecordError(f"{path}: {why}") from None


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
    out = []
    for path in sorted((tune_dir(sweep_dir) / LAUNCHES_DIR).glob("*.json")):
        try:
            out.append(Launch(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a launch file cut short: its run is not done, and runs again
    return out


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
