"""``CheckpointManager``: step directories, "latest", retention, resume and preemption saves in one
place, on top of ``Checkpointer.async_save``.

Layout under ``root`` (a local path or an object-store URL)::

    root/step_00001000/metadata.json    <- a step is committed iff its metadata.json checks out
    root/step_00001000/*.safetensors
    root/step_00002000/...

Each step is one checkpoint with one commit: the model (``model.*``), the optimizer
(``optim.*``), every ``extra`` object (``extra.<name>.rank<r>...``, see
:mod:`shardsafe.adapters.stateful`) and a small record (``manager``: step, world size, extra
names). ``load_model_and_optim_state`` and ``unshard_model_state`` read a step directory as
they read any checkpoint.

Call order: every rank of the process group creates the manager and calls each method
together, in the same order (``latest_step``, ``all_steps`` and ``signal_received`` are local
and may be called anywhere). The group's first rank lists, cleans and deletes; the others learn
its results through one broadcast at start and then keep the same list by the same rules.
"""

from __future__ import annotations

import logging
import os
import re
import signal as signal_module
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._args import check_arg, check_bool
from ._progress import Progress, rank_progress
from .adapters.stateful import ExtraRestore, check_extra, extra_targets, extra_values
from .api import load_model_and_more, model_and_optim_values
from .dist import Comm, background_comm, get_comm
from .engine.background import AsyncSave
from .engine.writer import abandon_save, async_save_state
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RankMismatchError,
)
from .format.metadata import METADATA_FILENAME, StorageMetadata, sealed_data_files
from .knobs import KNOBS, Knobs
from .memtier import MemoryTier, RestoreReport, SavedInMemory, default_memory_dir, newest_complete_step
from .storage import Directory, Location, Storage, open_storage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["CheckpointManager", "step_dir_name"]

log = logging.getLogger(__name__)

RECORD_KEY = "manager"
_STEP_DIR = re.compile(r"step_(\d{8,})")


def step_dir_name(step: int) -> str:
    """The directory of ``step``: ``step_`` and the step in at least 8 digits (``step_00001000``)."""
    return f"step_{step:08d}"


def _parse_step(name: str) -> int | None:
    m = _STEP_DIR.fullmatch(name)
    if m is None or step_dir_name(int(m.group(1))) != name:  # only the canonical spelling is ours
        return None
    return int(m.group(1))


