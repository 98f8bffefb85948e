"""A byte stream (a pod's log, a watch's events) split into lines, holding at most ``cap`` bytes
of a line not yet ended.

Appending each chunk to what was held and splitting the whole again took time quadratic in a
line's length, and memory without bound, for a pod that prints without a newline (a progress
bar, a binary dump). Here each chunk is scanned once; a line longer than ``cap`` is passed on cut
(its first ``cap`` bytes and :data:`CUT`) and the rest of it dropped up to its newline.
"""

from __future__ import annotations

CUT = b" [line cut: too long]"


class LineBuffer:
    def __init__(self, cap: int):
        self.cap = cap
        self.cut = 0  # lines cut so far
        self._parts: list[bytes] = []
        self._held = 0
        self._dropping = False  # in the rest of a line already passed on cut

    @property
    def held(self) -> int:
        """Bytes of the unfinished line held: never more than ``cap``."""
        return self._held

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines ``chunk`` ends (without their newline), in order."""
        out: list[bytes] = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._hold(chunk[start:end], out)
            if not self._dropping:
                out.append(b"".join(self._parts))
            self._parts, self._held, self._dropping = [], 0, False
            start = end + 1
        self._hold(chunk[start:], out)
        return out

    def rest(self) -> bytes:
        """What is held of a line the stream never ended."""
        return b"".join(self._parts)

    def _hold(self, piece: bytes, out: list[bytes]) -> None:
        if self._dropping or not piece:
            return
        room = self.cap - self._held
        if len(piece) <= room:
            self._parts.append(piece)
            self._held += len(piece)
            return
        out.append(b"".join([*self._parts, piece[:room], CUT]))
        self.cut += 1
        self._parts, self._held, self._dropping = [], 0, True
