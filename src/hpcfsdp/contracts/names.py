"""What a name the user writes may hold, where it becomes a path, a Slurm argument or Markdown.

Each check returns what is wrong with a value ("" when nothing is), and spec.py turns that into
one SpecError line naming the file, line and key (docs/refusals.md lists the rules and why).

- A character nobody sees (a zero-width space, a byte-order mark, a no-break space, a Hangul
  filler) makes two names that print alike into two folders; a direction-changing one (U+202E
  RIGHT-TO-LEFT OVERRIDE, U+2066..U+2069 isolates) makes a name print as another.
- A sweep name becomes the folder results/<name>/, beside files the suite keeps there for every
  sweep (history.duckdb, references.yaml and their companions): a sweep of such a name would break
  them for every sweep of that folder. It also becomes sbatch's job name and log paths, where `%`
  is a filename pattern (%j, %u, ...) that sbatch expands.
- A partition, account, QOS or constraint is one sbatch argument: a space would make it two.
- A Slurm job id read back from a file (a record, the manifest) becomes an argument of squeue,
  sacct or scancel: digits and an array task's `_N` only, or a comma would name other jobs.
- A lone surrogate (U+D800..U+DFFF: JSON's "\\ud800", or a byte of a file name that is not UTF-8,
  which Python carries as one) is no text: no UTF-8 file, terminal, CSV or strict JSON parser
  (orjson, DuckDB) takes it. Such text is refused, and a folder so named is shown escaped.
- 'é' written as 'e' and a combining accent prints like 'é' written as one character, and is another
  folder: a name must be in Unicode's composed form (NFC).

Below them, the names of hub items parsed (no check, pure parsing): models `ORG/NAME[@REV]`, dataset
splits `ORG/NAME[:CONFIG][@SPLIT]` (or a preset), and a split tokenized for a model. The RunSpec
contract checks its `model` and `data` with them, and the cache (cache/) keys and folders its items
by them, so they sit below both.
"""

from __future__ import annotations

import numbers
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

MAX_NAME_BYTES = 255  # a file name, on the file systems Linux clusters use
# Files `collect` and `history` keep in the results folder beside the sweep folders (the history's
# companions start with its name: history.duckdb.lock, history.duckdb.wal).
BESIDE_SWEEPS = ("history.duckdb", "references.yaml")
# Unicode's Default_Ignorable_Code_Point ranges (DerivedCoreProperties.txt): characters drawn as
# nothing, among them letters (Hangul fillers) and marks (variation selectors) that the general
# categories below let through; and U+2800, the blank braille pattern.
_IGNORABLE = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x2800, 0x2800),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
# General categories of characters that are not drawn as themselves: controls, format characters
# (zero-width, bidirectional controls), surrogates, private use, unassigned, and separators other
# than the plain space (no-break and other spaces, line and paragraph separators).
_UNSEEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})


SURROGATE = re.compile("[\ud800-\udfff]")


def has_surrogate(text: str) -> bool:
    """Whether text holds a lone surrogate, which no UTF-8 file or strict JSON parser takes."""
    return SURROGATE.search(text) is not None


def readable(text: str) -> str:
    """text as UTF-8 can hold it: each lone surrogate (a file name's byte that is not UTF-8) as a
    `\\udcff` escape, for a name that must still be shown (a cell folder named so)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if has_surrogate(text) else text


# What a terminal takes as a command, not as text: the C0 controls but the tab and the newline (ESC
# starts a sequence that sets the window's title, moves the cursor, clears the screen, or writes the
# clipboard), DEL, the C1 controls (CSI, OSC), the direction-changing characters (a line that prints
# as another), and lone surrogates (a file name's byte that is not UTF-8; no terminal takes one).
TERMINAL_COMMAND = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable_text(text: str) -> str:
    """text as it may reach a terminal: each character a terminal would take as a command
    (TERMINAL_COMMAND) escaped as ascii() writes it (`\\x1b`, `\\r`, `\\udcff`); tabs and
    newlines kept. What hpcfsdp prints goes through it (progress.escaped_output): the text of
    records, specs, the history and logs is another user's where results are shared (issue 51)."""
    if text.isascii() and text.isprintable():  # the usual line, checked in C
        return text
    return TERMINAL_COMMAND.sub(lambda found: ascii(found.group())[1:-1], text)


def unseen_character(text: str) -> str:
    """The first character of text that is invisible or changes the direction of the text around
    it, as 'U+202E (RIGHT-TO-LEFT OVERRIDE)'; "" when there is none. A plain space is visible."""
    if text.isascii() and text.isprintable():  # the usual text, checked in C: ASCII's unseen are its controls
        return ""
    for char in text:
        if char == " ":
            continue
        code = ord(char)
        if unicodedata.category(char) in _UNSEEN_CATEGORIES or any(lo <= code <= hi for lo, hi in _IGNORABLE):
            return f"U+{code:04X} ({unicodedata.name(char, 'unnamed')})"
    return ""


