"""What to download: the hub items a jobs YAML's cells or the command line name (Plan, Request),
parsed and checked, and which of them the cache still lacks (`cache_misses`, for plan and submit).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from ..contracts.errors import UserError
from ..contracts.names import DatasetRef, ModelRef, TokenizedRef
from ..contracts.sources import model_source
from .hub import DOWNLOAD_COMMAND, RUN_WHERE_ONLINE, CacheMissError, lookup_dataset, lookup_model, lookup_tokenized


class DownloadError(UserError, RuntimeError):
    """Something the user can fix (a wrong name, a gated repo, a bad file); str() is one line."""


@dataclass
class Plan:
    """What to fetch: models (with or without weights), dataset splits, tokenized variants."""

    models: dict[str, tuple[ModelRef, bool]] = field(default_factory=dict)
    datasets: dict[str, DatasetRef] = field(default_factory=dict)
    tokenized: dict[str, TokenizedRef] = field(default_factory=dict)

    def add_model(self, ref: ModelRef, weights: bool = False) -> None:
        old = self.models.get(ref.key)
        self.models[ref.key] = (ref, weights or (old[1] if old else False))

    def add_dataset(self, ref: DatasetRef) -> None:
        self.datasets.setdefault(ref.key, ref)

    def add_tokenized(self, ref: TokenizedRef) -> None:
        self.add_model(ref.model)
        self.add_dataset(ref.dataset)
        self.tokenized.setdefault(ref.key, ref)

    def __bool__(self) -> bool:
        return bool(self.models or self.datasets or self.tokenized)


def plan_from_sweep(sweep: Any, plan: Plan | None = None) -> Plan:
    """The hub items a sweep's cells need, from their resolved sources (Cell.sources).

    model: a hub id (not a preset or local folder) -> config + tokenizer; with `init: pretrained`
    also the weights. data: a hub dataset ORG/NAME[:config][@split] or preset -> that split, plus
    the split tokenized at seq_len for the spec's text tokenizer (a hub id: RunSpec checks that),
    from the spec's text_column, else the dataset's own.
    """
    plan = Plan() if plan is None else plan
    for cell in sweep.cells:
        spec, sources = cell.spec, cell.sources
        if sources.model.kind == "hub":
            plan.add_model(sources.model.model_ref, weights=spec.init == "pretrained")
        if sources.data.kind == "hub" and sources.tokenizer is not None:
            plan.add_tokenized(
                TokenizedRef(
                    sources.data.dataset_ref, sources.tokenizer.model_ref, spec.seq_len, spec.text_column or None
                )
            )
    return plan


@dataclass(frozen=True)
class Request:
    """What to fetch, as the command line names it: the cells of a jobs YAML and/or explicit items
    (tokenized: every dataset x tokenize_for model x seq_len)."""

    sweep: Any = None  # a loaded sweep (sweep.define.matrix.Sweep: .cells, .source), loaded by the command
    models: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    weights: bool = False
    tokenize_for: tuple[str, ...] = ()
    seq_lens: tuple[int, ...] = ()

    @property
    def names_items(self) -> bool:
        return bool(self.sweep or self.models or self.datasets)


def build_plan(request: Request, text_column: str | None = None) -> Plan:
    """The items of a request, parsed and checked. text_column (--text-column) is the column that
    the --dataset items are tokenized from; None: each dataset's own (DatasetRef.text_column)."""
    plan = Plan()
    if text_column and not request.tokenize_for:
        raise DownloadError(
            f"--text-column {text_column} applies to the --dataset items that --tokenize-for tokenizes; "
            "a jobs YAML names its cells' column with text_column"
        )
    if request.sweep is not None:
        plan_from_sweep(request.sweep, plan)
    for text in request.models:
        plan.add_model(_parse(ModelRef, text, "--model"), weights=request.weights)
    if request.weights:  # --weights also applies to the models a jobs file names
        for key, (ref, _) in list(plan.models.items()):
            plan.models[key] = (ref, True)
    dataset_refs = [_parse(DatasetRef, text, "--dataset") for text in request.datasets]
    for ref in dataset_refs:
        plan.add_dataset(ref)
    if request.tokenize_for or request.seq_lens:
        if not (request.tokenize_for and request.seq_lens and dataset_refs):
            raise DownloadError("--tokenize-for MODEL and --seq-len N go together, with at least one --dataset")
        for n in request.seq_lens:
            if n < 1:
                raise DownloadError(f"--seq-len: expected a positive integer, got {n}")
        for text in request.tokenize_for:
            if (source := model_source(text)) is None or source.kind != "hub":
                raise DownloadError(
                    f"--tokenize-for: {text!r}: expected a hub model id ORG/NAME[@REV] "
                    "(shipped presets have no tokenizer)"
                )
            for ds in dataset_refs:
                for n in request.seq_lens:
                    plan.add_tokenized(TokenizedRef(ds, source.model_ref, n, text_column))
    return plan


