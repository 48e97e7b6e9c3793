"""What a RunSpec's model, tokenizer and data values name: a shipped preset, a local folder, or a
hub item, decided once, on the login node, into typed values (Source, Sources); and the checks a
local one must pass (it exists, holds a config, weights, a tokenizer or text), so that a bad path
is one line at plan time, not a failed cell.

The user's own strings stay in the RunSpec (the cell id and history setups are made of them); the
resolved form travels beside them in the cell's spec.json, and the cell reads that: a relative
path means the folder it named where the sweep was loaded, whatever the compute node's working
directory is.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from .fields import SpecError, shown
from .names import DatasetRef, ModelRef

PRESETS_DIR = Path(__file__).parents[1] / "presets"
# The tokenizers the package ships, by name (`tokenizer: tiny`), built by env/make_tiny_tokenizer.py
SHIPPED_TOKENIZERS_DIR = PRESETS_DIR / "tokenizers"
TEXT_SUFFIXES = (".txt", ".json", ".jsonl")
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # datasets.save_to_disk
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
# config.json keys that give how many positions a model's position embedding covers
POSITION_KEYS = ("max_position_embeddings", "n_positions")
# A model / data / tokenizer value written like this names a local path, which must exist.
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")
SOURCES_KEY = "sources"  # spec.json's key for the resolved form, beside "spec"

SourceKind = Literal["synthetic", "preset", "local", "hub"]
# The hub model each shipped preset is the configuration of (its config.json's shape): `plan --memory`
# predicts a hub id that is not cached from its preset; docs/models_and_data.md lists them.
PRESET_HUB_IDS = {
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "smollm3-3b": "HuggingFaceTB/SmolLM3-3B",
    "codellama-7b": "codellama/CodeLlama-7b-hf",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
}


@dataclass(frozen=True)
class Source:
    """What one model, tokenizer or data value names, as the login node decided it.

    preset: `name` (the file is looked up in this installation's presets). local: `path`, absolute.
    hub: `repo_id` with `revision` (a model) or `config` and `split` (a dataset), as names.py parses
    them; the cache holds it under that name. `given` is the user's string, for messages.
    """

    kind: SourceKind
    given: str
    name: str = ""
    path: str = ""
    repo_id: str = ""
    revision: str = ""
    config: str = ""
    split: str = ""

    @property
    def model_ref(self) -> ModelRef:
        return ModelRef(self.repo_id, self.revision)

    @property
    def dataset_ref(self) -> DatasetRef:
        return DatasetRef(self.repo_id, self.config, self.split)

    @property
    def preset_file(self) -> Path:
        return PRESETS_DIR / f"{self.name}.json"

    @property
    def shown(self) -> str:
        """The user's string, and the absolute path it was resolved to when that reads otherwise."""
        return self.given if self.path in ("", self.given) else f"{self.given} ({self.path})"

    def to_dict(self) -> dict[str, str]:
        return {key: value for key, value in asdict(self).items() if value}

    @classmethod
    def from_dict(cls, values: Any, where: str, key: str) -> Source:
        names = {f.name for f in fields(cls)}
        if not (
            isinstance(values, dict)
            and values.get("kind") in get_args(SourceKind)
            and set(values) <= names
            and all(isinstance(v, str) for v in values.values())
        ):
            raise SpecError(where, f"{SOURCES_KEY}.{key}", f"not a resolved source: {shown(str(values))}")
        return cls(**values)


@dataclass(frozen=True)
class Sources:
    """A RunSpec's model and data resolved, and `tokenizer`: what its text data is tokenised with
    (the `tokenizer` value, else the model's own; None for a preset model without one)."""

    model: Source
    data: Source
    tokenizer: Source | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "data": self.data.to_dict(),
            "tokenizer": self.tokenizer.to_dict() if self.tokenizer else None,
        }

    @classmethod
    def from_dict(cls, values: Any, where: str) -> Sources:
        if not isinstance(values, dict) or set(values) != {"model", "data", "tokenizer"}:
            raise SpecError(where, SOURCES_KEY, "expected model, data and tokenizer")
        tokenizer = values["tokenizer"]
        return cls(
            Source.from_dict(values["model"], where, "model"),
            Source.from_dict(values["data"], where, "data"),
            None if tokenizer is None else Source.from_dict(tokenizer, where, "tokenizer"),
        )

    @classmethod
    def of_cell_spec(cls, meta: Mapping[str, Any], where: str) -> Sources | None:
        """The resolved form a cell's spec.json carries; None for one written before it did."""
        return cls.from_dict(meta[SOURCES_KEY], where) if SOURCES_KEY in meta else None


@functools.cache
def preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))


def preset_of_hub_id(repo_id: str) -> str:
    """The shipped preset that is this hub model's configuration (PRESET_HUB_IDS), "" where none is."""
    return next((name for name, hub in PRESET_HUB_IDS.items() if hub.lower() == repo_id.lower()), "")


