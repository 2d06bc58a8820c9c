"""Output tokens -> the text a client receives, the same way for a stream and for a whole response.

Tokens are bytes, so a character may take several tokens: an incremental UTF-8 decoder emits each character
once it is complete (invalid bytes become U+FFFD, as ``tokenizer.decode``). With stop strings, the last
``longest stop`` characters are held back while streaming (the engine stops *after* the token that completes
a stop, and it reaches us with that token: none of the stop may have been sent yet), and a response that
ended on a stop has it trimmed, as OpenAI does. The trace store keeps the full output: it matches the tokens.
"""

from __future__ import annotations

import codecs

# engine finish reasons -> OpenAI's; "cancelled" and "timeout" never reach a client as a normal answer
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "max_seq_len": "length"}


class TextAssembler:
    """Feed tokens in order; ``feed`` returns the text that may be sent now, ``finish`` the rest."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        # the longest stop's length: the text of a stop that completes at the next token is still held then
        self._hold = max((len(s) for s in stop), default=0)
        self._pending = ""
        self.sent = ""  # everything returned so far

    def feed(self, token: int) -> str:
        if not 0 <= token < 256:  # EOS (the last token) and other specials carry no text
            return ""
        self._pending += self._decoder.decode(bytes((token,)))
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return ""
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self.sent += out
        return out

    def finish(self, finish_reason: str) -> str:
        """The held-back text, less the stop string when the request ended on one."""
        rest = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        if finish_reason == "stop":
            whole = self.sent + rest
            for s in self._stop:
                if whole.endswith(s) and len(s) <= len(rest):
                    rest = rest[:len(rest) - len(s)]
                    break
        self.sent += rest
        return rest


def whole_text(tokens: tuple[int, ...], stop: tuple[str, ...], finish_reason: str) -> str:
    """The text of a finished request (what a non-streaming response carries)."""
    asm = TextAssembler(stop)
    for t in tokens:
        asm.feed(t)
    asm.finish(finish_reason)
    return asm.sent

