"""Saving and loading a model with torchao's 8-bit optimizer state against the same model with
plain AdamW state, per byte of checkpoint, in one run; torch.distributed.checkpoint measured on
both beside it (issue 25: "costs no more per byte than a plain one").

One process, a local directory (the page cache warm for every repetition, as for every
method). Each method saves the same model and optimizer ``--reps`` times (overwriting) and loads
it back in place as many times, the methods interleaved (the order rotated each repetition);
the median is reported. Prints a table and one line:

    SUBCLASS save_per_byte_x=... load_per_byte_x=... dcp_save_per_byte_x=... dcp_load_per_byte_x=... target_save<=1.0x:ok ...

``*_per_byte_x`` = (seconds per byte with 8-bit state) / (seconds per byte with plain state).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # torchao's optimizer step compiles itself; eager here

import torch  # noqa: E402

import shardsafe  # noqa: E402


def _model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _optim(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "plain":
        return torch.optim.AdamW(model.parameters())
    from torchao.optim import AdamW8bit

    return AdamW8bit(model.parameters())


def _stepped(kind: str, layers: int, width: int):
    m = _model(layers, width)
    o = _optim(kind, m)
    m(torch.randn(4, width)).sum().backward()
    o.step()
    o.zero_grad()
    return m, o


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class _Method:
    """One library saving and loading one kind of optimizer state: a save and a load callable,
    and the checkpoint they write."""

    def __init__(self, lib: str, kind: str, root: str, layers: int, width: int) -> None:
        self.name, self.path = f"{lib} {kind}", os.path.join(root, f"{lib}-{kind}")
        m, o = _stepped(kind, layers, width)
        m2, o2 = _stepped(kind, layers, width)  # targets allocated once: every load fills the same memory
        if lib == "shardsafe":
            self.save = lambda: shardsafe.save_model_and_optim_state(self.path, m, o, save_overwrite=True)
            self.load = lambda: shardsafe.load_model_and_optim_state(self.path, m2, o2)
        else:
            import torch.distributed.checkpoint as dcp

            target = {"model": m2.state_dict(), "optim": o2.state_dict()}

            def save() -> None:
                shutil.rmtree(self.path, ignore_errors=True)
                dcp.save({"model": m.state_dict(), "optim": o.state_dict()}, checkpoint_id=self.path, no_dist=True)

            self.save = save
            self.load = lambda: dcp.load(target, checkpoint_id=self.path, no_dist=True)
        self.times: dict[str, list[float]] = {"save": [], "load": []}
        self.failed: str | None = None

    def run(self, op: str) -> None:
        if self.failed is not None:
            return
        t = time.perf_counter()
        try:
            getattr(self, op)()
        except Exception as e:  # the peer's failure is a result: reported, not raised
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            return
        self.times[op].append(time.perf_counter() - t)

    def result(self) -> tuple[float, float, int] | str:
        if self.failed is not None:
            return self.failed
        return statistics.median(self.times["save"]), statistics.median(self.times["load"]), _size(self.path)


def _interleaved(methods: list[_Method], reps: int) -> None:
    """Each repetition runs every method once, the order rotated, so that a machine whose load
    drifts slows every method alike: saves first (the last one of each method is what loads read)."""
    for op in ("save", "load"):
        for rep in range(reps):
            k = rep % len(methods)
            for method in methods[k:] + methods[:k]:
                method.run(op)


def _measure(layers: int, width: int, reps: int) -> dict[tuple[str, str], tuple[float, float, int] | str]:
    root = tempfile.mkdtemp(prefix="bench-subclasses-")
    try:
        methods = [_Method(lib, kind, root, layers, width) for lib in ("shardsafe", "dcp") for kind in ("plain", "8bit")]
        _interleaved(methods, reps)
        return {tuple(m.name.split()): m.result() for m in methods}  # type: ignore[misc]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _report(rows: dict, layers: int, width: int, reps: int, suffix: str) -> tuple[dict[str, str], list[str]]:
    """Print the table for one model; its fields (names ending in ``suffix``) and targets."""
    params = layers * (width * width + width)
    print(f"model: {layers} x Linear({width}, {width}), {params * 4 / 2**20:.1f} MiB of fp32 parameters; "
          f"median of {reps}, interleaved")
    print(f"{'method':<22}{'bytes':>14}{'save s':>10}{'load s':>10}{'save GB/s':>11}{'load GB/s':>11}")
    for (lib, kind), r in rows.items():
        if isinstance(r, str):
            print(f"{lib + ' ' + kind:<22}  fails: {r}")
            continue
        s, ld, n = r
        print(f"{lib + ' ' + kind:<22}{n:>14}{s:>10.3f}{ld:>10.3f}{n / s / 1e9:>11.2f}{n / ld / 1e9:>11.2f}")

    def per_byte(lib: str, which: int) -> str:
        a, b = rows[lib, "8bit"], rows[lib, "plain"]
        if isinstance(a, str) or isinstance(b, str):
            return "fails"
        return f"{(a[which] / a[2]) / (b[which] / b[2]):.2f}"

    fields = {
        "save_per_byte_x": per_byte("shardsafe", 0), "load_per_byte_x": per_byte("shardsafe", 1),
        "dcp_save_per_byte_x": per_byte("dcp", 0), "dcp_load_per_byte_x": per_byte("dcp", 1),
    }
    for lib in ("shardsafe", "dcp"):
        r8 = rows[lib, "8bit"]
        if not isinstance(r8, str):
            fields[f"{lib}_8bit_bytes"] = str(r8[2])
    targets = [
        f"target_{op}{suffix}<=1.0x:{'ok' if fields[f'{op}_per_byte_x'] != 'fails' and float(fields[f'{op}_per_byte_x']) <= 1.0 else 'MISS'}"
        for op in ("save", "load")
    ]
    return {k + suffix: v for k, v in fields.items()}, targets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--wide", type=int, default=0, metavar="W",
                    help="also measure 2 x Linear(W, W): tensors large enough that the per-tensor costs "
                    "(8-bit state stores 3 tensors where plain state stores 1) weigh little (fields end in _wide)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a small model, 2 repetitions (the smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.width, args.reps, args.wide = 2, 256, 2, 0
    fields, targets = _report(_measure(args.layers, args.width, args.reps), args.layers, args.width, args.reps, "")
    if args.wide:
        more, more_targets = _report(_measure(2, args.wide, args.reps), 2, args.wide, args.reps, "_wide")
        fields.update(more)
        targets += more_targets
    print("SUBCLASS " + " ".join(f"{k}={v}" for k, v in fields.items()) + " " + " ".join(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
