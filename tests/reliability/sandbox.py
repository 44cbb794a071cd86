"""Run library calls in a worker process that bounds their time and memory and watches their files.

A :class:`Sandbox` keeps one worker (a forkserver child with torch and shardsafe imported) and
runs module-level functions in it, one call at a time. Each call:

- may use at most ``memory_bytes`` of address space beyond what the worker had when the call
  started (``RLIMIT_AS``): a library that trusts a size from a damaged file fails to allocate
  instead of exhausting the machine, and the call is reported with ``memory=True``;
- gets ``timeout`` seconds of the worker's CPU time (``ITIMER_PROF``: ``SIGPROF`` raises in the
  worker), not of wall time: a machine busy with other jobs slows a call down but does not make
  it a hang. The parent kills the worker (stuck in C, or blocked) when the call has used
  ``grace`` more seconds of CPU than that, or when every thread of the worker has slept without
  using CPU for ``grace`` seconds of wall time (a thread that waits for a core or for the disk
  is runnable or in disk wait, never asleep: asleep, it waits for something that does not
  come). All of these report ``hang``. Starting a worker (importing torch) is not part of any call's time;
- is watched by an audit hook (:func:`sys.addaudithook`): every path it opens, lists, renames,
  links or removes, resolved through symlinks, must lie under one of the call's ``roots``;
  others are reported in ``outside`` (reading Python's own modules and installed packages'
  files, and ``/proc``, ``/sys``, ``/dev`` is not counted).

A worker killed by a signal reports ``crashed``; the next call starts a new one.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..helpers import CTX, Watchdog
from .report import Report

__all__ = ["CONTEXT", "Result", "Sandbox"]

# forkserver children start in milliseconds with torch already imported: tests.helpers' context and
# preload list (a process has one forkserver: a second preload list here would replace that one for
# every rank of the test run, and each rank then imported torch.distributed.tensor, fsdp and _dynamo itself)
CONTEXT = CTX

_PATH_EVENTS = {
    "open": (0,),
    "os.listdir": (0,),
    "os.scandir": (0,),
    "os.rename": (0, 1),
    "os.replace": (0, 1),
    "os.link": (0, 1),
    "os.symlink": (0, 1),
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.truncate": (0,),
    "os.chmod": (0,),
}
_MODULE_FILES = (".py", ".pyc", ".so", ".pth", ".typed")


@dataclass
class Result:
    """What one call did."""

    kind: str  # "returned" | "raised" | "hang" | "crashed"
    value: Any = None
    error_type: str = ""  # qualified name of the exception's class
    message: str = ""
    checkpoint_error: bool = False  # the exception is a shardsafe.errors.CheckpointError
    memory: bool = False  # it failed for lack of memory (the bound was hit)
    outside: list[str] = field(default_factory=list)  # accesses outside the call's roots
    seconds: float = 0.0  # wall time, for reports; no outcome depends on it

    def failure(self, outcome: str) -> str:
        """The outcome of a check whose call did not return: ``outcome`` if the call raised; a call
        that hung or whose worker died says nothing about what it checked, and is named so."""
        return {"raised": outcome, "hang": "hang", "crashed": "worker-crash"}[self.kind]

    def abnormal(self) -> str | None:
        """The outcome every campaign gives a call that touched files outside its roots
        (``outside-access``), hung (``hang``) or whose worker died (``worker-crash``); None for a
        call that returned or raised, which each campaign judges by what it checks."""
        if self.outside:
            return "outside-access"
        return {"hang": "hang", "crashed": "worker-crash"}.get(self.kind)

    def bounded_error(self) -> str:
        """The outcome of a call that raised: ``detected`` for a shardsafe ``CheckpointError``,
        ``memory-bound`` where the memory bound stopped it, else ``foreign-exception:<type>``."""
        if self.checkpoint_error:
            return "detected"
        return "memory-bound" if self.memory else f"foreign-exception:{self.error_type}"


class CallTimeout(BaseException):
    """Raised in the worker when a call runs past its time."""


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _serve(conn, memory_bytes: int) -> None:
    import resource
    import signal
    import tempfile

    from shardsafe.errors import CheckpointError

    local = threading.local()
    state: dict[str, Any] = {"active": False, "roots": (), "outside": []}
    # where imports come from; not a folder holding the temporary directory (the campaigns' files
    # are there: a script run from /tmp has /tmp on sys.path)
    temp = os.path.realpath(tempfile.gettempdir()) + os.sep
    module_dirs = tuple(sorted(
        d for d in {os.path.realpath(p) + os.sep for p in [*sys.path, sys.prefix, sys.base_prefix] if p}
        if not temp.startswith(d)
    ))

    def allowed(event: str, real: str, read_only: bool = False) -> bool:
        if any(real == r.rstrip(os.sep) or real.startswith(r) for r in state["roots"]):
            return True
        if real.startswith(("/proc/", "/sys/", "/dev/")):
            return True
        if event in ("os.listdir", "os.scandir") or real.endswith(_MODULE_FILES) or read_only:  # imports, package metadata
            return (real + os.sep).startswith(module_dirs)
        return False

    def hook(event: str, args: tuple) -> None:
        which = _PATH_EVENTS.get(event)
        if which is None or not state["active"] or getattr(local, "busy", False):
            return
        local.busy = True
        try:
            for i in which:
                if i >= len(args) or not isinstance(args[i], (str, bytes, os.PathLike)):
                    continue
                raw = os.fsdecode(args[i])
                real = os.path.realpath(raw)
                flags = args[2] if event == "open" and len(args) > 2 else None
                if isinstance(flags, int) and flags & os.O_NOFOLLOW:  # a final symlink is refused, not followed
                    real = os.path.join(os.path.realpath(os.path.dirname(raw) or "."), os.path.basename(raw))
                # a read of an installed package's own files (entry points, metadata, a zipped stdlib) is an import's
                read_only = event == "open" and isinstance(flags, int) and flags & os.O_ACCMODE == os.O_RDONLY
                if not allowed(event, real, read_only):
                    seen = f"{event} {raw}" + (f" -> {real}" if real != os.path.abspath(raw) else "")
                    state["outside"].append(seen)
        except Exception:  # noqa: BLE001 - a hook must not break the call it watches
            pass
        finally:
            local.busy = False

    # what Python and torch do once per process, outside any call: probe the temporary directory
    # with a file; import dynamo (an optimizer's load_state_dict does), which makes a cache folder
    tempfile.gettempdir()
    import torch

    opt = torch.optim.Adam(torch.nn.Linear(1, 1).parameters())
    opt.load_state_dict(opt.state_dict())
    sys.addaudithook(hook)

    def on_alarm(signum, frame):
        raise CallTimeout()

    signal.signal(signal.SIGPROF, on_alarm)
    conn.send("ready")
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, args, roots, timeout = msg
        limit = _vm_size() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        state.update(roots=tuple(os.path.realpath(r) + os.sep for r in roots), outside=[], active=True)
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_PROF, timeout)  # CPU time of the whole worker, every thread
        try:
            try:
                res = Result("returned", value=fn(*args))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
                state["active"] = False
        except CallTimeout:
            res = Result("hang", message=f"no answer within {timeout} s of CPU time")
        except BaseException as e:  # noqa: BLE001 - reported
            text = f"{e}"
            res = Result(
                "raised", error_type=f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins."),
                message=text[:4000], checkpoint_error=isinstance(e, CheckpointError),
                memory=isinstance(e, MemoryError) or "allocate" in text or "can't start new thread" in text,
            )
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        res.seconds = time.monotonic() - start
        res.outside = sorted(set(state["outside"]))[:10]
        try:
            conn.send(res)
        except Exception as e:  # noqa: BLE001 - an unpicklable value
            conn.send(Result("raised", error_type="UnpicklableResult", message=repr(e)))


class Sandbox:
    """One worker process; see the module docstring. Use as a context manager."""

    def __init__(self, *, memory_bytes: int = 1 << 30, timeout: float = 20.0, grace: float = 15.0) -> None:
        self.memory_bytes = memory_bytes
        self.timeout = timeout
        self.grace = grace
        self._proc = None
        self._conn = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The worker's process id (None before the first call and after a kill)."""
        return None if self._proc is None else self._proc.pid

    def _start(self) -> str | None:
        """Start a worker and wait until it is ready; returns why it is not (None: it is)."""
        parent, child = CONTEXT.Pipe()
        self._proc = CONTEXT.Process(target=_serve, args=(child, self.memory_bytes), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            why = self._watch(self.timeout)
            if why is None and self._conn.recv() == "ready":
                return None
        except (EOFError, OSError):
            why = f"it died while starting (exit code {self._proc.exitcode})"
        self._stop(kill=True)
        return why

    def _watch(self, cpu_budget: float) -> str | None:
        """Wait until the worker has something to say (None), or return why it never will: it used
        ``cpu_budget + grace`` seconds of CPU, or every thread of it slept without using CPU for
        ``grace`` seconds of wall time (:class:`tests.helpers.Watchdog`)."""
        watch = Watchdog([self._proc.pid], idle_s=self.grace, cpu_s=cpu_budget + self.grace)
        while not self._conn.poll(0.1):
            why = watch.check()
            if why is not None:
                return f"no answer: {why} (killed)"
        return None

    def _stop(self, kill: bool) -> None:
        if self._proc is None:
            return
        if kill:
            self._proc.kill()
        else:
            try:
                self._conn.send(None)
            except OSError:
                pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        self._stop(kill=False)

    def call(self, fn: Callable[..., Any], *args: Any, roots: list[str], timeout: float | None = None) -> Result:
        """Run ``fn(*args)`` in the worker; paths under ``roots`` may be touched. ``timeout`` (or
        the sandbox's) is in seconds of the worker's CPU time."""
        if self._proc is None:
            why = self._start()
            if why is not None:
                return Result("crashed", error_type="start", message=f"the worker did not start: {why}")
        t = self.timeout if timeout is None else timeout
        start = time.monotonic()
        try:
            self._conn.send((fn, args, list(roots), t))
            why = self._watch(t)
            if why is None:
                return self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self._proc.join(timeout=5)
            code = self._proc.exitcode
            self._stop(kill=True)
            return Result("crashed", error_type=f"exit {code}", message=f"the worker died (exit code {code})",
                          seconds=time.monotonic() - start)
        self._stop(kill=True)
        return Result("hang", message=why, seconds=time.monotonic() - start)


@contextmanager
def campaign(
    name: str, workdir: str | None, *, sandbox: Sandbox | None = None, **options: Any
) -> Iterator[tuple[Report, str, Sandbox]]:
    """A campaign's report, working directory (a temporary one unless ``workdir``, removed at
    the end) and sandbox (``sandbox``, or one made with ``options`` and closed at the end); the
    report's ``seconds`` is set when the block ends."""
    report = Report(name)
    start = time.monotonic()
    root = workdir or tempfile.mkdtemp(prefix=f"shardsafe-{name}-")
    box = sandbox or Sandbox(**options)
    try:
        yield report, root, box
    finally:
        if sandbox is None:
            box.close()
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
        report.seconds = time.monotonic() - start
