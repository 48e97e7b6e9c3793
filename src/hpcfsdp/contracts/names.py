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
- 'é' written as 'e' and a combining accent prints like 'é' written as one character, and is another
  folder: a name must be in Unicode's composed form (NFC).
"""

from __future__ import annotations

import unicodedata

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
