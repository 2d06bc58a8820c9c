"""Make text from traces safe for a terminal: control and escape sequences are shown, never executed.

Token text is model output and prompts are user input; either may hold ESC sequences (OSC title changes,
cursor moves, hyperlinks) or other C0/C1 controls. ``sanitize`` replaces every control character except
newline and tab with a visible escape (``\\x1b``), so an ESC sequence prints as ``\\x1b]0;title\\x07``.
JSON output is inert by encoding, but is sanitised too, so a consumer that prints a field is safe.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def sanitize(text: str, *, keep_newlines: bool = True) -> str:
    """``text`` with control characters (and bidi overrides) replaced by visible escapes."""
    out = _CONTROL.sub(_escape, text)
    if not keep_newlines:
        out = out.replace("\n", "\\n").replace("\t", "\\t")
    return out


def sanitize_tree(obj):
    """Sanitise every string in a JSON-like structure."""
    if isinstance(obj, str):
        return sanitize(obj)
    if isinstance(obj, list):
        return [sanitize_tree(x) for x in obj]
    if isinstance(obj, dict):
        return {k: sanitize_tree(v) for k, v in obj.items()}
    return obj