def name_problem(value: object) -> str:
    """What makes a value unusable as a name the user reads and types (a sweep, a partition):
    not text, blank, space at either end, or a character nobody sees; "" when nothing does."""
    if not isinstance(value, str):
        return f"expected text, got {type(value).__name__}"
    if not value.strip():
        return "expected a name, got a blank one"
    if value != value.strip():
        return "a space at the start or end (invisible where the name is shown)"
    unseen = unseen_character(value)
    if unseen:
        return f"holds {unseen}, a character that is invisible or changes the direction of the text around it"
    if not unicodedata.is_normalized("NFC", value):
        # 'é' as e plus U+0301 prints as 'é' in one character but is another folder and job name.
        return "not in Unicode's composed form (NFC): a letter and a combining accent print like another name"
    return ""


def folder_name_problem(value: object) -> str:
    """A sweep name: a name (name_problem) that makes one folder of results/, is none of the files
    kept there beside the sweeps, and holds no sbatch filename pattern; "" when it is fine."""
    problem = name_problem(value)
    if problem:
        return problem
    assert isinstance(value, str)
    if value in (".", "..") or "/" in value or "\\" in value:
        return "not a single folder name (., .., / and \\ are not allowed)"
    if value.startswith("."):
        return "starts with '.' (a hidden folder; the suite's temporary files beside sweeps start so)"
    if len(value.encode()) > MAX_NAME_BYTES:
        return f"longer than {MAX_NAME_BYTES} bytes (a file name)"
    lowered = value.casefold()
    for kept in BESIDE_SWEEPS:
        if lowered == kept or lowered.startswith(kept + "."):
            return f"named like {kept}, which collect keeps beside the sweep folders (results/{kept})"
    if "%" in value:
        return "holds '%', which sbatch expands in log file names (%j, %u, ...)"
    return sbatch_word_problem(value)  # it becomes the job name and log paths


# What ends or re-quotes a word of an `#SBATCH --option=value` line as sbatch reads it (Slurm
# 22.05): a space, a quote ("Unmatched `'`" stops sbatch), and '#' (the rest becomes a comment).
SBATCH_WORD_BREAKERS = "'\"#"


def sbatch_word_problem(value: str) -> str:
    """A value that goes whole into an #SBATCH line (a name, a partition, a log path); "" when it can."""
    if any(char.isspace() for char in value):
        return "holds a space (sbatch reads one word here: its #SBATCH line would end there)"
    found = next((char for char in value if char in SBATCH_WORD_BREAKERS), "")
    if found:
        return f"holds {found!r}, which breaks the #SBATCH line it goes into (sbatch reads quotes and '#' there)"
    return ""


def slurm_name_problem(value: str) -> str:
    """A partition, account, QOS or constraint: one sbatch argument ("" where unset)."""
    if value == "":
        return ""
    return name_problem(value) or sbatch_word_problem(value)


# Slurm job ids read back from a file (a record's `slurm`, the manifest), for squeue, sacct and scancel


def slurm_job_of(slurm: Any) -> str | None:
    """The id Slurm knows a record's job by (a record's `slurm` object): ARRAY_TASK for an array
    task, as sacct and squeue print it, else the job id; None outside Slurm."""
    if not isinstance(slurm, dict):
        return None
    array, task, job = (slurm_id_text(slurm.get(key)) for key in ("array_job_id", "array_task_id", "job_id"))
    found = f"{array}_{task}" if array and task else job
    return found if found and is_job_id(found) else None


def is_job_id(text: str) -> bool:
    """A Slurm job id as squeue and sacct take it (JOB or ARRAY_TASK): a value from a file that
    becomes their argument must be nothing else (a comma would name other jobs)."""
    return bool(re.fullmatch(r"[0-9]+(_[0-9]+)?", text))


def slurm_id_text(value: Any) -> str | None:
    """A Slurm id of a record's `slurm` as text: 4242 whether the JSON held "4242" or 4242, or a
    DataFrame made it 4242.0 (or numpy's 4242, from a nullable integer column); text as it is.
    None for what no id can be: nothing (None, NaN, pandas' NA, ""), a bool, a number that is not
    whole (4242.5, infinity), a list or an object. So slurm_job_of falls back to the job's own id
    where the array id is spoiled (not "True_3"), and an export never tags a run with "True"."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if isinstance(value, numbers.Integral):  # not through float: exact however large
        return str(int(value))
    number = float(value)
    return str(int(number)) if number.is_integer() else None


# ---------------------------------------------------------------------------------------------
# Hub names, parsed

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