def model_source(value: str) -> Source | None:
    """A model (or tokenizer) value: a preset, a local path (written as one, or an existing
    folder here), a hub id ORG/NAME[@REV]; None when it is none of these."""
    if value.lower() in preset_names():
        return Source("preset", value, name=value.lower())
    if _is_local(value):
        return _local(value)
    try:
        ref = ModelRef.parse(value)
    except ValueError:
        return None
    return Source("hub", value, repo_id=ref.repo_id, revision=ref.revision)


def shipped_tokenizer_names() -> tuple[str, ...]:
    return tuple(sorted(p.parent.name for p in SHIPPED_TOKENIZERS_DIR.glob("*/tokenizer.json")))


def tokenizer_source(value: str) -> Source | None:
    """A tokenizer value: a tokenizer the package ships (its folder in the package, a local
    Source), else what the value names as a model value would."""
    if value.lower() in shipped_tokenizer_names():
        return Source("local", value, path=str(SHIPPED_TOKENIZERS_DIR / value.lower()))
    return model_source(value)


def data_source(value: str) -> Source | None:
    """A data value: synthetic, a local path, a hub dataset ORG/NAME[:config][@split] or preset; None otherwise."""
    if value == "synthetic":
        return Source("synthetic", value)
    if _is_local(value):
        return _local(value)
    try:
        ref = DatasetRef.parse(value)
    except ValueError:
        return None
    return Source("hub", value, repo_id=ref.repo_id, config=ref.config, split=ref.split)


def _local(value: str) -> Source:
    """A local path, absolute from this working directory (os.path: `..` folded, `~` expanded)."""
    return Source("local", value, path=os.path.abspath(os.path.expanduser(value)))


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET_MARKERS)


def text_files(path: Path) -> Iterator[Path]:
    """The .txt/.json/.jsonl files of a data folder (recursively, hidden ones left out), or the file itself."""
    if path.is_file():
        yield from [path] if path.suffix in TEXT_SUFFIXES else []
        return
    for found in path.rglob("*"):
        if (
            found.suffix in TEXT_SUFFIXES
            and found.is_file()
            and not any(part.startswith(".") for part in found.relative_to(path).parts)
        ):
            yield found


@functools.cache
def first_record_problem(path: str, column: str) -> str:
    """Whether the first record of a local data folder's first JSON file (in the order the cell reads
    them) holds `column` as text: "" where it does (or the data is text files or a saved dataset),
    else one line naming the file and the column, so that plan says it, not the node."""
    if is_saved_dataset(Path(path)):
        return ""
    found = sorted(f for f in text_files(Path(path)) if f.suffix in (".json", ".jsonl"))
    if not found:
        return ""
    first = found[0]
    try:
        with open(first, encoding="utf-8") as lines:
            if first.suffix == ".jsonl":
                number, line = next(((n, text) for n, text in enumerate(lines, 1) if text.strip()), (1, "{}"))
                where, record = f"{first}:{number}", json.loads(line)
            else:
                value = json.load(lines)
                where, record = str(first), value[0] if isinstance(value, list) and value else value
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{first}: not readable as JSON ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if isinstance(record, dict) and isinstance(record.get(column), (str, list)):
        return ""
    fields_seen = ", ".join(map(str, record)) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
    return (
        f"{where}: the first record has no '{column}' field of text (it has: {fields_seen or 'none'}); set text_column"
    )


def _is_local(value: str) -> bool:
    return value.startswith(LOCAL_PATH_PREFIXES) or path_exists(Path(value))


def path_exists(path: Path, where: str = "", key: str = "") -> bool:
    """Path.exists, for any text a user may write: a name the OS refuses (longer than a path or
    file name may be) is a SpecError when `key` names the value, else simply no such path."""
    try:
        return path.exists()
    except (OSError, ValueError) as exc:
        if key:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise SpecError(where, key, f"not a usable path ({reason}): {shown(str(path))}") from None
        return False


def require_folder_with(where: str, key: str, source: Source, patterns: tuple[str, ...], what: str = "") -> None:
    """A local folder holding at least one file matching one of `patterns`."""
    path = Path(source.path)
    if not (path_exists(path, where, key) and path.is_dir()):
        raise SpecError(where, key, f"no such folder: {source.shown}")
    if not any(next(path.glob(pattern), None) for pattern in patterns):
        raise SpecError(
            where, key, f"folder {source.shown} has no {' or '.join(patterns)}" + (f" ({what})" if what else "")
        )


def require_text_data(where: str, source: Source) -> None:
    path = Path(source.path)
    if not path_exists(path, where, "data"):
        raise SpecError(where, "data", f"no such file or folder: {source.shown}")
    if not (is_saved_dataset(path) or next(text_files(path), None)):
        raise SpecError(
            where,
            "data",
            f"{source.shown}: expected {'/'.join(TEXT_SUFFIXES)} files with a 'text' field, "
            "or a folder written by datasets' save_to_disk",
        )


