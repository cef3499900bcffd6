"""Progress lines for long phases a person waits for: planning a large search, loading a
checkpoint, probing the machine.

    planning llama3-70b on 512 GPUs: 212 of 559 meshes, 14,310 plans estimated, 1.2 s

At most one line a second, on stderr, and only where someone watches: when stderr is a terminal,
or when asked with ``DTORCH_PROGRESS=1`` (``DTORCH_PROGRESS=0`` silences it even on a terminal).
Under pytest, in CI logs and in scheduler output files it is quiet unless asked. On a terminal a
line rewrites itself (carriage return); elsewhere each update is a line of its own. Nothing is
printed for a phase that ends within the first second. Importable from every stage (no torch).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

from dtorch import env


def wanted(stream: IO[str] | None = None) -> bool:
    """Whether progress lines should be printed to `stream` (default stderr)."""
    flag = env.current().progress
    if flag in ("0", "1"):
        return flag == "1"
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """Rate-limited progress of one phase: `update(text)` prints ``label: text, 1.2 s`` at most
    every `every` seconds (and never in the first `every` seconds); `close(text)` prints the final
    line, if anything was printed before."""

    def __init__(self, label: str, *, stream: IO[str] | None = None, every: float = 1.0,
                 enabled: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.label, self.every, self.clock = label, every, clock
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = wanted(self.stream) if enabled is None else enabled
        self.t0 = clock()
        self._last = self.t0
        self.printed = 0
        self._tty = False
        if self.enabled:
            try:
                self._tty = bool(self.stream.isatty())
            except (AttributeError, ValueError):
                pass
        self._lock = threading.Lock()
        self.note = ""

    def _emit(self, text: str, final: bool) -> None:
        line = f"{self.label}: {text}, {self.clock() - self.t0:.1f} s"
        if self._tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.printed += 1

    def update(self, text: str) -> bool:
        """Print `text` if a line is due; returns whether it printed."""
        if not self.enabled:
            return False
        now = self.clock()
        if now - self._last < self.every:
            return False
        with self._lock:
            self._last = now
            self._emit(text, final=False)
        return True

    def close(self, text: str = "done") -> None:
        if self.enabled and self.printed:
            with self._lock:
                self._emit(text, final=True)


class Ticker(Progress):
    """A phase with no steps of its own to count (a checkpoint read, a measurement): after
    `start()`, a thread prints ``label: <note>, 3.0 s`` every `every` seconds (set ``.note`` to say
    which part runs; default "running") until `stop()`, which prints ``label: done``. A daemon
    thread: a phase that raises and never stops ends with the process."""

    def __init__(self, label: str, **kw):
        super().__init__(label, **kw)
        self.note = "running"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Ticker:
        if self.enabled and self._thread is None:
            def tick() -> None:
                while not self._stop.wait(self.every / 4):
                    self.update(self.note)

            self._thread = threading.Thread(target=tick, name="dtorch-progress", daemon=True)
            self._thread.start()
        return self

    def stop(self, text: str = "done") -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
            self.close(text)


@contextlib.contextmanager
def phase(label: str, **kw) -> Iterator[Ticker]:
    """`Ticker` as a context manager: ``with phase("loading checkpoint step-100"): ...``."""
    t = Ticker(label, **kw).start()
    try:
        yield t
    finally:
        t.stop()


def search_progress(label: str, **kw) -> tuple[Callable[[int, int, int], None], Progress]:
    """The `progress` callback of `dtorch.plan.search.search` printing through a `Progress`:
    ``label: 212 of 559 meshes, 14,310 plans estimated, 1.2 s``. Close the Progress after."""
    p = Progress(label, **kw)

    def cb(meshes_done: int, meshes_total: int, evaluated: int) -> None:
        p.update(f"{meshes_done:,} of {meshes_total:,} meshes, {evaluated:,} plans estimated")

    return cb, p
