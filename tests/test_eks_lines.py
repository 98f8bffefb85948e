"""tasks/backends/eks/lines.py: a stream split into lines, an unfinished line's bytes capped."""

from __future__ import annotations

import pytest

from tasks.backends.eks.lines import CUT, LineBuffer

# (name, chunks, cap, lines passed on, what is held at the end)
CASES = [
    ("one chunk", [b"a\nb\n"], 8, [b"a", b"b"], b""),
    ("a line across chunks", [b"ab", b"c\nd"], 8, [b"abc"], b"d"),
    ("empty lines kept", [b"\n\nx\n"], 8, [b"", b"", b"x"], b""),
    ("exactly the cap", [b"abcd", b"\n"], 4, [b"abcd"], b""),
    (
        "over the cap: cut, rest dropped",
        [b"abc", b"def", b"gh\nok\n"],
        4,
        [b"abcd" + CUT, b"ok"],
        b"",
    ),
    ("cut in one chunk", [b"abcdefgh\nok"], 4, [b"abcd" + CUT], b"ok"),
    (
        "the cut line's newline in a later chunk",
        [b"abcdef", b"xyz", b"\n"],
        4,
        [b"abcd" + CUT],
        b"",
    ),
]


@pytest.mark.parametrize(
    ("chunks", "cap", "lines", "rest"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_lines(chunks: list[bytes], cap: int, lines: list[bytes], rest: bytes):
    buf = LineBuffer(cap)
    got = [line for chunk in chunks for line in buf.feed(chunk)]
    assert (got, buf.rest()) == (lines, rest)


def test_a_line_that_never_ends_holds_at_most_the_cap():
    """10 MB without a newline, in the client's 4 KiB reads: one cut line, and never more than
    the cap held (each chunk is scanned once: the old buffer was re-split whole every read)."""
    cap = 64 << 10
    buf = LineBuffer(cap)
    chunk = b"x" * 4096
    out: list[bytes] = []
    most = 0
    for _ in range((10 << 20) // len(chunk)):
        out += buf.feed(chunk)
        most = max(most, buf.held)
    assert most <= cap
    assert out == [b"x" * cap + CUT] and buf.cut == 1
    assert buf.feed(b"tail\nnext\n") == [b"next"]  # the cut line's tail dropped, then as before