def _parse(cls: Any, text: str, where: str) -> Any:
    try:
        return cls.parse(text)
    except ValueError as exc:
        raise DownloadError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class Item:
    """One thing a plan fetches, as the downloader lists it: its kind and name, and why the cache
    lacks it ("" when it is there, whole)."""

    kind: str  # model, dataset, tokenized
    name: str
    missing: str = ""


def plan_items(plan: Plan, cache_dir: str | None = None) -> list[Item]:
    """Every item of the plan (models, datasets, tokenized splits) and whether the cache holds it,
    from the cache's manifest only (nothing is fetched)."""
    checks = [
        (
            "model",
            ref.name + (" (with weights)" if weights else ""),
            functools.partial(lookup_model, ref.name, cache_dir, weights),
        )
        for ref, weights in plan.models.values()
    ]
    checks += [
        ("dataset", ref.name, functools.partial(lookup_dataset, ref.name, cache_dir)) for ref in plan.datasets.values()
    ]
    checks += [
        (
            "tokenized",
            ref.name,
            functools.partial(
                lookup_tokenized, ref.dataset.name, ref.model.name, ref.seq_len, cache_dir, ref.text_column
            ),
        )
        for ref in plan.tokenized.values()
    ]
    items = []
    for kind, name, check in checks:
        try:
            check()
        except CacheMissError as exc:
            items.append(Item(kind, name, str(exc)))
        else:
            items.append(Item(kind, name))
    return items


def cache_misses(sweep: Any, cache_dir: str | None = None) -> list[str]:
    """One line per hub item the sweep's cells read that the cache lacks (models, and datasets in
    their tokenized form): `plan` and `submit` check this before anything is queued."""
    plan = plan_from_sweep(sweep)
    plan.datasets.clear()  # the cells read a dataset in its tokenized form only
    missing = [item for item in plan_items(plan, cache_dir) if item.missing]
    if not missing:
        return []
    # Each miss at the line that names its item, without the download command of that item alone:
    # one command fetches them all (a cache whose manifest is spoiled keeps its own words).
    lines = [f"{_where(sweep, item.kind)}: {item.missing.split(RUN_WHERE_ONLINE)[0]}" for item in missing]
    if not any(RUN_WHERE_ONLINE in item.missing for item in missing):
        return lines
    cache = f" --cache-dir {cache_dir}" if cache_dir else ""
    return [*lines, f"on a machine with internet, `{DOWNLOAD_COMMAND} {sweep.source}{cache}` fetches all of them"]


def _where(sweep: Any, kind: str) -> str:
    """The jobs file and the line of the first key that names an item of this kind (a model, a
    tokenized dataset: the `data` key)."""
    key = ".model" if kind == "model" else ".data"
    line = next((line for name, line in getattr(sweep, "lines", {}).items() if name.endswith(key)), None)
    return f"{sweep.source}:{line}" if line else str(sweep.source)
