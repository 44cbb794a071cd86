"""Progress of long calls: ``progress=True`` draws a tqdm bar on stderr; a callable is called
with ``(bytes done, bytes in all)``; ``None`` / ``False`` shows nothing."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

Progress = Callable[[int, int], None]


def progress_callback(progress: bool | Progress | None, what: str) -> Progress | None:
    """The callback for a public ``progress`` argument (see the module docstring)."""
    if progress is None or progress is False:
        return None
    if callable(progress):
        return progress
    if progress is not True:
        raise TypeError(f"{what}: argument 'progress' must be a bool, a callable or None, got {type(progress).__name__}")
    return tqdm_bar(what)


def rank_progress(progress: bool | Progress | None, what: str, is_coordinator: bool) -> Progress | None:
    """The callback for the ``progress`` argument of a call every rank makes: the bar
    (``True``) is drawn by the coordinator only; a callable is called on every rank, with that
    rank's bytes. Arguments are checked on every rank."""
    fn = progress_callback(progress, what)
    return None if progress is True and not is_coordinator else fn


def targets_done(progress: Progress | None, targets: list[Any]) -> Callable[[Any], None] | None:
    """A ``done(target)`` callback for :meth:`Reader.load_tensors` reporting ``progress(bytes of
    targets filled, bytes of all of targets)`` (each a ``LocalTensor``); ``None`` without
    ``progress``. Reports ``(0, total)`` at once, so a bar shows from the start."""
    add = bytes_counter(progress, sum(v.numel() * v.element_size() for t in targets for v in t.views))
    if add is None:
        return None
    return lambda target: add(sum(v.numel() * v.element_size() for v in target.views))


def bytes_counter(progress: Progress | None, total: int) -> Callable[[int], None] | None:
    """An ``add(nbytes)`` callback reporting ``progress(bytes added so far, total)``; ``None``
    without ``progress``. Reports ``(0, total)`` at once, so a bar shows from the start."""
    if progress is None:
        return None
    done = 0
    progress(0, total)

    def add(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        progress(done, total)

    return add


def tqdm_bar(what: str) -> Progress:
    """A callback drawing a bytes bar (throughput, ETA) on stderr; closed once done reaches the total."""
    from tqdm import tqdm

    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def conversion_progress(progress: bool | Callable[[int, int], None] | None, total: int, url: str) -> Callable[[int], None]:
    """A converter's progress: ``progress(done, total)`` for a callable, a line on stderr
    redrawn at most twice a second for True (or None on a terminal), nothing for False."""
    if callable(progress):
        return lambda done: progress(done, total)
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return lambda done: None
    state = {"last": 0.0}

    def show(done: int) -> None:
        now = time.monotonic()
        if done < total and now - state["last"] < 0.5:
            return
        state["last"] = now
        pct = 100.0 * done / total if total else 100.0
        end = "\n" if done >= total else "\r"
        print(f"converting to {url}: {done / 1e6:.1f} / {total / 1e6:.1f} MB ({pct:.0f}%)", end=end, file=sys.stderr, flush=True)

    return show
