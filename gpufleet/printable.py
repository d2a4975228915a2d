"""Text from a host made safe to print: one sanitiser for every terminal line and report.

GPU process names, lock owner records, unit descriptions... are written by whoever runs on a
host. Printed raw, an escape sequence rewrites the operator's terminal (moves the cursor,
hides the lines before it, sets the window title) and a bidirectional override or a newline
forges a Markdown table row. Control characters (C0, DEL, C1), Unicode format characters
(bidi overrides, zero-width), separators other than the space, and unassigned code points
come out as visible escapes (str.isprintable's definition).
"""
from __future__ import annotations

def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: object, newlines: bool = False) -> str:
    """`text` with every control or format character escaped (`\\x1b`, `\\u202e`); with
    `newlines`, line breaks are kept (a multi-line message), else escaped too."""
    value = text if isinstance(text, str) else str(text)
    if value.isprintable():   # the common case, in C
        return value
    out = []
    for char in value:
        if char == "\n" and newlines:
            out.append(char)
        elif char.isprintable():
            out.append(char)
        elif char == "\t":
            out.append(" ")
        else:
            out.append(_escape(char))
    return "".join(out)

