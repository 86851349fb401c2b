"""Streaming text that never shows part of a stop string.

The engine ends a request when its text contains a stop string, and the stop string is not part of
the answer. A stream must therefore hold back any tail of the text that could still grow into a stop
string (``"EN"`` while ``"END"`` is a stop string), or its deltas would show characters that the
final answer does not contain.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringBuffer:
    """Accumulates text and releases what can no longer turn into a stop string.

    ``push`` returns the newly releasable text; ``finish`` cuts the text at the stop string that
    ended the request (if any) and returns the rest (``settle`` instead takes the final text as
    given). The released deltas concatenate to ``text``.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(stop)
        self.text = ""
        self.released = 0

    def _releasable(self) -> int:
        """End of the text that can be shown: before the first complete stop string, else before the
        longest tail that could still grow into one."""
        text, start = self.text, self.released
        if not self.stop:
            return len(text)
        found = [at for s in self.stop if (at := text.find(s, start)) >= 0]
        if found:
            return min(found)
        longest = max(map(len, self.stop), default=1) - 1
        for size in range(min(len(text) - start, longest), 0, -1):
            if any(s.startswith(text[-size:]) for s in self.stop):
                return len(text) - size
        return len(text)

    def push(self, delta: str) -> str:
        self.text += delta
        return self._release(self._releasable())

    def finish(self, stop_reason: str | None = None) -> str:
        """End of the span. With ``stop_reason`` (the stop string that ended the request), the text
        is cut where it starts."""
        if stop_reason:
            at = self.text.find(stop_reason, self.released)
            if at >= 0:
                self.text = self.text[:at]
        return self._release(len(self.text))

    def settle(self, final_text: str) -> str:
        """End with the authoritative final text (which extends what was released): for callers
        whose source already cut the stop string off. Returns the rest."""
        self.text = final_text
        return self._release(len(final_text))

    def _release(self, end: int) -> str:
        if end <= self.released:
            return ""
        delta = self.text[self.released : end]
        self.released = end
        return delta
