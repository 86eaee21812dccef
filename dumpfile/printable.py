"""Text from a dump (op, module and argument names, attribute strings, file names) made
safe to print on a terminal.

A dump is input from outside: a name in it can hold ANSI escape sequences (colours,
cursor moves, an OSC that sets the window title or writes a hyperlink), a carriage return
that overwrites what was printed before it, a newline that forges a line of output, or
bidirectional overrides that display text in another order than it is stored. Printed as
stored, `accucmp ls`, compare's summary and an error message would pass them to the
user's terminal. Every such character is written as its Python escape instead (`\\x1b`,
`\\r`, `\\n`, `\\u202e`): the text stays readable and greppable, and nothing in it is
executed by the terminal. The files we write (csv, json, HTML with its own escaping,
.h5) keep the names as stored: they are data, not a terminal.
"""

from __future__ import annotations

import re

# C0 controls (tab and newline included: a name holding them would split a row or a
# one-line message), DEL, C1 controls (0x9b is a one-byte CSI on some terminals), the
# bidirectional embeddings, overrides and isolates, and lone surrogates (bytes that were
# not UTF-8, decoded with surrogateescape)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")

_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(m: re.Match) -> str:
    c = m.group(0)
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def printable(text: object) -> str:
    """`text` with every character a terminal would act on written as its escape."""
    s = text if isinstance(text, str) else str(text)
    return _UNSAFE.sub(_escape, s) if _UNSAFE.search(s) else s
