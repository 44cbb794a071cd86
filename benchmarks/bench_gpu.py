"""One GPU: shardsafe's save and load of a training state held on the device, against torch DCP
and against the copy limits of the hardware, in one process.

Usage::

    python benchmarks/bench_gpu.py [--device cuda|cpu] [--gib 4] [--reps 5] [--methods NAME,...]
        [--budget-s 420] [--dir /tmp/shardsafe-bench-gpu] [--out benchmarks/results]

A process group of world size 1 (``cpu:gloo,cuda:nccl`` on CUDA, ``gloo`` on CPU, on a free
port) and a training state on the device: a Llama-style model's fp32 parameters and AdamW state
(:func:`bench_async.training_spec`, about ``--gib`` GiB), plain seeded ``randn`` tensors in a
flat ``{name: tensor}`` dict. Every method below runs once first (buffers allocated, threads
started: reported apart as "first"), then ``--reps`` times in an order rotated every repetition:

- ``d2h-memcpy`` (the limit): every tensor copied into one preallocated, touched, pinned host
  buffer, ``non_blocking`` on a side stream (after the current one), then synchronized;
- ``shardsafe-async``: ``Checkpointer().async_save(dir, state)``, one ``Checkpointer`` kept for
  the run; ``shardsafe-sync``: ``Checkpointer().save``;
- ``dcp-sync``: ``dcp.save`` with a ``FileSystemWriter``; ``dcp-async``: ``dcp.async_save`` at its
  defaults (thread); ``dcp-async-cached``: the same with ``FileSystemWriter(cache_staged_state_dict=
  True)`` kept from save to save (pinned staging buffers, reused; the path is reset per save);
- ``dcp-stager-pinned``: ``dcp.async_save`` with a kept ``DefaultStager`` (pinned memory,
  non-blocking copies, staging in a thread); the caller may change the tensors once its staging
  future is done, so that is where its blocked time ends (torch 2.11 closes the stager after each
  staging, pytorch#183413: then a new one per save, as its users must);
- loads into existing device tensors, each from a checkpoint saved once beforehand:
  ``shardsafe-load`` (``Checkpointer().load``), ``dcp-load`` (``dcp.load``, ``FileSystemReader``),
  and ``h2d-memcpy`` (the limit: the pinned buffer copied back, ``non_blocking``, synchronized).
  Before each load the page cache is dropped (``/proc/sys/vm/drop_caches`` where writable, else
  ``posix_fadvise(DONTNEED)`` on the checkpoint's files); the line ``cache:`` says which. Every
  load's result is compared with the state (``torch.equal``), outside the clock.

Measured: **blocked**, from the call until the caller may change every tensor (for a synchronous
save or a load, the whole call); **durable**, from the call until committed (``wait()`` /
``result()``). ``torch.cuda.synchronize()`` precedes every clock; times are ``perf_counter``.
Peak host RSS and ``torch.cuda.max_memory_allocated`` growth are taken per run (both reset
before it). Each save goes to a directory removed (outside the clock) before it; every save
fsyncs. After the timed runs, one ``shardsafe-async`` save is checked: every tensor is changed
(``add_(1)``) as soon as ``async_save`` returns, then the checkpoint, loaded into zeroed tensors,
must equal the state as it was when saved (``VERIFY`` line).

``--device cpu`` runs the same with pinned memory off (to test the script where there is no
GPU); methods that need CUDA print ``SKIP <method>: <reason>``, as does any method that fails
(the others go on). A repetition is not started if it would end past ``--budget-s`` seconds.
Prints a markdown table and one ``GPU ...`` line of ratios; writes ``gpu.json`` to ``--out``
(rewritten after every repetition).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import traceback
from statistics import median
from typing import Any

from bench_async import training_spec
from iobench.harness import PeakRSS, drop_cache, free_port, trim_heap
from iobench.report import machine

_GiB = 1 << 30
SAVES = ("d2h-memcpy", "shardsafe-async", "shardsafe-sync", "dcp-sync", "dcp-async", "dcp-async-cached", "dcp-stager-pinned")
LOADS = ("shardsafe-load", "dcp-load", "h2d-memcpy")
METHODS = SAVES + LOADS
DCP_ASYNC = ("dcp-async", "dcp-async-cached", "dcp-stager-pinned")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bench:
    """The state, the load targets, the pinned buffer and every method's kept objects; each
    method is ``run(name) -> (blocked_s, durable_s | None)``."""

    def __init__(self, dev: str, gib: float, root: str) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        import shardsafe

        self.torch, self.dcp, self.root = torch, dcp, root
        self.cuda = dev == "cuda"
        self.dev = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        spec, self.desc = training_spec(int(gib * _GiB))
        g = torch.Generator(device=self.dev).manual_seed(0)
        self.state = {n: torch.randn(s, dtype=dt, generator=g, device=self.dev) for n, s, dt in spec}
        self.targets = {n: torch.zeros_like(t) for n, t in self.state.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        views, at = [], 0
        for t in self.state.values():
            views.append(self.buf[at : at + t.numel() * t.element_size()])
            at += views[-1].numel()
        as_bytes = [t.reshape(-1).view(torch.uint8) for t in self.state.values()]
        self.d2h = list(zip(views, as_bytes))  # (destination, source) pairs
        self.h2d = [(t.reshape(-1).view(torch.uint8), v) for t, v in zip(self.targets.values(), views)]
        self.stream = torch.cuda.Stream() if self.cuda else None
        self._copy(self.d2h)  # touches the buffer: it now holds the state's bytes
        self.ours_async, self.ours_sync, self.ours_load = shardsafe.Checkpointer(), shardsafe.Checkpointer(), shardsafe.Checkpointer()
        self.cached_writer: Any = None
        self.stager: Any = None
        self.stagers_renewed = 0  # see prepare()
        self.cache_mode = "none"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _copy(self, pairs: list) -> None:
        """Copy each (destination, source) pair: non-blocking on the side stream on CUDA."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        self.stream.synchronize()

    # ------------------------------------------------------------ preparation (outside the clock)

    def setup(self, name: str) -> None:
        """What a method needs once: its kept objects, the checkpoint a load reads."""
        dcp = self.dcp
        if name == "dcp-async-cached" and not self.cuda:
            raise RuntimeError("FileSystemWriter's staging cache is pinned memory: needs CUDA")
        if name == "dcp-stager-pinned":
            self.stager = self._new_stager()
        if name == "shardsafe-load":
            shutil.rmtree(self.path("load-shardsafe"), ignore_errors=True)
            self.ours_load.save(self.path("load-shardsafe"), self.state)
        if name == "dcp-load":
            shutil.rmtree(self.path("load-dcp"), ignore_errors=True)
            dcp.save(self.state, storage_writer=dcp.FileSystemWriter(self.path("load-dcp")))

    def _new_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # torch >= 2.9

        on = self.cuda  # pinned memory and non-blocking copies need CUDA
        return DefaultStager(StagingOptions(use_pinned_memory=on, use_shared_memory=False, use_async_staging=True,
                                            use_non_blocking_copy=on))

    def prepare(self, name: str) -> None:
        """Before each run: a fresh save directory, or a cold page cache and zeroed targets."""
        gc.collect()
        trim_heap()
        if name == "dcp-stager-pinned" and not getattr(getattr(self.stager, "_state_dict_stager", None), "_deepcopy_dispatch", 1):
            # torch 2.11 closes a DefaultStager's copier (and drops its cached pinned storages) after every
            # staging, so it cannot stage twice (pytorch#183413, fixed after 2.11): a new one per save, as a user must
            self.stager.close()
            self.stager, self.stagers_renewed = self._new_stager(), self.stagers_renewed + 1
        if name in SAVES:
            shutil.rmtree(self.path(name), ignore_errors=True)
            return
        for t in self.targets.values():
            t.zero_()
        if name != "h2d-memcpy":
            self.cache_mode = drop_page_cache(self.path("load-shardsafe" if name == "shardsafe-load" else "load-dcp"))

    def check(self, name: str) -> bool:
        """After a load: every target equals the state, bit for bit."""
        return all(self.torch.equal(self.targets[n], t) for n, t in self.state.items()) if name in LOADS else True

    # ------------------------------------------------------------ the methods (inside the clock)

    def run(self, name: str) -> tuple[float, float | None]:
        dcp, path = self.dcp, self.path(name)
        self.sync()
        t0 = time.perf_counter()
        committed: Any = None
        if name == "d2h-memcpy":
            self._copy(self.d2h)
        elif name == "h2d-memcpy":
            self._copy(self.h2d)
        elif name == "shardsafe-async":
            committed = self.ours_async.async_save(path, self.state).committed
        elif name == "shardsafe-sync":
            self.ours_sync.save(path, self.state)
        elif name == "dcp-sync":
            dcp.save(self.state, storage_writer=dcp.FileSystemWriter(path))
        elif name == "dcp-async":
            committed = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(path))
        elif name == "dcp-async-cached":
            if self.cached_writer is None:  # kept: its staged state dict is the cache
                self.cached_writer = dcp.FileSystemWriter(path, cache_staged_state_dict=True)
            committed = dcp.async_save(self.state, checkpoint_id=path, storage_writer=self.cached_writer)
        elif name == "dcp-stager-pinned":
            committed = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(path), async_stager=self.stager)
        elif name == "shardsafe-load":
            self.ours_load.load(self.path("load-shardsafe"), self.targets)
        elif name == "dcp-load":
            dcp.load(self.targets, storage_reader=dcp.FileSystemReader(self.path("load-dcp")))
        else:
            raise ValueError(f"unknown method {name}")
        if committed is not None and hasattr(committed, "staging_completion"):  # DCP's AsyncSaveResponse
            committed.staging_completion.result()
            committed = committed.upload_completion
        self.sync()
        blocked = time.perf_counter() - t0
        if committed is None:
            return blocked, (None if name.endswith("memcpy") or name in LOADS else blocked)
        committed.result()
        return blocked, time.perf_counter() - t0

    def verify_async(self) -> dict:
        """One ``shardsafe-async`` save whose tensors change as soon as it returns: the
        checkpoint must hold the state as it was at the call."""
        torch, path = self.torch, self.path("verify")
        shutil.rmtree(path, ignore_errors=True)
        expect = {n: t.clone() for n, t in self.state.items()}
        h = self.ours_async.async_save(path, self.state)
        staged = h.staged.done()
        for t in self.state.values():
            t.add_(1)
        h.wait()
        for t in self.targets.values():
            t.zero_()
        self.ours_load.load(path, self.targets)
        bad = [n for n, t in expect.items() if not torch.equal(self.targets[n], t)]
        changed = all(not torch.equal(self.state[n], t) for n, t in expect.items() if t.numel())
        for n, t in expect.items():
            self.state[n].copy_(t)
        self.sync()
        shutil.rmtree(path, ignore_errors=True)
        return dict(ok=not bad and changed, staged_at_return=staged, mismatched=bad[:5], n_mismatched=len(bad),
                    state_changed=changed)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def drop_page_cache(path: str) -> str:
    """Drop the page cache: all of it (``drop_caches``, root) or ``path``'s files (fadvise)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    try:
        drop_cache(path)
        return "fadvise"
    except OSError:
        return "none"


# ---------------------------------------------------------------- summary


def _med(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return median(vals) if vals else None


def summarize(records: list[dict], nbytes: int) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for m in METHODS:
        timed = [r for r in records if r["method"] == m and r["rep"] >= 0]
        first = [r for r in records if r["method"] == m and r["rep"] < 0]
        if not timed and not first:
            continue
        blocked = [r["blocked_s"] for r in timed]
        durable = [r["durable_s"] for r in timed if r["durable_s"] is not None]
        row = dict(
            n=len(timed), blocked_s=_med(blocked), blocked_min=min(blocked) if blocked else None,
            durable_s=_med(durable), durable_min=min(durable) if durable else None,
            first_blocked_s=first[0]["blocked_s"] if first else None, first_durable_s=first[0]["durable_s"] if first else None,
            rss_mib=_med([r["rss_mib"] for r in timed]), first_rss_mib=first[0]["rss_mib"] if first else None,
            cuda_mib=_med([r["cuda_mib"] for r in timed]), first_cuda_mib=first[0]["cuda_mib"] if first else None,
            exact=all(r["exact"] for r in timed + first),
        )
        row["blocked_gbps"] = nbytes / row["blocked_s"] / 1e9 if row["blocked_s"] else None
        row["durable_gbps"] = nbytes / row["durable_s"] / 1e9 if row["durable_s"] else None
        rows[m] = row
    return rows


def ratios(rows: dict[str, dict]) -> dict[str, Any]:
    def r(a: str, fa: str, b: str, fb: str) -> float | None:
        x, y = rows.get(a, {}).get(fa), rows.get(b, {}).get(fb)
        return x / y if x is not None and y else None

    dcp = [m for m in DCP_ASYNC if rows.get(m, {}).get("blocked_s") is not None]
    best = min(dcp, key=lambda m: rows[m]["blocked_s"]) if dcp else None
    return dict(
        blocked_vs_d2h=r("shardsafe-async", "blocked_s", "d2h-memcpy", "blocked_s"),
        dcp_best=best, blocked_vs_dcp_best=r("shardsafe-async", "blocked_s", best, "blocked_s") if best else None,
        durable_vs_sync=r("shardsafe-async", "durable_s", "shardsafe-sync", "durable_s"),
        load_vs_dcp=r("shardsafe-load", "blocked_s", "dcp-load", "blocked_s"),
        load_vs_h2d=r("shardsafe-load", "blocked_s", "h2d-memcpy", "blocked_s"),
    )


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(rows: dict[str, dict], info: dict) -> str:
    out = [
        f"{info['date']}, {info['device_name']}, {info['cpu']}, {info['cores']} cores, torch {info['torch']}, commit "
        f"{info['commit']}; state {info['state']} ({info['state_bytes'] / _GiB:.2f} GiB); loads: cache {info['cache']}.\n",
        "| method | n | first blocked s | blocked s (min) | durable s (min) | blocked GB/s | durable GB/s "
        "| first / timed RSS +MiB | first / timed CUDA +MiB | exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, r in rows.items():
        out.append(
            f"| {m} | {r['n']} | {_f(r['first_blocked_s'], '.4f')} | {_f(r['blocked_s'], '.4f')} ({_f(r['blocked_min'], '.4f')}) "
            f"| {_f(r['durable_s'], '.4f')} ({_f(r['durable_min'], '.4f')}) | {_f(r['blocked_gbps'], '.2f')} "
            f"| {_f(r['durable_gbps'], '.2f')} | {_f(r['first_rss_mib'], '.0f')} / {_f(r['rss_mib'], '.0f')} "
            f"| {_f(r['first_cuda_mib'], '.0f')} / {_f(r['cuda_mib'], '.0f')} | {'yes' if r['exact'] else 'NO'} |"
        )
    return "\n".join(out) + "\n"


def summary_line(rows: dict[str, dict], rat: dict, info: dict) -> str:
    def s(m: str, f: str) -> str:
        return _f(rows.get(m, {}).get(f), ".4g")

    def x(k: str) -> str:
        return _f(rat[k], ".2f") + ("x" if rat[k] is not None else "")

    return (
        f"GPU device={info['device_name'].replace(' ', '_')} gib={info['state_bytes'] / _GiB:.2f} tensors={info['tensors']} "
        f"async_blocked_s={s('shardsafe-async', 'blocked_s')} d2h_s={s('d2h-memcpy', 'blocked_s')} "
        f"blocked_vs_d2h={x('blocked_vs_d2h')} dcp_best={rat['dcp_best']} "
        f"dcp_best_blocked_s={s(rat['dcp_best'] or '', 'blocked_s')} blocked_vs_dcp_best={x('blocked_vs_dcp_best')} "
        f"durable_s={s('shardsafe-async', 'durable_s')} sync_s={s('shardsafe-sync', 'durable_s')} "
        f"durable_vs_sync={x('durable_vs_sync')} load_s={s('shardsafe-load', 'blocked_s')} "
        f"dcp_load_s={s('dcp-load', 'blocked_s')} load_vs_dcp={x('load_vs_dcp')} h2d_s={s('h2d-memcpy', 'blocked_s')} "
        f"load_vs_h2d={x('load_vs_h2d')} cache={info['cache']} verify={info['verify'].get('ok')}"
    )


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--gib", type=float, default=4.0, help="training state size in GiB (default 4)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of every method (default 5)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of: " + ",".join(METHODS))
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no repetition that would end after this (default 420)")
    ap.add_argument("--dir", default="/tmp/shardsafe-bench-gpu")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    import torch
    import torch.distributed as dist

    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch.cuda.is_available() is False (use --device cpu)")
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    records: list[dict] = []
    skipped: dict[str, str] = {}
    bench = None
    info = dict(machine(), device=args.device, gib=args.gib, reps=args.reps, budget_s=args.budget_s, verify={}, cache="-")
    try:
        bench = Bench(args.device, args.gib, args.dir)
        info.update(device_name=torch.cuda.get_device_name() if bench.cuda else "cpu", state=bench.desc,
                    state_bytes=bench.nbytes, tensors=len(bench.state))
        log(f"state: {bench.desc} on {info['device_name']} ({time.perf_counter() - t_start:.1f} s)")

        def skip(m: str, e: BaseException) -> None:
            skipped[m] = f"{type(e).__name__}: {e}"
            print(f"SKIP {m}: {skipped[m]}", flush=True)
            log("".join(traceback.format_exception(e)[-3:]).rstrip())
            methods.remove(m)

        for m in list(methods):
            try:
                bench.setup(m)
            except Exception as e:
                skip(m, e)

        peak = PeakRSS()
        round_s = 0.0
        for rep in range(-1, args.reps):  # rep -1: every method's first run
            elapsed = time.perf_counter() - t_start
            if rep >= 0 and elapsed + round_s > args.budget_s:
                log(f"budget: stopping after {rep} timed repetitions ({elapsed:.0f} s + {round_s:.0f} s > {args.budget_s:.0f} s)")
                break
            t_round = time.perf_counter()
            k = max(rep, 0) % max(len(methods), 1)
            for m in methods[k:] + methods[:k]:
                try:
                    bench.prepare(m)
                    bench.sync()
                    cuda0 = 0
                    if bench.cuda:
                        torch.cuda.reset_peak_memory_stats()
                        cuda0 = torch.cuda.memory_allocated()
                    with peak:
                        blocked, durable = bench.run(m)
                    cuda = (torch.cuda.max_memory_allocated() - cuda0) / (1 << 20) if bench.cuda else None
                    exact = bench.check(m)
                except Exception as e:
                    skip(m, e)
                    continue
                records.append(dict(method=m, rep=rep, blocked_s=blocked, durable_s=durable, rss_mib=peak.extra / (1 << 20),
                                    cuda_mib=cuda, exact=exact))
                log(f"  rep {rep:2} {m:18} blocked {blocked:8.4f} s  durable {_f(durable, '8.4f')} s"
                    + ("" if exact else "  NOT EXACT"))
            round_s = max(round_s, time.perf_counter() - t_round)
            info["cache"], info["dcp_stagers_renewed"] = bench.cache_mode, bench.stagers_renewed
            _write(args.out, info, records, skipped)
        if "shardsafe-async" in methods:
            try:
                info["verify"] = bench.verify_async()
            except Exception as e:
                info["verify"] = dict(ok=False, error=f"{type(e).__name__}: {e}")
            print(f"VERIFY shardsafe-async (tensors changed right after async_save returned): {info['verify']}", flush=True)
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(args.dir, ignore_errors=True)
        dist.destroy_process_group()
    info["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    rows = _write(args.out, info, records, skipped)
    if info.get("dcp_stagers_renewed"):
        print(f"dcp-stager-pinned: a new DefaultStager for each of {info['dcp_stagers_renewed']} saves (this torch closes it after "
              "staging, pytorch#183413: staging buffers are not kept)")
    print(f"cache: {info['cache']} before each load (drop_caches needs root; else fadvise DONTNEED on the files)")
    print(markdown(rows, info))
    print(summary_line(rows, ratios(rows), info))
    log(f"{info['elapsed_s']:.0f} s; raw results in {os.path.join(args.out, 'gpu.json')}")
    return 0


def _write(out: str, info: dict, records: list[dict], skipped: dict[str, str]) -> dict[str, dict]:
    rows = summarize(records, info.get("state_bytes", 0))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu.json"), "w") as f:
        json.dump(dict(info=info, summary=rows, ratios=ratios(rows), skipped=skipped, records=records), f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(main())
