"""What a RunSpec's model, tokenizer and data values name: a shipped preset, a local folder, or a
hub item; and the checks a local one must pass (it exists, holds a config, weights, a tokenizer or
text), so that a bad path is one line at plan time, not a failed cell.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .fields import SpecError, shown
from .hubrefs import DatasetRef, ModelRef

PRESETS_DIR = Path(__file__).parents[1] / "presets"
TEXT_SUFFIXES = (".txt", ".json", ".jsonl")
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # datasets.save_to_disk
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
# config.json keys that give how many positions a model's position embedding covers
POSITION_KEYS = ("max_position_embeddings", "n_positions")
# A model / data / tokenizer value written like this names a local path, which must exist.
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")


@functools.cache
def preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))


def model_kind(value: str) -> str:
    """A model (or tokenizer) value: 'preset', 'local' (written as a path, or an existing folder),
    'hub' (ORG/NAME[@REV]), or '' when it is none of these."""
    return "preset" if value.lower() in preset_names() else _local_or_hub(value, ModelRef)


def data_kind(value: str) -> str:
    """A data value: 'synthetic', 'local', 'hub' (ORG/NAME[:config][@split] or a preset), or ''."""
    return "synthetic" if value == "synthetic" else _local_or_hub(value, DatasetRef)


def _local_or_hub(value: str, ref: type[ModelRef] | type[DatasetRef]) -> str:
    """'local' for a path, 'hub' for what `ref` parses, else ''."""
    if _is_local(value):
        return "local"
    try:
        ref.parse(value)
    except ValueError:
        return ""
    return "hub"


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


def require_folder_with(where: str, key: str, value: str, patterns: tuple[str, ...], what: str = "") -> None:
    """A local folder holding at least one file matching one of `patterns`."""
    path = Path(value).expanduser()
    if not (path_exists(path, where, key) and path.is_dir()):
        raise SpecError(where, key, f"no such folder: {value}")
    if not any(next(path.glob(pattern), None) for pattern in patterns):
        raise SpecError(where, key, f"folder {value} has no {' or '.join(patterns)}" + (f" ({what})" if what else ""))


def require_text_data(where: str, value: str) -> None:
    path = Path(value).expanduser()
    if not path_exists(path, where, "data"):
        raise SpecError(where, "data", f"no such file or folder: {value}")
    if not (is_saved_dataset(path) or next(text_files(path), None)):
        raise SpecError(
            where,
            "data",
            f"{value}: expected {'/'.join(TEXT_SUFFIXES)} files with a 'text' field, "
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


def check_model(where: str, spec: Any) -> None:
    """The model, tokenizer and init of a RunSpec: a preset, a folder that holds what they need, or
    a hub id; a preset or local model's config bounds seq_len."""
    kind = model_kind(spec.model)
    if not kind:
        raise SpecError(
            where,
            "model",
            f"expected a preset ({', '.join(preset_names())}), a folder with "
            f"config.json or a hub id ORG/NAME[@REV]; got {spec.model!r}",
        )
    if kind == "local":
        require_folder_with(where, "model", spec.model, ("config.json",))
    if kind in ("preset", "local"):  # a hub model's config is read on the compute node (cell/run.py)
        config = model_config(
            str(PRESETS_DIR / f"{spec.model.lower()}.json")
            if kind == "preset"
            else str(Path(spec.model).expanduser() / "config.json")
        )
        check_seq_len(where, spec.seq_len, config)
    if spec.init == "pretrained" and kind == "preset":
        raise SpecError(
            where,
            "init",
            f"pretrained needs weights, and model {spec.model!r} is a preset "
            "(a config only); name a local folder or a hub id ORG/NAME",
        )
    if spec.init == "pretrained" and kind == "local":
        require_folder_with(where, "model", spec.model, WEIGHT_GLOBS, "weights for init: pretrained")
    if spec.tokenizer:
        tokenizer_kind = model_kind(spec.tokenizer)
        if tokenizer_kind not in ("local", "hub"):
            raise SpecError(where, "tokenizer", f"expected a folder or a hub id ORG/NAME[@REV]; got {spec.tokenizer!r}")
        if tokenizer_kind == "local":
            require_folder_with(where, "tokenizer", spec.tokenizer, TOKENIZER_FILES)


def check_data(where: str, spec: Any) -> None:
    """The data of a RunSpec, and the tokenizer its text needs."""
    kind = data_kind(spec.data)
    if not kind:
        raise SpecError(
            where,
            "data",
            f"expected synthetic, a local folder, or a hub dataset "
            f"ORG/NAME[:config][@split] or preset; got {spec.data!r}",
        )
    if kind == "synthetic":
        if spec.text_column:
            raise SpecError(
                where, "text_column", "synthetic data has no documents; set data to a folder or hub dataset"
            )
        return
    if kind == "local":
        require_text_data(where, spec.data)
    tokenizer = spec.text_tokenizer
    if not tokenizer:
        raise SpecError(
            where,
            "tokenizer",
            f"data {spec.data!r} needs one, and model {spec.model!r} is a "
            "preset without a tokenizer; set tokenizer to a folder or a hub id ORG/NAME",
        )
    if kind == "hub" and model_kind(tokenizer) != "hub":
        raise SpecError(
            where,
            "tokenizer",
            f"hub data {spec.data!r} is read pre-tokenised from the cache, "
            f"which is keyed by a hub tokenizer ORG/NAME; got the local {tokenizer!r}",
        )
    if not spec.tokenizer and model_kind(spec.model) == "local":
        require_folder_with(where, "model", spec.model, TOKENIZER_FILES, f"a tokenizer for data {spec.data!r}")
