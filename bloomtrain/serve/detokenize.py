"""Incremental detokenization with stop strings (vLLM's detokenizer: prefix and read offsets).

A byte-level BPE token can end inside a multi-byte character, so text is released only once it
decodes cleanly. Text that could be the start of a stop string is held back until it is known
not to be; a stop string found ends the text before it (OpenAI's `stop`).
"""
from __future__ import annotations


class TextStream:
    """The text of one sequence's generated tokens, released piece by piece (`push`, then
    `finish` once the sequence ends)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int, check_stop: bool = True) -> str:
        """Add a token; returns the text it releases. `check_stop` False (before `min_tokens`
        tokens are out, as vLLM) lets a stop string pass without ending the text."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            start = max(0, len(self.text) - self.max_stop + 1)
            self.text += new
            if self.stop and check_stop:
                hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self.text = self.text[:min(hits)]
                    self.stopped = True
        return self._release(self._held())

    def finish(self) -> str:
        return self._release(0)

    def _held(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        if self.stopped:
            return 0
        for k in range(min(self.max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _release(self, held: int) -> str:
        end = max(self.emitted, len(self.text) - held)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
