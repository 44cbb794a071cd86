"""Run Megatron-Core's own ``tests/unit_tests/dist_checkpointing`` suite on CPU/gloo, once against
real megatron-core and once against ``shardsafe.megatron`` standing in for
``megatron.core.dist_checkpointing`` (``shardsafe.megatron.install()``), and print::

    MEGATRON-TESTS impl=shardsafe file=test_mapping.py passed 8 / 8
    ...
    MEGATRON-TESTS impl=shardsafe passed P / T
    MEGATRON-TESTS impl=megatron passed P / T

Megatron's sources are not part of this repository (nor reachable from CI). Get them once with::

    git clone --depth 1 --branch core_v0.15.3 https://github.com/NVIDIA/Megatron-LM /path/to/megatron-src

and pass the path with ``--megatron-src`` or ``MEGATRON_SRC`` (``make test-megatron MEGATRON_SRC=...``).
Megatron's modules are imported from that tree (the installed megatron-core 0.15.3 is the same code);
the tests run as Megatron's CI runs them, one pytest process per rank (8 by default), one launch per
file, each rank with the CPU mapping of ``megatron_suite_plugin.py``. A test passes when it passed on
every rank. A file that runs past ``--timeout`` is killed and its unfinished tests count as failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_DIR = "tests/unit_tests/dist_checkpointing"
TAG = "core_v0.15.3"

# The five files issue 21 measured real megatron-core on (72 of their 75 tests pass on CPU/gloo with
# torch 2.13); --all runs every test file of the folder, models/ included.
DEFAULT_FILES = (
    "test_mapping.py",
    "test_serialization.py",
    "test_flattened_resharding.py",
    "test_fully_parallel.py",
    "test_async_save.py",
)


def _missing_sources(path: str | None) -> str:
    where = f"'{path}' has no {TEST_DIR}" if path else "no path given (--megatron-src or MEGATRON_SRC)"
    return (
        f"Megatron-LM sources not found: {where}.\n"
        f"Get them (once, with network access) and point the runner at them:\n"
        f"  git clone --depth 1 --branch {TAG} https://github.com/NVIDIA/Megatron-LM /path/to/megatron-src\n"
        f"  make test-megatron MEGATRON_SRC=/path/to/megatron-src"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            pass
    return rows


def run_file(src: Path, impl: str, test_file: str, nproc: int, timeout: float, work: Path, verbose: bool) -> dict:
    """One launch of ``nproc`` pytest ranks on one test file; returns {test: (outcome, error)} and the log."""
    out = work / impl / test_file.replace("/", "_")
    shutil.rmtree(out, ignore_errors=True)
    (out / "tmp").mkdir(parents=True)
    port, store_port = _free_port(), _free_port()
    env = dict(os.environ)
    env.update(
        MEGATRON_SUITE_IMPL=impl,
        MEGATRON_SUITE_OUT=str(out),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        MEGATRON_SUITE_STORE_PORT=str(store_port),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join([str(HERE), str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONDONTWRITEBYTECODE="1",
    )
    procs = []
    for rank in range(nproc):
        renv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        cmd = [
            sys.executable, "-m", "pytest", "-p", "megatron_suite_plugin", "-p", "no:cacheprovider",
            "-p", "no:xdist", "-p", "no:hypothesispytest", "-o", "addopts=", "-q", "-rfE",
            f"--basetemp={out / 'tmp' / f'rank{rank}'}", f"{TEST_DIR}/{test_file}",
        ]
        log = open(out / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=src, env=renv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    deadline = time.monotonic() + timeout
    timed_out = False
    for p, _log in procs:
        left = deadline - time.monotonic()
        try:
            p.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        for p, _ in procs:
            p.wait()
    for _, log in procs:
        log.close()
    collected: list[str] = []
    aborted: list[str] = []
    per_rank: list[dict[str, tuple[str, str]]] = []
    for rank in range(nproc):
        results: dict[str, tuple[str, str]] = {}
        for row in _read(out / f"rank{rank}.jsonl"):
            if "collected" in row:
                if rank == 0 or not collected:
                    collected = row["collected"]
                continue
            if "test" not in row:  # the rank gave up (a peer did not finish a test): what ran is counted
                aborted.append(f"rank {rank}: {row.get('abort', row)}")
                continue
            old = results.get(row["test"])
            if old is None or old[0] == "passed" or row["outcome"] == "failed":
                results[row["test"]] = (row["outcome"], row.get("error", ""))
        per_rank.append(results)
    verdict: dict[str, tuple[str, str]] = {}
    for test in collected:
        outcomes = [r.get(test, ("timeout" if timed_out else "not run", "")) for r in per_rank]
        failed = [(rank, o) for rank, o in enumerate(outcomes) if o[0] != "passed"]
        if not failed:
            verdict[test] = ("passed", "")
        elif all(o[0] == "skipped" for _, o in failed) and len(failed) == nproc:
            verdict[test] = ("skipped", outcomes[0][1])
        else:
            rank, (outcome, error) = next(((r, o) for r, o in failed if o[0] == "failed"), failed[0])
            verdict[test] = (outcome, f"rank {rank}: {error}")
    if not collected:
        tail = (out / "rank0.log").read_text()[-3000:] if (out / "rank0.log").exists() else ""
        verdict[f"{test_file}::<collection>"] = ("failed", f"nothing collected{' (timeout)' if timed_out else ''}:\n{tail}")
    return {"verdict": verdict, "timed_out": timed_out, "aborted": aborted}


def _summary(error: str) -> str:
    """The ``E`` lines of a pytest failure (the exception and its message), else its last lines."""
    lines = error.strip().splitlines()
    head = lines[0] if lines and lines[0].startswith("rank ") else ""
    e_lines = [line for line in lines if line.startswith("E ")]
    body = e_lines[:12] if e_lines else lines[-8:]
    return "\n".join([head, *body]).strip()[:2000]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-src", default=os.environ.get("MEGATRON_SRC"), help=f"a checkout of Megatron-LM at tag {TAG}")
    parser.add_argument("--impl", choices=("shardsafe", "megatron", "both"), default="both")
    parser.add_argument("--nproc", type=int, default=8, help="ranks per test file (Megatron's tests assume 8)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per file before its ranks are killed")
    parser.add_argument("--work", default=None, help="where logs and checkpoints go (default: a temporary directory)")
    parser.add_argument("--failures", action="store_true", help="print each failure's error")
    parser.add_argument("--all", action="store_true", help=f"every test_*.py under {TEST_DIR}, models/ included")
    parser.add_argument(
        "files", nargs="*",
        help=f"files under {TEST_DIR}, or pytest node ids in them (test_optimizer.py::TestFP32Optimizer), one launch each: "
        f"fresh ranks per launch keep a long file's leaked threads and groups from piling up (default: {', '.join(DEFAULT_FILES)})",
    )
    args = parser.parse_args(argv)

    src = Path(args.megatron_src).resolve() if args.megatron_src else None
    if src is None or not (src / TEST_DIR).is_dir():
        print(_missing_sources(args.megatron_src), file=sys.stderr)
        return 2
    if args.all:
        files = sorted(str(p.relative_to(src / TEST_DIR)) for p in (src / TEST_DIR).rglob("test_*.py"))
    else:
        files = args.files or list(DEFAULT_FILES)
    impls = ("megatron", "shardsafe") if args.impl == "both" else (args.impl,)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="megatron-suite-"))
    print(f"Megatron sources {src}; logs under {work}", flush=True)
    totals = {impl: [0, 0] for impl in impls}
    lines: list[str] = []
    for impl in impls:
        for test_file in files:
            start = time.monotonic()
            result = run_file(src, impl, test_file, args.nproc, args.timeout, work, args.failures)
            verdict = result["verdict"]
            passed = sum(1 for o, _ in verdict.values() if o == "passed")
            skipped = sum(1 for o, _ in verdict.values() if o == "skipped")
            total = len(verdict)
            totals[impl][0] += passed
            totals[impl][1] += total
            extra = f" ({skipped} skipped)" if skipped else ""
            extra += " (timed out)" if result["timed_out"] else ""
            extra += f" (aborted: {'; '.join(result['aborted'])})" if result["aborted"] else ""
            line = f"MEGATRON-TESTS impl={impl} file={test_file} passed {passed} / {total}{extra}"
            lines.append(line)
            print(f"{line}  [{time.monotonic() - start:.0f} s]", flush=True)
            for test, (outcome, error) in verdict.items():
                if outcome != "passed":
                    print(f"  {outcome.upper()} {test}", flush=True)
                    if args.failures and error:
                        print("    " + _summary(error).replace("\n", "\n    "), flush=True)
    print()
    for line in lines:
        print(line)
    for impl in impls:
        print(f"MEGATRON-TESTS impl={impl} passed {totals[impl][0]} / {totals[impl][1]}")
    return 0 if all(p == t for p, t in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
