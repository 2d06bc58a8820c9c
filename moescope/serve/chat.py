"""The chat template over the byte tokenizer.

The reference runtime's tokenizer has no special tokens for roles (bytes plus BOS/EOS/PAD), so the template is
plain text the model reads like any other bytes; docs/serve.md shows it:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

Each message is its role in ``<|...|>`` on a line, then its content, then a newline; the prompt ends with an
open ``<|assistant|>`` turn for the model to complete. ``developer`` is rendered as ``system`` (OpenAI's newer
name for it). Content is a string or a list of ``{"type": "text", "text": ...}`` parts (joined); other part
types (images, audio) and tool messages are rejected. No stop string is implied: pass ``stop`` to end at a
turn marker.
"""

from __future__ import annotations

from typing import Iterable

ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def render(messages: Iterable[tuple[str, str]]) -> str:
    """The prompt for ``(role, text)`` messages (roles as in ``ROLE_NAMES``; validated by ``protocol``)."""
    parts = [f"<|{ROLE_NAMES[role]}|>\n{text}\n" for role, text in messages]
    return "".join(parts) + "<|assistant|>\n"
