"""Reference values per system and setup: a `references:` YAML, written by hand or by
`hpcfsdp history --set-reference` (docs/history.md).

    tolerance: 0.10                  # optional: the default of the entries below
    references:
      - cluster: alps                # optional: any cluster when absent
        gpu: NVIDIA H200             # optional: any GPU when absent
        setup: 3f2a9c1d0b7e          # a setup key (hpcfsdp history shows them), and/or
        match: {model: qwen2.5-1.5b, strategy: fsdp2_zero2, batch_size: 2}   # spec fields
        tokens_per_s_per_gpu: 39000  # expected
        peak_memory_gib: 71.0        # optional
        tolerance: 0.05              # optional
        runs: 5                      # informational (--set-reference: the median's runs)
        set_at: "2026-11-23"         # informational

A cell takes the most specific entry that matches it: one naming its setup before one matching
spec fields, then the one naming more of cluster, GPU and fields; ties go to the first in the file.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..contracts.errors import UserError
from ..contracts.fields import SpecError, coerce_fields, unknown_key
from ..contracts.files import linked_file, read_regular_file, write_text
from ..contracts.spec import RunSpec

TOP_KEYS = ("tolerance", "references")
MAX_REFERENCES_BYTES = 16 << 20  # a file of some 50,000 entries
ENTRY_KEYS = (
    "cluster",
    "gpu",
    "setup",
    "match",
    "tokens_per_s_per_gpu",
    "peak_memory_gib",
    "tolerance",
    "runs",
    "set_at",
)
_DEFAULTS = RunSpec().to_dict()


@dataclass(frozen=True)
class Reference:
    tokens_per_s_per_gpu: float
    cluster: str | None = None
    gpu: str | None = None
    setup: str | None = None
    match: dict[str, Any] = field(default_factory=dict)
    peak_memory_gib: float | None = None
    tolerance: float | None = None  # None: the file's, else collect's --tolerance
    where: str = ""  # file:line, for messages
    extra: dict[str, Any] = field(default_factory=dict)  # runs, set_at: kept when the file is rewritten

    def matches(self, cluster: Any, gpu: Any, setup: str, spec: Mapping[str, Any]) -> bool:
        return (
            (self.cluster is None or self.cluster == cluster)
            and (self.gpu is None or self.gpu == gpu)
            and (self.setup is None or self.setup == setup)
            and all(spec.get(name, _DEFAULTS.get(name)) == value for name, value in self.match.items())
        )

    def specificity(self) -> tuple[int, int, int]:
        return (self.setup is not None, (self.cluster is not None) + (self.gpu is not None), len(self.match))

    def to_yaml(self) -> dict[str, Any]:
        entry = {
            "cluster": self.cluster,
            "gpu": self.gpu,
            "setup": self.setup,
            "match": self.match or None,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "peak_memory_gib": self.peak_memory_gib,
            "tolerance": self.tolerance,
            **self.extra,
        }
        return {key: value for key, value in entry.items() if value is not None}


@dataclass(frozen=True)
class References:
    entries: tuple[Reference, ...] = ()
    tolerance: float | None = None
    path: Path | None = None

    def find(self, cluster: Any, gpu: Any, setup: str, spec: Mapping[str, Any]) -> Reference | None:
        """The most specific entry matching the cell; None when none does."""
        matching = [
            (ref.specificity(), -index, ref)
            for index, ref in enumerate(self.entries)
            if ref.matches(cluster, gpu, setup, spec)
        ]
        return max(matching, key=lambda item: item[:2])[2] if matching else None

    def tolerance_of(self, ref: Reference, default: float) -> float:
        return next(t for t in (ref.tolerance, self.tolerance, default) if t is not None)


def load_references(path: Path) -> References:
    """Read and check a references file; a mistake is one SpecError naming the file, line and key."""
    path = Path(path)
    data, lines = _parse(path)
    if data is None:
        return References(path=path)
    if not isinstance(data, dict):
        raise SpecError(str(path), "", "expected a mapping with a 'references:' list")
    for key in data:
        if key not in TOP_KEYS:
            raise unknown_key(f"{path}:{lines.get(key, 1)}", key, TOP_KEYS)
    tolerance = _fraction(f"{path}:{lines.get('tolerance', 1)}", "tolerance", data.get("tolerance"))
    items = data.get("references") or []
    if not isinstance(items, list):
        raise SpecError(f"{path}:{lines.get('references', 1)}", "references", "expected a list of entries")
    entries = tuple(_entry(item, path, lines, index) for index, item in enumerate(items))
    return References(entries, tolerance, path)


def _entry(item: Any, path: Path, lines: dict, index: int) -> Reference:
    start = lines.get(("entry", index), 1)
    where = f"{path}:{start}"
    if not isinstance(item, dict):
        raise SpecError(
            where, f"references[{index}]", "expected a mapping (cluster, gpu, setup, match, tokens_per_s_per_gpu, ...)"
        )

    def at(key: str) -> str:
        return f"{path}:{lines.get((index, key), start)}"

    for key in item:
        if key not in ENTRY_KEYS:
            raise unknown_key(at(key), key, ENTRY_KEYS, section=f"references[{index}]")
    name = f"references[{index}]"
    expected = _positive(item.get("tokens_per_s_per_gpu"))
    if expected is None:
        raise SpecError(
            at("tokens_per_s_per_gpu"),
            f"{name}.tokens_per_s_per_gpu",
            f"expected a positive number, got {item.get('tokens_per_s_per_gpu')!r}",
        )
    memory = _positive(item.get("peak_memory_gib"))
    if memory is None and item.get("peak_memory_gib") is not None:
        raise SpecError(
            at("peak_memory_gib"),
            f"{name}.peak_memory_gib",
            f"expected a positive number, got {item['peak_memory_gib']!r}",
        )
    for key in ("cluster", "gpu", "setup"):
        if item.get(key) is not None and not isinstance(item[key], str):
            raise SpecError(at(key), f"{name}.{key}", f"expected text, got {item[key]!r}")
    match = item.get("match") or {}
    if not isinstance(match, dict):
        raise SpecError(
            at("match"), f"{name}.match", "expected a mapping of spec fields, e.g. {strategy: ddp, batch_size: 2}"
        )
    if not match and not item.get("setup"):
        raise SpecError(
            where, name, "expected a setup key or a match of spec fields (an entry for every cell is a mistake)"
        )
    try:
        match = coerce_fields(RunSpec, match, at("match"))
    except SpecError as exc:
        raise SpecError(exc.where, f"{name}.match.{exc.key}", exc.what) from None
    return Reference(
        tokens_per_s_per_gpu=expected,
        cluster=item.get("cluster"),
        gpu=item.get("gpu"),
        setup=item.get("setup"),
        match=match,
        peak_memory_gib=memory,
        tolerance=_fraction(at("tolerance"), f"{name}.tolerance", item.get("tolerance")),
        where=at("tokens_per_s_per_gpu"),
        extra={key: item[key] for key in ("runs", "set_at") if key in item},
    )


def _positive(value: Any) -> float | None:
    """The value as a float when it is a positive number; None otherwise."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _fraction(where: str, key: str, value: Any) -> float | None:
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1):
        raise SpecError(where, key, f"expected a fraction between 0 and 1 (0.1 is 10%), got {value!r}")
    return float(value)


