"""`Progress`: a long step's progress on stderr: tqdm on a terminal, plain periodic lines otherwise.

On a terminal a tqdm bar shows documents, rate and elapsed time (and ETA when the total is known).
When stderr is a file or a pipe (a cluster job's log), a bar's carriage returns would garble it, so
a plain line is written every ``every_s`` seconds instead, e.g.::

    pack: 120,000 documents, 61.4M tokens (2.0M tokens/s), 31 s
    pack: done, 200,000 documents, 102.3M tokens (2.0M tokens/s), 14.2 MB/s of input, 51 s

Callers report absolute counts (``update(documents, tokens)``); updates are cheap (a counter and,
every 256 calls, a clock read), so a per-document call is fine.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any


class Progress:
    """Progress of one step; see the module docstring.

    Args:
        label: what is running (``"pack"``).
        stream: where to write (default stderr).
        every_s: seconds between plain lines.
        input_bytes: size of the input, for an MB/s figure at the end (optional).
        tty: force the bar (True) or plain lines (False); default: ``stream.isatty()``.
    """

    def __init__(
        self,
        label: str,
        *,
        stream: IO[str] | None = None,
        every_s: float = 10.0,
        input_bytes: int | None = None,
        tty: bool | None = None,
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.input_bytes = input_bytes
        self.start = self.last = time.perf_counter()
        self.documents = self.tokens = self._calls = 0
        interactive = tty if tty is not None else bool(getattr(self.stream, "isatty", bool)())
        self._bar: Any = None
        if interactive:
            from tqdm import tqdm

            self._bar = tqdm(desc=label, unit=" docs", file=self.stream, unit_scale=True)

    def update(self, documents: int, tokens: int) -> None:
        """Report the counts so far."""
        self._calls += 1
        if self._bar is not None:
            self._bar.update(documents - self.documents)
        self.documents, self.tokens = documents, tokens
        if self._bar is None and self._calls % 256 == 0:
            now = time.perf_counter()
            if now - self.last >= self.every_s:
                self.last = now
                self._line(now, final=False)

    def close(self, *, done: bool = True) -> None:
        """End the bar, or write the last plain line: "done" only when the work is (``done``)."""
        if self._bar is not None:
            self._bar.close()
        if done:  # a failure's one line is the error itself
            self._line(time.perf_counter(), final=True)

    def _line(self, now: float, *, final: bool) -> None:
        elapsed = max(now - self.start, 1e-9)
        mbs = (
            f", {self.input_bytes / elapsed / 1e6:.1f} MB/s of input"
            if final and self.input_bytes
            else ""
        )
        self.stream.write(
            f"{self.label}: {'done, ' if final else ''}{self.documents:,} documents, "
            f"{self.tokens / 1e6:.1f}M tokens ({self.tokens / elapsed / 1e6:.1f}M tokens/s){mbs}, "
            f"{elapsed:.0f} s\n"
        )
        self.stream.flush()
