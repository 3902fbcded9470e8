"""Generated token ids -> text pieces that are safe to send: whole UTF-8 characters, stop strings cut.

A byte-level BPE token can end in the middle of a multi-byte character, and a
stop string can arrive split over several tokens. `IncrementalText` decodes
the whole reply so far after each burst of tokens and releases only text
that can no longer change: it holds back an unfinished character (the
decoder shows it as U+FFFD) and any tail that could still grow into a stop
string. When a stop string appears, the text ends just before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalText:
    """The text of a growing reply, released piece by piece (see the module docstring)."""

    def __init__(
        self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), hidden: Sequence[int] = ()
    ):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.hidden = set(hidden)
        """Token ids never shown (end-of-turn, EOS): they end a reply without being part of it."""
        self.ids: list[int] = []
        self.sent = 0
        """Characters of the reply already released."""
        self.stopped = False
        """A stop string was found; the reply ends before it."""

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; the newly releasable text (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.extend(t for t in tokens if t not in self.hidden)
        text = self.decode(self.ids)
        hits = [at for at in (text.find(s) for s in self.stop) if at != -1]
        if hits:
            self.stopped = True
            return self._release(text[: min(hits)])
        if text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for its other bytes
            text = text[:-1]
        return self._release(text[: len(text) - self._held(text)])

    def finish(self) -> str:
        """The rest of the text once no more tokens come (an unfinished character is shown as is)."""
        if self.stopped:
            return ""
        return self._release(self.decode(self.ids))

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, text: str) -> str:
        if len(text) <= self.sent:
            return ""
        piece, self.sent = text[self.sent :], len(text)
        return piece