def _parse(path: Path) -> tuple[Any, dict]:
    """The YAML value and the line of each key: top-level keys by name, entry keys by (index, key),
    each entry's start by ('entry', index)."""
    try:  # a link the user made to a shared file is read where it leads (files.linked_file)
        text = read_regular_file(linked_file(path), MAX_REFERENCES_BYTES).decode("utf-8", errors="replace")
    except OSError as exc:
        raise SpecError(str(path), "", f"cannot read the references file ({exc.strerror or exc})") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise SpecError(
            f"{path}:{mark.line + 1}" if mark else str(path),
            "",
            f"not valid YAML ({getattr(exc, 'problem', None) or exc})",
        ) from None
    finally:
        loader.dispose()
    lines: dict = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            lines[key_node.value] = key_node.start_mark.line + 1
            if key_node.value == "references" and isinstance(value_node, yaml.SequenceNode):
                for index, entry in enumerate(value_node.value):
                    lines[("entry", index)] = entry.start_mark.line + 1
                    if isinstance(entry, yaml.MappingNode):
                        lines.update({(index, k.value): k.start_mark.line + 1 for k, _ in entry.value})
    return data, lines


def write_references(path: Path, new: list[Reference]) -> References:
    """Add the new entries to the file (created when absent), replacing those of the same cluster,
    GPU and setup; the file is rewritten whole, so comments in it are not kept."""
    path = linked_file(path)  # a link to a shared file: the file it leads to is rewritten, never the link
    current = load_references(path) if path.exists() else References(path=path)
    replaced = {(ref.cluster, ref.gpu, ref.setup) for ref in new}
    kept = [ref for ref in current.entries if (ref.cluster, ref.gpu, ref.setup) not in replaced]
    merged = References((*kept, *new), current.tolerance, path)
    document: dict[str, Any] = {}
    if merged.tolerance is not None:
        document["tolerance"] = merged.tolerance
    document["references"] = [ref.to_yaml() for ref in merged.entries]
    header = (
        "# Expected tokens/s per GPU (and peak memory) per system and setup: docs/history.md.\n"
        "# `hpcfsdp history --set-reference` rewrites this file (comments are not kept).\n"
    )
    write_text(path, header + yaml.safe_dump(document, sort_keys=False, allow_unicode=True))
    return merged


def references_of(medians: Any, tolerance: float | None) -> list[Reference]:
    """`history --set-reference`: one entry per row of history_rows.medians_by_setup, dated today;
    UserError when there is none."""
    if medians.empty:
        raise UserError("no ok run matches these filters: no reference written")
    today = datetime.date.today().isoformat()
    return [
        Reference(
            tokens_per_s_per_gpu=round(float(row.tokens_per_s_per_gpu), 1),
            cluster=_text_or_none(row.cluster),
            gpu=_text_or_none(row.gpu),
            setup=row.setup,
            match=json.loads(row.setup_fields),
            peak_memory_gib=None if math.isnan(row.peak_memory_gib) else round(float(row.peak_memory_gib), 3),
            tolerance=tolerance,
            extra={"runs": int(row.runs), "set_at": today},
        )
        for row in medians.itertuples(index=False)
    ]


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
