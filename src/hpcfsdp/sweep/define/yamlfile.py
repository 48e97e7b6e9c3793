"""Read a jobs file within bounds: size, encoding, nesting depth and alias expansion; and load it
with the line of every mapping key (LineLoader), so that a message names the line that set a value.

A careless or hostile file (a YAML "billion laughs", thousands of nested brackets, Latin-1 or
UTF-16 text, a lone surrogate written as "\\ud800", a generated file of megabytes) becomes one
SpecError naming the file, instead of a hang, a memory blow-up or a traceback.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.nodes import MappingNode, Node, SequenceNode

from ...contracts.fields import SpecError
from ...contracts.names import has_surrogate

MAX_BYTES = 1024**2  # a hand-written jobs file is a few KiB; pure-Python YAML parses ~0.25 MiB/s here
MAX_DEPTH = 64  # a jobs file nests 4 levels; Python's recursion limit is hit near 300
MAX_VALUES = 1_000_000  # nodes of the document with every alias expanded
FOREIGN_BOMS = {
    "UTF-32": (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE),  # first: its LE mark starts like UTF-16's
    "UTF-16": (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE),
}


def read_text(path: Path) -> str:
    """The file's text: at most MAX_BYTES, UTF-8 (a UTF-8 byte-order mark is allowed)."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise SpecError(
            str(path),
            "",
            f"jobs file of {size:,} bytes, more than the limit of {MAX_BYTES:,}; "
            "write a generated sweep as matrix axes (with include / exclude) instead",
        )
    data = path.read_bytes()[: MAX_BYTES + 1]  # the file may grow between stat and read
    for encoding, boms in FOREIGN_BOMS.items():
        if data.startswith(boms):
            raise SpecError(str(path), "", f"not UTF-8 (a {encoding} byte-order mark); save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError(
            f"{path}:{line}", "", f"not UTF-8 (byte 0x{data[exc.start]:02x} at column {column}); save it as UTF-8"
        ) from None


# PyYAML's words for a syntax error -> what to change, for the mistakes people make by hand.
SYNTAX_HINTS = (
    (
        "mapping values are not allowed here",
        "a ': ' YAML cannot take here: a key indented deeper than the keys "
        "above it, or a value holding ': ' (quote the value)",
    ),
    (
        "expected <block end>, but found",
        "a line indented differently from the lines above it: the keys of "
        "one section line up, each list item starts with '- ' at the same column",
    ),
    ("found character '\\t' that cannot start any token", "a tab: YAML indents with spaces only"),
    ("expected ',' or ']'", "a list opened with '[' and not closed with ']'"),
    ("expected ',' or '}'", "a mapping opened with '{' and not closed with '}'"),
    ("found unexpected end of stream", "a quote opened and never closed"),
    ("could not find expected ':'", "a key without its ':' (or a line that is neither 'key: value' nor '- item')"),
)


# The problems PyYAML marks where it gave up, past the line to fix: named at what they began with.
AT_CONTEXT = ("could not find expected ':'", "expected ',' or ']'", "expected ',' or '}'")


def syntax_error(path: Path, exc: yaml.MarkedYAMLError) -> SpecError:
    """A YAML syntax error as one line: the file, the line to fix, and what to change there in
    words (PyYAML's own only where no hint fits). A key without its ':' or a bracket never closed
    is named at its own line (PyYAML's mark is where it gave up, further on)."""
    problem = exc.problem or str(exc)
    hint = next((words for start, words in SYNTAX_HINTS if problem.startswith(start)), None)
    mark = exc.context_mark if problem.startswith(AT_CONTEXT) and exc.context_mark else exc.problem_mark
    where = f"{path}:{mark.line + 1}" if mark else str(path)
    if hint is None:
        return SpecError(where, "", f"not valid YAML ({problem})")
    return SpecError(where, "", f"not valid YAML{f' (column {mark.column + 1})' if mark else ''}: {hint}")


class BoundedLoader(yaml.SafeLoader):
    """A SafeLoader that refuses documents nested deeper than MAX_DEPTH, or holding more than
    MAX_VALUES nodes once aliases are expanded (checked on the node graph, before any Python
    object is built), or an alias inside the node it names."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Node | None:
        node = super().compose_document()
        if node is not None:
            _expanded_size(node)
        return node


def _expanded_size(root: Node) -> int:
    """Nodes under `root` with aliases expanded, counted once per distinct node (memoised), so an
    alias bomb of a few lines is measured in a few steps and refused."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ComposerError(None, None, "an alias refers to a node that contains it", node.start_mark)
        open_nodes.add(key)
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
            if isinstance(node.value, str) and has_surrogate(node.value):
                # "\ud800" in a double-quoted scalar: no text, which no file, script or JSON parser takes
                raise ComposerError(None, None, "a lone surrogate (\\ud800-\\udfff), which is no text", node.start_mark)
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_VALUES:
                raise ComposerError(
                    None,
                    None,
                    f"more than {MAX_VALUES:,} values once its aliases are expanded (an alias bomb?)",
                    node.start_mark,
                )
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


class LineLoader(BoundedLoader):
    """A SafeLoader, with bounds, that remembers the line of every mapping key, for error messages."""


def _construct_mapping(loader: LineLoader, node: yaml.MappingNode) -> _LinedDict:
    """A mapping that knows its keys' lines, refuses a duplicate key, and takes YAML merge keys
    (`<<: *defaults`, `<<: [*a, *b]`): merged keys come first, so that the mapping's own keys
    override them (the YAML merge rules); a key the mapping itself repeats is still a duplicate.
    The loader's bounds (depth, values once aliases are expanded) were checked on the node graph,
    merges included, before this runs."""
    own = sum(not _is_merge(key_node) for key_node, _ in node.value)
    loader.flatten_mapping(node)  # SafeLoader's: the merged pairs, then the mapping's own
    merged = len(node.value) - own
    mapping = _LinedDict()
    for position, (key_node, value_node) in enumerate(node.value):
        key = loader.construct_object(key_node)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"a {'mapping' if isinstance(key, dict) else 'list'} cannot be a key; keys are names",
                key_node.start_mark,
            ) from None
        if key in mapping and (position < merged or key not in mapping.own):
            mapping.pop(key)  # a merged value: a later merge or the mapping's own key overrides it
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {mapping.lines[key]})", key_node.start_mark
            )
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.lines[key] = key_node.start_mark.line + 1
        if position >= merged:
            mapping.own.add(key)
    return mapping


def _is_merge(key_node: yaml.Node) -> bool:
    return key_node.tag == "tag:yaml.org,2002:merge"


class _LinedDict(dict):
    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[Any, int] = {}
        self.own: set[Any] = set()  # keys the mapping itself writes (not merged into it)


LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
