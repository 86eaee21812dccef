"""Names and prose fitted into a terminal's width (the summary, `ls`), issue 35 item 2.

A name is shortened where it says the least: an op name first loses the namespace and
overload everyone shares (`aten.`, `.default`: `aten.convolution_backward.default` ->
`convolution_backward`), and only then its middle; a module path keeps its end, the
part that tells layers apart (`model.encoder.layers.11.mlp.fc2` -> `…layers.11.mlp.fc2`).
Prose wraps at spaces with its continuation lines indented, and never between a number and
its unit or comparison (`> 6 u`, `41 u`, `5 %`). The csv, json and HTML keep full names.
Light: standard library only.
"""

from __future__ import annotations

import re
import textwrap

ELLIPSIS = "…"

# the parts of an op name every op shares, dropped first (in this order) when it is too long
_COMMON_NAMESPACES = ("aten.",)
_COMMON_OVERLOADS = (".default",)

# a space that must not break a line: between a comparison and its number, a number and its unit
_GLUE = re.compile(r"(?<=[<>=≤≥]) (?=[-+]?\d)|(?<=\d) (?=(?:u|%|x|ms|s|MB|GB|B)\b)|(?<=\d) (?=u allowed)")
_NBSP = "\x00"          # placeholder while wrapping (never in the text: printable() escapes it)


def middle_ellipsis(text: str, width: int) -> str:
    """'native_layer_norm_backward' -> 'native_la…_backward' in `width` columns."""
    if width <= 0:
        return ""
    if len(text) <= width:
        return text
    if width == 1:
        return ELLIPSIS
    tail = (width - 1) // 2
    head = width - 1 - tail
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def short_op(name: str, width: int) -> str:
    """An op name in `width` columns: whole when it fits; else without the shared namespace,
    then without the shared overload, then shortened in the middle."""
    if len(name) <= width:
        return name
    for ns in _COMMON_NAMESPACES:
        if name.startswith(ns) and "." in name[len(ns):]:
            name = name[len(ns):]
            break
    if len(name) <= width:
        return name
    for ov in _COMMON_OVERLOADS:
        if name.endswith(ov):
            name = name[:-len(ov)]
            break
    return middle_ellipsis(name, width)


def short_module(path: str, width: int) -> str:
    """A module path in `width` columns, keeping its end: from a dot when that keeps at
    least half the width, else the last characters."""
    if len(path) <= width:
        return path
    if width <= 1:
        return ELLIPSIS[:width]
    tail = path[-(width - 1):]
    dot = tail.find(".")
    if 0 <= dot < (width - 1) // 2 and dot + 1 < len(tail):
        tail = tail[dot + 1:]
    return ELLIPSIS + tail


def short_place(place: str, width: int) -> str:
    """A source place 'file.py:123' in `width` columns: the line number kept whole, the
    file's name shortened in its middle ('modeling_…_bert.py:293')."""
    if len(place) <= width:
        return place
    name, sep, line = place.rpartition(":")
    if not sep or not line.isdigit():
        return middle_ellipsis(place, width)
    return middle_ellipsis(name, max(width - len(line) - 1, 1)) + ":" + line


def wrap_dotted(path: str, width: int) -> list[str]:
    """A module path over lines of `width`, broken after dots, never inside a name (a name
    longer than a line is shortened in its middle)."""
    parts = [p + "." for p in path.split(".")]
    parts[-1] = parts[-1][:-1]
    return _pack([middle_ellipsis(p, width) if len(p) > width else p for p in parts], width)


def _pack(parts: list[str], width: int) -> list[str]:
    """Parts joined into lines of at most `width` (a part longer than that on a line of its own)."""
    lines, cur = [], ""
    for p in parts:
        if cur and len(cur) + len(p) > width:
            lines.append(cur)
            cur = ""
        cur += p
    if cur:
        lines.append(cur)
    return lines


def wrap_name(name: str, width: int) -> list[str]:
    """A name over lines of `width`, broken after its dots and underscores (`aten.` /
    `convolution_` / `backward.` / `default`), never inside a word; only a word longer than a
    whole line is cut, into lines of its own (nothing of the name is left out)."""
    parts = []
    for p in re.split(r"(?<=[._])", name):
        parts += [p[i:i + width] for i in range(0, len(p), max(width, 1))] if len(p) > width else [p] if p else []
    return _pack(parts, width) or [""]


def wrap_prose(text: str, width: int | None, *, indent: int | None = None) -> list[str]:
    """`text` as lines of at most `width` columns (None: one line), broken at spaces but
    never between a number and its unit or comparison; continuation lines indented two
    more than the first (or `indent`). A word longer than a line is shortened in its middle."""
    if width is None or len(text) <= width:
        return [text]
    lead = len(text) - len(text.lstrip(" "))
    more = " " * (lead + 2 if indent is None else indent)
    glued = _GLUE.sub(_NBSP, text)
    words = glued.split(" ")
    room = width - len(more)
    glued = " ".join(w if len(w) <= room else middle_ellipsis(w, room) for w in words)
    lines = textwrap.wrap(glued, width=width, subsequent_indent=more, break_long_words=False,
                          break_on_hyphens=False)
    return [ln.replace(_NBSP, " ") for ln in lines]