def max_positions(config: Mapping[str, Any]) -> int | None:
    """How many positions a model config's position embedding covers; None when it does not say."""
    for key in POSITION_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_seq_len(where: str, seq_len: int, config: Mapping[str, Any]) -> None:
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        key = next(k for k in POSITION_KEYS if config.get(k) == limit)
        raise SpecError(where, "seq_len", f"{seq_len} is beyond the model's {key} ({limit})")


@functools.cache
def model_config(path: str) -> dict[str, Any]:
    """A config.json as a dict, read once per path; {} when it cannot be read (the cell then fails
    building the model, with a record that says why)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def resolve_sources(where: str, spec: Any, resolved: Sources | None = None) -> Sources:
    """A RunSpec's model, data and tokenizer as typed values, checked: decided here from its strings
    (on the login node, where the sweep is loaded), or `resolved` as they were decided there and
    are only checked again (in the cell: a path checked at plan time may be gone by now)."""
    sources = resolved or _decided(where, spec)
    check_model(where, spec, sources)
    check_data(where, spec, sources)
    return sources


def _decided(where: str, spec: Any) -> Sources:
    """The one place a model, tokenizer or data string is read for what it names."""
    model = model_source(spec.model)
    if model is None:
        raise SpecError(
            where,
            "model",
            f"expected a preset ({', '.join(preset_names())}), a folder with "
            f"config.json or a hub id ORG/NAME[@REV]; got {spec.model!r}",
        )
    tokenizer = tokenizer_source(spec.tokenizer) if spec.tokenizer else None
    if spec.tokenizer and (tokenizer is None or tokenizer.kind == "preset"):
        raise SpecError(
            where,
            "tokenizer",
            f"expected {_tokenizer_choices()}; got {spec.tokenizer!r}",
        )
    data = data_source(spec.data)
    if data is None:
        raise SpecError(
            where,
            "data",
            f"expected synthetic, a local folder, or a hub dataset "
            f"ORG/NAME[:config][@split] or preset; got {spec.data!r}",
        )
    return Sources(model, data, tokenizer or (None if model.kind == "preset" else model))


def _tokenizer_choices() -> str:
    shipped = ", ".join(f"`{name}`" for name in shipped_tokenizer_names())
    return f"a shipped tokenizer ({shipped}: tries only), a folder or a hub id ORG/NAME[@REV]"


def check_model(where: str, spec: Any, sources: Sources) -> None:
    """The model, tokenizer and init: a preset, a folder that holds what they need, or a hub id; a
    preset or local model's config bounds seq_len."""
    model = sources.model
    if model.kind == "local":
        require_folder_with(where, "model", model, ("config.json",))
    if model.kind in ("preset", "local"):  # a hub model's config is read on the compute node (cell/build.py)
        path = model.preset_file if model.kind == "preset" else Path(model.path) / "config.json"
        check_seq_len(where, spec.seq_len, model_config(str(path)))
    if spec.init == "pretrained" and model.kind == "preset":
        raise SpecError(
            where,
            "init",
            f"pretrained needs weights, and model {spec.model!r} is a preset "
            "(a config only); name a local folder or a hub id ORG/NAME",
        )
    if spec.init == "pretrained" and model.kind == "local":
        require_folder_with(where, "model", model, WEIGHT_GLOBS, "weights for init: pretrained")
    if spec.tokenizer and sources.tokenizer and sources.tokenizer.kind == "local":
        require_folder_with(where, "tokenizer", sources.tokenizer, TOKENIZER_FILES)


def check_data(where: str, spec: Any, sources: Sources) -> None:
    """The data, and the tokenizer its text needs."""
    data, tokenizer = sources.data, sources.tokenizer
    if data.kind == "synthetic":
        if spec.text_column:
            raise SpecError(
                where, "text_column", "synthetic data has no documents; set data to a folder or hub dataset"
            )
        return
    if data.kind == "local":
        require_text_data(where, data)
        if problem := first_record_problem(data.path, spec.text_column or "text"):
            raise SpecError(where, "text_column" if spec.text_column else "data", problem)
    if tokenizer is None:
        raise SpecError(
            where,
            "tokenizer",
            f"data {spec.data!r} needs one, and model {spec.model!r} is a "
            f"preset without a tokenizer; set tokenizer to {_tokenizer_choices()}",
        )
    if data.kind == "hub" and tokenizer.kind != "hub":
        raise SpecError(
            where,
            "tokenizer",
            f"hub data {spec.data!r} is read pre-tokenised from the cache, "
            f"which is keyed by a hub tokenizer ORG/NAME; got the local {tokenizer.given!r}",
        )
    if not spec.tokenizer and sources.model.kind == "local":
        require_folder_with(where, "model", sources.model, TOKENIZER_FILES, f"a tokenizer for data {spec.data!r}")
