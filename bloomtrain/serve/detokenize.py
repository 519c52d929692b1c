"""Incremental detokenization with stop strings (vLLM's detokenizer: prefix and read offsets).

A byte-level BPE token can end inside a multi-byte character, so text is released only once it
decodes cleanly. Text that could be the start of a stop string is held back until it is known
not to be; a stop string found ends the text before it (OpenAI's `stop`). Special tokens
(`<s>`, `</s>`, padding...) produce no text, as vLLM's and HF's decoding skip them by default.
"""
from __future__ import annotations


class TextStream:
    """The text of one sequence's generated tokens, released piece by piece (`push`, then
    `finish` once the sequence ends)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (),
                 skip_ids: frozenset[int] = frozenset()):
        self.tokenizer, self.stop, self.skip_ids = tokenizer, stop, skip_ids
        self.max_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.check_stop = True

    def push(self, token_id: int, check_stop: bool = True) -> str:
        """Add a token; returns the text it releases. `check_stop` False (before `min_tokens`
        tokens are out, as vLLM) lets a stop string pass without ending the text."""
        self.check_stop = check_stop
        if token_id in self.skip_ids:
            return ""
        self.ids.append(token_id)
        new = self._decoded_since_read()
        if new and not new.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._append(new)
        return self._release(self._held())

    def finish(self) -> str:
        """The rest of the text once the sequence ended: what was held back for the stop
        strings, and tokens that never decoded cleanly (a cut-off byte sequence), with
        replacement characters, as decoding all the tokens at once gives them."""
        if not self.stopped and self.read_offset < len(self.ids):
            self._append(self._decoded_since_read())
            self.prefix_offset = self.read_offset = len(self.ids)
        return self._release(0)

    def _decoded_since_read(self) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        return full[len(prefix):] if len(full) > len(prefix) else ""

    def _append(self, new: str) -> None:
        old = len(self.text)
        self.text += new
        if self.stop and self.check_stop:
            # Each stop string is looked for only where it would end in the new text (vLLM's
            # rule): in the longest one's window, a shorter one that was let pass whole before
            # min_tokens would be found again, and cut the text back into what was released.
            hits = [i for i in (self.text.find(s, max(0, old - len(s) + 1)) for s in self.stop)
                    if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True

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


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids a stream leaves out of its text, as transformers' decode(skip_special_tokens=True)
    does (Tokenizer.special_ids)."""
    return tokenizer.special_ids()