class CheckpointManager:
    """Saves and restores the training state of one run, one step directory per checkpoint.

    - ``root``: a local path, a ``file://`` or object-store URL (``s3://bucket/prefix``...), or a
      storage opened with :func:`shardsafe.storage.open_storage` (for explicit options).
    - ``keep_last``: keep only the newest ``keep_last`` committed steps (default: keep all);
      ``keep_every``: besides those, keep every step that is a multiple of it.
    - ``save_interval``: :meth:`should_save` is true for steps that are multiples of it.
    - ``async_save``: :meth:`save` returns once the state is staged and the checkpoint is
      written and committed in the background (else it returns once committed).
    - ``save_on_signal``: a signal (``signal.SIGTERM``) whose arrival on any rank makes
      :meth:`should_save` true on every rank at its next call. The manager's handler only
      counts it: the process goes on, and the handler that was there before is not called;
      :meth:`close` puts it back. Needs the main thread.
    - ``process_group``: the ranks that take part (default: all); ``knobs``: tunables.
    - ``memory_dir``: turns on the memory tier (README, "The memory tier"): a node-local directory
      in RAM (a tmpfs: ``/dev/shm/...``; ``True``: one under ``/dev/shm`` named after ``root``),
      the same path for the ranks of one node. Then :meth:`save` saves every step there (call it
      every step; ``save_interval`` is not consulted), copies each rank's file to ``replicas``
      other nodes (a ring over the nodes, or rings inside ``replica_groups``: lists of node
      numbers) through the process group, and writes a step to ``root`` from memory every
      ``persist_every`` steps and on a ``save_on_signal`` signal. :meth:`restore` restores from
      the surviving nodes' memory when it holds a complete step at least as new as ``root``'s
      newest, else from ``root``; :attr:`last_restore` says which. ``node``: this rank's node (an
      int or a name; default: torchrun's ``GROUP_RANK``, else the host name).

    Creating the manager is collective: the first rank removes the directories of steps that
    never committed (names of the form ``step_<digits>`` without ``metadata.json``: left by a
    crash), then every rank learns the committed steps. A step counts as committed only when
    its ``metadata.json`` checks out against its own checksum and every data file it names is
    there; any other step directory is *damaged*: logged (WARNING), never counted, never
    restored, never deleted by retention, and replaced only by a save of the same step.
    **One job at a time per root**: a second job's manager would remove the first one's step in
    progress.
    """

    def __init__(
        self,
        root: Location,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        save_interval: int | None = None,
        async_save: bool = True,
        save_on_signal: int | None = None,
        process_group: ProcessGroup | None = None,
        knobs: Knobs | None = None,
        memory_dir: str | os.PathLike[str] | bool | None = None,
        replicas: int = 1,
        persist_every: int | None = 100,
        node: int | str | None = None,
        replica_groups: list[list[int]] | None = None,
    ) -> None:
        func = "CheckpointManager"
        _check_memory_args(func, memory_dir, replicas, persist_every, node, replica_groups)
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every), ("save_interval", save_interval)):
            _check_positive(func, name, value)
        check_bool(func, "async_save", async_save)
        if save_on_signal is not None and not (isinstance(save_on_signal, int) and not isinstance(save_on_signal, bool)):
            raise TypeError(f"{func}: argument 'save_on_signal' must be a signal number (signal.SIGTERM) or None, got {save_on_signal!r}")
        if save_on_signal is not None and threading.current_thread() is not threading.main_thread():
            raise CheckpointError(f"{func}: save_on_signal needs the manager to be created in the main thread (Python runs signal handlers there)")
        check_arg(func, "knobs", knobs, Knobs, optional=True)
        self.keep_last, self.keep_every, self.save_interval = keep_last, keep_every, save_interval
        self._async = async_save
        self._group = process_group
        self._knobs = knobs or KNOBS
        self._root = _open_root(root)
        self.root = self._root.url
        self._comm = get_comm(process_group=process_group, call="shardsafe.CheckpointManager", timeout_s=self._knobs.collective_timeout_s)
        # the first rank cleans up and lists; the broadcast is also the barrier that keeps the others from racing it
        self._steps: list[int]
        self._damaged: dict[int, str]  # step -> why it does not count (the same on every rank)
        self._steps, self._damaged = self._comm.broadcast(self._scan)
        self._inflight: tuple[int, AsyncSave[Any]] | None = None
        self._reading: set[int] = set()  # steps a restore of this process is reading: retention keeps them
        self._lock = threading.Lock()
        self._decided: tuple[int, bool] | None = None  # the last should_save answer, reused by save() at that step
        self._closed = False
        self._signal = save_on_signal
        self._signals = 0  # signals received by this process (counted by the handler)
        self._signals_seen = 0  # how many of them a should_save has taken into account
        self._requested = False  # a signal asked for a save that has not been made yet (the same on every rank)
        self.signal_received = False
        """True on every rank once :meth:`should_save` has seen a ``save_on_signal`` signal on any rank."""
        self._previous_handler: Any = None
        self.persist_every = persist_every
        self.last_restore: RestoreReport | None = None
        """Which tier the last :meth:`restore` read (``.tier``: "memory", "durable" or "none"), and
        how many bytes this rank read from its own node's memory and received from other nodes."""
        self._memory: MemoryTier | None = None
        if memory_dir is True:
            memory_dir = default_memory_dir(self.root)
        if memory_dir is not None:
            self._memory = MemoryTier(
                os.fspath(memory_dir), node=node, replicas=replicas, groups=replica_groups, comm=self._comm, root_url=self.root,
                timeout_s=self._knobs.collective_timeout_s,
            )
            # the background saves' group, made now while every rank is here: a save's caller
            # then meets no other rank, not even the first time
            background_comm(self._comm, timeout_s=self._knobs.collective_timeout_s)
        if save_on_signal is not None:
            self._install_handler(save_on_signal)

    # --- queries (local) ---------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first: those found when the manager started and those it
        committed since, less those it deleted. A save still in flight is not among them until
        a call that waits for it (``save``, ``restore``, ``wait_until_finished``, ``close``)."""
        return list(self._steps)

    def latest_step(self) -> int | None:
        """The newest committed step (see :meth:`all_steps`), or None."""
        return self._steps[-1] if self._steps else None

    def damaged_steps(self) -> dict[int, str]:
        """The step directories that are not counted, and why: a ``metadata.json`` that does not
        check out or names a data file that is missing (found when the manager started), or a
        step whose restore found damage. A save of such a step replaces its directory."""
        return dict(self._damaged)

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` saves: the step is neither committed nor in flight,
        and it is a multiple of ``save_interval`` or a ``save_on_signal`` signal reached any rank.

        Without ``save_on_signal`` it runs no collective; with it, every rank calls it together
        and it runs one (an all-reduce of one int; see the README for what it costs)."""
        self._check_open("should_save")
        _check_step("CheckpointManager.should_save", step)
        if self._signal is not None:
            seen = self._signals  # read once: a signal arriving now counts at the next call
            mine = seen > self._signals_seen
            self._signals_seen = seen
            if self._comm.any(mine):
                self._requested = True
                self.signal_received = True
        taken = step in self._steps or (self._inflight is not None and self._inflight[0] == step)
        due = self._requested or (self.save_interval is not None and step % self.save_interval == 0)
        self._decided = (step, due and not taken)
        return self._decided[1]

    # --- save ---------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: nn.Module | None = None,
        optim: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
        force: bool = False,
        *,
        progress: bool | Callable[[int, int], None] | None = None,
    ) -> bool:
        """Save ``model``, ``optim`` and every ``extra`` object as step ``step``, one checkpoint
        with one commit, if :meth:`should_save` says so or ``force``; returns whether it saved.

        First waits for the previous save to commit (raising its error, if it failed, on every
        rank) and applies the retention policy. With ``async_save`` it returns once the state
        is staged: training may then change every tensor and every extra object. ``extra``
        maps names to objects with ``state_dict()`` / ``load_state_dict()`` (an LR scheduler, a
        stateful data loader, :class:`~shardsafe.RNGState`); each rank's state is stored under
        its own keys. ``force`` on a step that is already committed raises
        ``CheckpointExistsError``: steps are never replaced.

        ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
        callable is called on every rank as ``progress(done, total)`` with the bytes of this
        rank's data file written so far, out of its tensor bytes, from the thread that writes (with
        ``async_save``, the background thread, after this call has returned).

        With ``memory_dir`` every call saves (to memory; its copies to other nodes are made in
        the background, and the next call waits for them) and returns True; the step also goes to
        ``root`` when it is a multiple of ``persist_every``, when a ``save_on_signal`` signal
        arrived, or with ``force``. It runs no collective in the caller's thread (but for
        ``save_on_signal``'s one int): the ranks check in and compare their extra names in the
        background, so a rank that does not call save, or passes other extra names, makes every
        rank's next call that waits for the save (``save``, ``wait_until_finished``, ``restore``,
        ``close``) raise, and nothing of the step is committed; an error of this rank's own
        objects is raised here, and by the others' next waiting call at once.
        """
        func = "CheckpointManager.save"
        self._check_open("save")
        _check_step(func, step)
        _check_model(func, model, optim)
        extra = check_extra(func, extra)
        check_bool(func, "force", force)
        bar = rank_progress(progress, func, self._comm.is_coordinator)
        self._finish_inflight()
        persist = True
        if self._memory is not None:  # every step goes to memory; the durable root gets some
            decided = self._decided if self._decided is not None and self._decided[0] == step else None
            if decided is None:
                self.should_save(step)  # takes in a save_on_signal signal on every rank
            persist = force or self._requested or (self.persist_every is not None and step % self.persist_every == 0)
        elif not force:
            decided = self._decided if self._decided is not None and self._decided[0] == step else None
            if not (decided[1] if decided is not None else self.should_save(step)):
                return False
        self._decided = None
        if step in self._steps and persist:
            raise CheckpointExistsError(
                f"{self._step_url(step)}: step {step} is already committed; a manager never replaces a step. Save under "
                "another step, or delete that directory first"
            )
        built: dict[str, Any] = {}
        memory = self._memory
        if memory is not None:
            persist = persist and step not in self._steps
        damaged = self._damaged.get(step)
        # the ranks meet in the background; only committed-or-not travels back, not the metadata
        save_comm = get_comm(
            process_group=self._group, call="shardsafe.CheckpointManager.save", timeout_s=self._knobs.collective_timeout_s, arrive=False
        )
        # with the memory tier the caller's thread runs no collective at all (every step pays
        # for it): the ranks check in, clear the step's directories and compare extra names
        # inside the background save's first gather
        comm = self._call_comm() if memory is None else save_comm

        def clear() -> None:  # before any rank writes
            if memory is not None:  # a stale copy of this step (saved again after a restore)
                memory.clear_step(step_dir_name(step))
            if damaged is not None and comm.is_coordinator and persist:
                log.warning("CheckpointManager: step %d under %s is damaged (%s); removing it to save step %d afresh", step, self.root, damaged, step)
                self._remove(step_dir_name(step))

        def build() -> list[str]:
            if memory is None:  # the all-gather below is the barrier
                clear()
            built.update(model_and_optim_values(model, optim) if model is not None else {})
            built.update(extra_values(extra, comm.rank))
            built[RECORD_KEY] = {"step": step, "world_size": comm.world_size, "extra": sorted(extra)}
            return sorted(extra)

        def same_names(names: list[list[str]]) -> None:
            if any(n != names[0] for n in names):
                detail = "; ".join(f"rank {comm.global_ranks[r]}: {n}" for r, n in enumerate(names))
                raise RankMismatchError(f"{func}: step {step}: every rank must pass the same extra names ({detail})")

        if memory is None:
            # one collective: an object that cannot be stored fails every rank here, at once, and
            # ranks that pass different extra names are told so
            names = comm.all_gather(build)
            comm.raise_failures(names)
            self._damaged.pop(step, None)
            same_names(names)  # type: ignore[arg-type]
            handle = async_save_state(
                self._root.child(step_dir_name(step)), built, save_overwrite=False, allow_pickle=False, comm=save_comm,
                knobs=self._knobs, want_meta=False, progress=bar,
            )
        else:
            try:
                mine = build()
            except Exception as e:  # the other ranks learn it at their background check-in, at once
                abandon_save(save_comm, self._knobs, e)
                raise
            self._damaged.pop(step, None)
            durable = self._root.child(step_dir_name(step)) if persist else None
            timeout = self._knobs.collective_timeout_s

            stream = memory.stream(step_dir_name(step))  # the copies, sent while tier 0 is written

            def tiers(out: tuple[Any, list[str]]) -> SavedInMemory:  # in the background, once tier 0 committed
                side = background_comm(save_comm, timeout_s=timeout)
                return memory.after_commit(side, step, step_dir_name(step), out[1], durable, stream)

            handle = async_save_state(
                memory.step_storage(step_dir_name(step)), built, save_overwrite=False, allow_pickle=False, comm=save_comm,
                knobs=self._knobs, want_meta=False, progress=bar, result=tiers, first=clear, agree=(mine, same_names), tee=stream,
            )
        self._inflight = (step, handle)
        self._requested = False
        if not self._async:
            self._finish_inflight()
        return True

    def wait_until_finished(self) -> None:
        """Wait until the save in flight (if any) is committed, then apply the retention policy;
        raises the save's error (on every rank) if it failed."""
        self._check_open("wait_until_finished")
        self._finish_inflight()

    # --- restore -------------------------------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        model: nn.Module | None = None,
        optim: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
        *,
        progress: bool | Callable[[int, int], None] | None = None,
    ) -> int | None:
        """Load step ``step`` (default: the latest committed) into ``model``, ``optim`` and every
        ``extra`` object, in place, in one pass; returns the step loaded, or None when ``step`` is
        None and nothing is committed yet (nothing is loaded then).

        Damage: when ``step`` is None and the newest step turns out damaged while it loads
        (``CorruptCheckpointError``, ``IncompleteCheckpointError``: a bad checksum, a missing or
        truncated data file), the restore falls back to the next older committed step, and so
        on, logging a WARNING that names the damaged step and the one loaded: check the step it
        returns. The damaged step is no longer counted (:meth:`damaged_steps`). With ``step``
        given there is no fallback: the error names the damaged step and the newest step that
        is still counted. Other errors (a model that does not match, a storage failure) are
        raised as they are, without trying another step.

        Any world size and parallelism loads the model and optimizer (as
        :func:`~shardsafe.load_model_and_optim_state` does, with ``validate=True``). Each rank
        restores the extra state its own rank saved; on a world size that grew, a new rank gets
        the state all saved ranks shared, and where they differed, ``MissingKeyError``, except
        for objects that keep their state then (``RNGState``; see
        :func:`shardsafe.adapters.stateful.extra_targets`). Tensors in extra state are handed to
        ``load_state_dict`` on the CPU. Waits for a save in flight first.

        ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
        callable is called on every rank as ``progress(done, total)`` with the bytes of this
        rank's targets filled so far (from the thread that loads).
        """
        func = "CheckpointManager.restore"
        self._check_open("restore")
        if step is not None:
            _check_step(func, step)
        _check_model(func, model, optim)
        extra = check_extra(func, extra)
        bar = rank_progress(progress, func, self._comm.is_coordinator)
        self._finish_inflight()
        why = ""
        if self._memory is not None:
            got, why = self._restore_memory(step, model, optim, extra, bar)
            if got is not None:
                return got
        self.last_restore = RestoreReport(None, "none", why=why)
        fallback = step is None
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        elif step not in self._steps:
            damaged = f"; it is damaged: {self._damaged[step]}" if step in self._damaged else ""
            raise IncompleteCheckpointError(
                f"{self._step_url(step)}: no committed checkpoint of step {step} under {self.root}{damaged} (committed steps: "
                f"{_steps_text(self._steps)})"
            )
        tried: list[int] = []
        while True:
            try:
                with self._being_read(step):
                    self._load(step, model, optim, extra, bar)
                break
            except (CorruptCheckpointError, IncompleteCheckpointError) as e:  # the same class on every rank
                self._steps.remove(step)
                self._damaged[step] = _first_line(e)
                tried.append(step)
                older = [s for s in self._steps if s < step]
                if not fallback or not older:
                    newest = self._steps[-1] if self._steps and not fallback else None
                    raise _named(e, self._damage_text(tried, newest)) from e
                log.warning(
                    "CheckpointManager.restore: step %d under %s is damaged (%s); restoring step %d, the newest "
                    "older committed step, instead",
                    step, self.root, self._damaged[step], older[-1],
                )
                step = older[-1]
        self._decided = None
        self.last_restore = RestoreReport(step, "durable", why=why)
        if self._memory is not None:
            self._memory.forget_after(step_dir_name(step))
            log.warning("CheckpointManager.restore: restored step %d from the durable tier %s: %s", step, self.root, why)
        return step

    def _restore_memory(self, step: int | None, model: Any, optim: Any, extra: dict[str, Any], bar: Progress | None) -> tuple[int | None, str]:
        """Restore from the nodes' memory if it holds ``step`` (None: the newest step it holds
        whole, unless the durable tier holds a newer one); the step restored, or None and why not."""
        assert self._memory is not None
        comm = self._call_comm("restore")
        inventories = self._memory.gather(comm)
        chosen = newest_complete_step(inventories, below=step)
        durable = self.latest_step()
        if chosen is None or (step is not None and chosen != step):
            what = f"step {step}" if step is not None else "any step"
            held = sorted({s for inv in inventories.values() for s in inv})
            return None, f"the surviving nodes' memory does not hold {what} whole (steps seen in memory: {held})"
        if step is None and durable is not None and durable > chosen:
            return None, f"the durable tier's step {durable} is newer than memory's newest complete step {chosen}"
        try:
            report = self._memory.load(
                comm, chosen, step_dir_name(chosen), inventories,
                lambda storage, fetch: self._load_from(storage, model, optim, extra, bar, fetch),
            )
        except (CorruptCheckpointError, IncompleteCheckpointError) as e:  # the same class on every rank
            why = f"restoring step {chosen} from memory failed: {_first_line(e)}"
            log.warning("CheckpointManager.restore: %s; falling back to the durable tier", why)
            return None, why
        self.last_restore = report
        self._decided = None
        self._memory.forget_after(step_dir_name(chosen))
        log.info(
            "CheckpointManager.restore: step %d from memory: %d bytes from this node, %d from other nodes, 0 from the durable tier",
            chosen, report.local_bytes, report.peer_bytes,
        )
        return chosen, ""

    def _damage_text(self, tried: list[int], intact: int | None) -> str:
        steps = ", ".join(map(str, tried))
        head = f"CheckpointManager.restore: step {steps} under {self.root} {'is' if len(tried) == 1 else 'are'} damaged"
        if intact is None:
            return f"{head}, and no older committed step is left to restore (damaged steps: {sorted(self._damaged)})"
        return f"{head}; the newest committed step is {intact}: restore(step={intact}), or restore() for the newest that loads"

    def _load(self, step: int, model: Any, optim: Any, extra: dict[str, Any], progress: Progress | None) -> None:
        self._load_from(self._root.child(step_dir_name(step)), model, optim, extra, progress)

    def _load_from(
        self, storage: Storage, model: Any, optim: Any, extra: dict[str, Any], progress: Progress | None, fetch: Any = None,
    ) -> None:
        comm = self._call_comm("restore")
        plan: list[ExtraRestore] = []

        def targets(meta: StorageMetadata) -> dict[str, Any]:
            if not extra:
                return {}
            record = meta.objects.get(RECORD_KEY)
            if not (isinstance(record, dict) and type(record.get("world_size")) is int and record["world_size"] > 0):
                raise CheckpointError(
                    f"{storage.url}: the checkpoint has no {RECORD_KEY!r} record of a CheckpointManager save, so its extra "
                    f"state cannot be restored (was it written by another function?); restore without extra="
                )
            plan.extend(extra_targets(meta, extra, comm.rank, comm.world_size, record["world_size"], storage.url))
            return {k: t for item in plan for k, t in item.targets.items()}

        def apply(loaded: dict[str, Any]) -> None:
            for item in plan:
                item.apply(loaded, storage.url)

        load_model_and_more(
            storage, comm, model, optim, knobs=self._knobs, validate=True, more_targets=targets, more_apply=apply, progress=progress,
            fetch=fetch,
        )

    # --- end ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the save in flight (raising its error), apply the retention policy and put
        back the signal handler that was there before. Idempotent."""
        if self._closed:
            return
        try:
            self._finish_inflight()
        finally:
            self._closed = True
            self._uninstall_handler()
            self._root.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:  # the block failed: still wait for the save in flight, without hiding the block's error
            self.close()
        except Exception:  # noqa: BLE001 - logged; the block's exception goes on
            log.exception("CheckpointManager(%s): closing after an error, the save in flight failed too", self.root)

    def __repr__(self) -> str:
        inflight = f", in flight: {self._inflight[0]}" if self._inflight else ""
        return f"CheckpointManager({self.root!r}, steps {_steps_text(self._steps)}{inflight})"

    # --- internals ------------------------------------------------------------------------------------

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager.{method}: the manager of {self.root} is closed; create a new one")

    def _call_comm(self, method: str = "save") -> Comm:
        return get_comm(process_group=self._group, call=f"shardsafe.CheckpointManager.{method}", timeout_s=self._knobs.collective_timeout_s)

    def _step_url(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/{step_dir_name(step)}"

    def _scan(self) -> tuple[list[int], dict[int, str]]:
        """(First rank.) Remove the step directories without ``metadata.json``; the committed
        steps, and the damaged ones with the reason."""
        steps, damaged = [], {}
        for name in self._root.list_dirs():
            step = _parse_step(name)
            if step is None:
                continue
            child = self._root.child(name)
            try:
                files = child.list()
                if METADATA_FILENAME not in files:
                    log.debug("CheckpointManager: removing %s/%s: it never committed (no %s)", self.root, name, METADATA_FILENAME)
                    self._remove(name)
                    continue
                damage = _damage(child, set(files))
            finally:
                child.close()
            if damage is None:
                steps.append(step)
            else:
                damaged[step] = damage
                log.warning(
                    "CheckpointManager: step %d under %s is not counted as committed: %s (left in place; a save of step %d "
                    "replaces it)", step, self.root, damage, step,
                )
        return sorted(steps), damaged

    def _remove(self, name: str) -> None:
        """Delete a step directory, ``metadata.json`` first, so that a removal cut short leaves
        no committed checkpoint with files missing. Failures are logged, never raised."""
        child = self._root.child(name)
        try:
            child.delete(METADATA_FILENAME)
            for f in child.list():
                child.delete(f)
            self._root.remove_dir(name)
        except (CheckpointError, OSError) as e:
            log.warning("CheckpointManager: could not delete %s/%s: %s", self.root, name, e)
        finally:
            child.close()

    def _finish_inflight(self) -> None:
        """Wait for the save in flight; once committed, list its step and apply retention."""
        if self._inflight is None:
            return
        step, handle = self._inflight
        self._inflight = None  # a failed save is reported once, then forgotten
        out = handle.wait()
        if isinstance(out, SavedInMemory) and not out.persisted:
            return
        if step not in self._steps:
            self._steps = sorted([*self._steps, step])
        self._retain(step)

    def _retain(self, just: int) -> None:
        """Apply ``keep_last`` / ``keep_every`` after step ``just`` committed. Every rank drops
        the same steps from its list; the first rank deletes them."""
        if self.keep_last is None:
            return
        with self._lock:
            keep = set(self._steps[-self.keep_last :]) | {just, self._steps[-1]} | self._reading
        if self.keep_every is not None:
            keep |= {s for s in self._steps if s % self.keep_every == 0}
        drop = [s for s in self._steps if s not in keep]
        if not drop:
            return
        self._steps = [s for s in self._steps if s in keep]
        if self._comm.is_coordinator:
            for s in drop:
                log.debug("CheckpointManager: deleting step %d under %s (keep_last=%s, keep_every=%s)", s, self.root, self.keep_last, self.keep_every)
                self._remove(step_dir_name(s))

    @contextmanager
    def _being_read(self, step: int) -> Iterator[None]:
        with self._lock:
            self._reading.add(step)
        try:
            yield
        finally:
            with self._lock:
                self._reading.discard(step)

    # --- signals --------------------------------------------------------------------------------------

    def _install_handler(self, signum: int) -> None:
        def handler(received: int, frame: Any) -> None:  # no logging here: it may hold a lock the main thread holds
            self._signals += 1

        try:
            self._previous_handler = signal_module.signal(signum, handler)
        except ValueError as e:  # not the main thread, or not a signal number
            raise CheckpointError(
                f"CheckpointManager: cannot handle signal {signum} ({e}); save_on_signal needs the manager to be created "
                "in the main thread of the main interpreter, with a valid signal number"
            ) from None

    def _uninstall_handler(self) -> None:
        if self._signal is not None and self._previous_handler is not None:
            try:
                signal_module.signal(self._signal, self._previous_handler)
            except ValueError:  # closed from another thread: the handler stays, counting into a closed manager
                log.warning("CheckpointManager: could not restore the handler of signal %d (not the main thread)", self._signal)
            self._previous_handler = None


def _damage(step: Storage, files: set[str]) -> str | None:
    """Why the step directory ``step`` (listing ``files``) does not hold a committed checkpoint,
    or None: its ``metadata.json`` checks out against its own checksum and names no missing file."""
    where = f"{step.url.rstrip('/')}/{METADATA_FILENAME}"
    try:
        named = sealed_data_files(step.read(METADATA_FILENAME), where=where)
    except FileNotFoundError:
        return f"{METADATA_FILENAME} vanished while the manager listed the step"
    except (CheckpointError, OSError) as e:  # damaged, another library's (Megatron's own metadata.json), unreadable
        return _first_line(e)
    missing = sorted(named - files)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"{where} names data file(s) {', '.join(missing[:3])}{more}, which are missing"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _named(e: CheckpointError, text: str) -> CheckpointError:
    """An error of ``e``'s class whose message is ``text`` followed by ``e``'s."""
    try:
        return type(e)(f"{text}: {e}", rank_errors=e.rank_errors)
    except TypeError:  # a subclass with another signature
        return CheckpointError(f"{text}: {e}", rank_errors=e.rank_errors)


def _open_root(root: Location) -> Directory:
    # a storage object is checked here, before open_storage checks it against the whole Storage protocol
    storage = root if isinstance(root, Directory) else open_storage(root) if isinstance(root, (str, os.PathLike)) else root
    if not isinstance(storage, Directory):
        raise TypeError(
            f"CheckpointManager: argument 'root' must be a path, a URL or a storage that lists sub-directories "
            f"(shardsafe.storage.Directory: list_dirs, child, remove_dir), got {type(storage).__qualname__}"
        )
    return storage


def _check_positive(func: str, name: str, value: Any) -> None:
    check_arg(func, name, value, int, optional=True)
    if isinstance(value, bool):
        raise TypeError(f"{func}: argument {name!r} must be an int or None, got bool {value!r}")
    if value is not None and value < 1:
        raise CheckpointError(f"{func}: {name} must be a positive integer or None, got {value!r}")


def _check_memory_args(func: str, memory_dir: Any, replicas: Any, persist_every: Any, node: Any, groups: Any) -> None:
    if memory_dir is not None and memory_dir is not True and not isinstance(memory_dir, (str, os.PathLike)):
        raise TypeError(
            f"{func}: argument 'memory_dir' must be a local path (a tmpfs such as /dev/shm/...), True (a directory under "
            f"/dev/shm named after root) or None, got {type(memory_dir).__qualname__} {memory_dir!r}"
        )
    if isinstance(memory_dir, str) and "://" in memory_dir:
        raise CheckpointError(f"{func}: memory_dir must be a local directory (a tmpfs such as /dev/shm/...), got the URL {memory_dir!r}")
    if type(replicas) is not int:
        raise TypeError(f"{func}: argument 'replicas' must be an int, got {type(replicas).__qualname__} {replicas!r}")
    if replicas < 0:
        raise CheckpointError(f"{func}: replicas must be >= 0 (copies of each step on other nodes), got {replicas}")
    _check_positive(func, "persist_every", persist_every)
    if node is not None and (isinstance(node, bool) or not isinstance(node, (int, str))):
        raise TypeError(f"{func}: argument 'node' must be an int, a str or None, got {type(node).__qualname__} {node!r}")
    if groups is not None and not (isinstance(groups, (list, tuple)) and all(isinstance(g, (list, tuple)) and all(type(n) is int for n in g) for g in groups)):
        raise TypeError(f"{func}: argument 'replica_groups' must be a list of lists of node numbers, got {groups!r}")


def _check_step(func: str, step: Any) -> None:
    if type(step) is not int:
        raise TypeError(f"{func}: argument 'step' must be an int, got {type(step).__qualname__} {step!r}")
    if step < 0:
        raise CheckpointError(f"{func}: step must be >= 0, got {step}")


def _check_model(func: str, model: Any, optim: Any) -> None:
    check_arg(func, "model", model, nn.Module, optional=True)
    check_arg(func, "optim", optim, torch.optim.Optimizer, optional=True)
    if optim is not None and model is None:
        raise CheckpointError(f"{func}: optim was given without its model; the optimizer's state is stored by parameter name, so pass model= too")


def _steps_text(steps: list[int]) -> str:
    if len(steps) <= 8:
        return str(steps)
    return f"[{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}] ({len(steps)})"
