"""Byte-level tokenizer: token = UTF-8 byte (0..255), plus BOS, EOS and PAD. Needs no vocabulary file and
can encode any text, including the escape sequences and emoji the fault scenarios use."""

from __future__ import annotations

BOS, EOS, PAD = 256, 257, 258


def encode(text: str, *, bos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def decode(ids: list[int]) -> str:
    """Bytes back to text; specials are dropped and invalid UTF-8 becomes U+FFFD (never raises)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def token_text(token: int) -> str:
    """A printable label for one token: the byte as text when it is printable ASCII, else an escape."""
    if token == BOS:
        return "<bos>"
    if token == EOS:
        return "<eos>"
    if token == PAD:
        return "<pad>"
    if 0x20 <= token < 0x7F:
        return chr(token)
    return f"\\x{token:02x}" if 0 <= token < 256 else f"<{token}>"
