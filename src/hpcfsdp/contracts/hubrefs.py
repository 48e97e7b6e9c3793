"""Names of hub items, parsed: models `ORG/NAME[@REV]`, dataset splits `ORG/NAME[:CONFIG][@SPLIT]`
(or a preset), and a split tokenized for a model. Pure parsing (standard library only): the RunSpec
contract checks its `model` and `data` with it, and the cache (cache/) keys and folders its items by
it, so it sits below both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_REVISION = "main"
DEFAULT_CONFIG = "default"
DEFAULT_SPLIT = "train"
DEFAULT_TEXT_COLUMN = "text"


@dataclass(frozen=True)
class DatasetPreset:
    """A hub dataset known by a short name, and the column its documents are in.

    A jobs YAML names only the dataset (`data: chess`), so the column must come from here.
    """

    repo_id: str
    text_column: str = DEFAULT_TEXT_COLUMN


DATASET_PRESETS = {
    "tinystories": DatasetPreset("roneneldan/TinyStories"),
    # One game per row: `Moves` is a list of UCI moves ("e2e4", ...), beside `Termination` and `Result`.
    "chess": DatasetPreset("laion/strategic_game_chess", text_column="Moves"),
}

_REPO_ID = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
_MODEL_RE = re.compile(rf"^(?P<repo>{_REPO_ID})(?:@(?P<rev>[^\s@]+))?$")
_DATASET_RE = re.compile(rf"^(?P<repo>{_REPO_ID})(?::(?P<config>[^\s:@]+))?(?:@(?P<split>[^\s@]+))?$")


@dataclass(frozen=True)
class ModelRef:
    """A hub model repo: `ORG/NAME[@revision]` (revision: branch, tag or commit sha; default main)."""

    repo_id: str
    revision: str = DEFAULT_REVISION

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        m = _MODEL_RE.match(text.strip())
        if not m:
            raise ValueError(f"model: {text!r}: expected a hub repo id ORG/NAME or ORG/NAME@REVISION")
        return cls(m["repo"], m["rev"] or DEFAULT_REVISION)

    @property
    def name(self) -> str:
        """What the user writes: the revision is left out when it is the default."""
        return self.repo_id if self.revision == DEFAULT_REVISION else f"{self.repo_id}@{self.revision}"

    @property
    def key(self) -> str:
        return f"model:{self.repo_id}@{self.revision}"

    @property
    def slug(self) -> str:
        rev = "" if self.revision == DEFAULT_REVISION else "@" + _safe(self.revision)
        return self.repo_id.replace("/", "--") + rev


@dataclass(frozen=True)
class DatasetRef:
    """A hub dataset: `ORG/NAME[:config][@split]` or a preset name (tinystories, chess).

    The split may carry a slice, as `datasets` understands it: `roneneldan/TinyStories@train[:10000]`.
    """

    repo_id: str
    config: str = DEFAULT_CONFIG
    split: str = DEFAULT_SPLIT

    @classmethod
    def parse(cls, text: str) -> DatasetRef:
        text = text.strip()
        head, sep, split = text.partition("@")
        base, _, config = head.partition(":")
        preset = DATASET_PRESETS.get(base.lower())
        base = preset.repo_id if preset else base
        full = base + (f":{config}" if config else "") + (f"@{split}" if sep else "")
        m = _DATASET_RE.match(full)
        if not m or (sep and not split):
            presets = ", ".join(DATASET_PRESETS)
            raise ValueError(f"dataset: {text!r}: expected ORG/NAME[:config][@split] or a preset ({presets})")
        return cls(m["repo"], m["config"] or DEFAULT_CONFIG, m["split"] or DEFAULT_SPLIT)

    @property
    def name(self) -> str:
        return f"{self.repo_id}:{self.config}@{self.split}"

    @property
    def key(self) -> str:
        return f"dataset:{self.name}"

    @property
    def load_config(self) -> str | None:
        """The `name` argument of datasets.load_dataset (None for the default configuration)."""
        return None if self.config == DEFAULT_CONFIG else self.config

    @property
    def relpath(self) -> str:
        return f"datasets/{self.repo_id.replace('/', '--')}/{_safe(self.config)}/{_safe(self.split)}"

    @property
    def text_column(self) -> str:
        """The column its documents are in: its preset's (chess: Moves), else `text`."""
        presets = (p for p in DATASET_PRESETS.values() if p.repo_id == self.repo_id)
        return next((p.text_column for p in presets), DEFAULT_TEXT_COLUMN)


@dataclass(frozen=True)
class TokenizedRef:
    """A dataset split's text column tokenized with a model's tokenizer, packed into blocks of seq_len.

    text_column None means the dataset's own column (DatasetRef.text_column). The column is part of
    the item's key, name and folder unless it is `text`: two columns of one split are two items,
    and items cached before the column was part of the key (all of them `text`) keep their key.
    """

    dataset: DatasetRef
    model: ModelRef
    seq_len: int
    text_column: str | None = None

    def __post_init__(self) -> None:
        if self.text_column is None:
            object.__setattr__(self, "text_column", self.dataset.text_column)

    @property
    def _custom_column(self) -> bool:
        return self.text_column != DEFAULT_TEXT_COLUMN

    @property
    def name(self) -> str:
        column = f", column {self.text_column}" if self._custom_column else ""
        return f"{self.dataset.name} tokenized for {self.model.name}, seq_len {self.seq_len}{column}"

    @property
    def key(self) -> str:
        column = f"|text_column={self.text_column}" if self._custom_column else ""
        return (
            f"tokenized:{self.dataset.name}|{self.model.repo_id}@{self.model.revision}|seq_len={self.seq_len}{column}"
        )

    @property
    def relpath(self) -> str:
        column = f"-{_safe(str(self.text_column))}" if self._custom_column else ""
        return "tokenized/" + self.dataset.relpath.split("/", 1)[1] + f"/{self.model.slug}/seq{self.seq_len}{column}"


def _safe(text: str) -> str:
    """A folder-safe form of a revision, config or split (slices like train[:10%] included)."""
    return re.sub(r"[^A-Za-z0-9._+-]", lambda m: f"%{ord(m.group()):02X}", text)
