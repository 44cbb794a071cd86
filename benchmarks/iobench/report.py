"""From raw measurements to the outputs: JSON of every record, a markdown table, a PNG chart.

Every ratio compares figures of the same run. Throughput is the checkpoint's total tensor bytes
(global, all ranks) over the median time; a ratio ``shardsafe / X`` above 1 means shardsafe is
faster (it is ``median time of X / median time of shardsafe``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from statistics import median

from . import methods as M

# what counts as a peer, the DCP peer, and the limit, per operation kind
PEERS = {
    "save": ("dcp", "dcp-t4", "torch.save", "safetensors"),
    "load": ("dcp", "torch.load-mmap", "safetensors"),
    "reshard": ("dcp",),
    "unshard": ("dcp_to_torch_save",),
}
LIMITS = {"save": M.LIMIT_SAVES, "load": M.LIMIT_LOADS, "reshard": M.LIMIT_LOADS, "unshard": M.LIMIT_UNSHARDS}
DCP = {"save": M.DCP_SAVES, "load": ("dcp",), "reshard": ("dcp",), "unshard": ("dcp_to_torch_save",)}
_MiB = 1 << 20


def kind(op: str) -> str:
    return op if op in ("save", "load", "unshard") else "reshard"


def label(op: str, world: int, cache: str | None = None) -> str:
    if op in ("save", "load"):
        text = f"{op} ws{world}"
    elif op == "unshard":
        text = "unshard (from ws2)"
    else:
        text = f"reshard {op}"
    return text + " cold" if cache == "cold" else text


def aggregate(records: list[dict], totals: dict[str, int]) -> list[dict]:
    """One row per (case, op, world, method): median, spread, throughput, peak extra RSS."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["case"], r["op"], r["world"], r.get("cache"), r["method"]), []).append(r)
    rows = []
    for (case, op, world, cache, method), rs in groups.items():
        secs = sorted(r["seconds"] for r in rs)
        med = median(secs)
        cpu = median(r.get("cpu_s", 0.0) for r in rs)
        state = max(r["state_bytes"] for r in rs)
        extra = max(r["extra_rss"] for r in rs)
        oks = [r["ok"] for r in rs if r["ok"] is not None]
        rows.append(
            dict(
                case=case, op=op, world=world, cache=cache, label=label(op, world, cache), method=method, n=len(secs), median_s=med,
                min_s=secs[0], max_s=secs[-1], cpu_s=cpu, gbps=totals[case] / med / 1e9 if med > 0 else float("inf"),
                extra_rss=extra, state_bytes=state, extra_pct=100.0 * extra / state if state else None,
                largest_tensor=max(r.get("largest_tensor", 0) for r in rs), verified=all(oks) if oks else None,
            )
        )
    order = {"save": 0, "load": 1, "2->1": 2, "2->4": 3, "S0->S1": 4, "unshard": 5}
    rows.sort(key=lambda r: (r["case"], order.get(r["op"], 9), r["world"], r["cache"] == "cold", r["median_s"]))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (case, operation): shardsafe against its best peer, DCP's best and the limit; targets."""
    by: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by.setdefault((r["case"], r["op"], r["world"], r["cache"]), {})[r["method"]] = r
    out = []
    for (case, op, world, cache), ms in by.items():
        ss = ms.get("shardsafe")
        if ss is None:
            continue
        k = kind(op)

        def best(names, ms=ms):
            got = [ms[n] for n in names if n in ms]
            return min(got, key=lambda r: r["median_s"]) if got else None

        peer, dcp, limit = best(PEERS[k]), best(DCP[k]), best(LIMITS[k])

        def ratio(other, ss=ss):
            return other["median_s"] / ss["median_s"] if other else None

        s = dict(
            case=case, op=op, world=world, cache=cache, label=ss["label"], shardsafe_s=ss["median_s"], shardsafe_gbps=ss["gbps"],
            spread=(ss["min_s"], ss["max_s"]), peer=peer and peer["method"], peer_gbps=peer and peer["gbps"],
            dcp=dcp and dcp["method"], dcp_gbps=dcp and dcp["gbps"], limit=limit and limit["method"],
            limit_gbps=limit and limit["gbps"], vs_peer=ratio(peer), vs_dcp=ratio(dcp), vs_limit=ratio(limit),
            extra_rss=ss["extra_rss"], extra_pct=ss["extra_pct"], largest_tensor=ss["largest_tensor"],
            verified=ss["verified"],
        )
        s["targets"] = _targets(k, op, s)
        out.append(s)
    return out


def _targets(k: str, op: str, s: dict) -> list[tuple[str, bool]]:
    t: list[tuple[str, bool]] = []
    if k == "save":
        if s["vs_dcp"] is not None:
            t.append(("≥1.3× DCP", s["vs_dcp"] >= 1.3))
        if s["vs_limit"] is not None:
            t.append(("≥0.9× limit", s["vs_limit"] >= 0.9))
    elif k == "load":
        if s["vs_dcp"] is not None:
            t.append(("≥2× DCP", s["vs_dcp"] >= 2.0))
        if s["vs_limit"] is not None:
            t.append(("≥0.8× limit", s["vs_limit"] >= 0.8))
        t.append(("RSS ≤5%", (s["extra_pct"] or 0) <= 5.0))
    elif k == "reshard":
        if s["vs_dcp"] is not None:
            t.append(("≥1.5× DCP", s["vs_dcp"] >= 1.5))
    elif k == "unshard":
        t.append(("RSS ≤ largest+64MiB", s["extra_rss"] <= s["largest_tensor"] + 64 * _MiB))
    return t


# ---------------------------------------------------------------- machine


def machine() -> dict:
    import safetensors
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return dict(
        date=time.strftime("%Y-%m-%d %H:%M %Z"), host=platform.node(), os=platform.platform(), cpu=cpu,
        cores=os.cpu_count(), memory_gib=round(mem / 2**30, 1) if mem else None, python=platform.python_version(),
        torch=torch.__version__, safetensors=safetensors.__version__, commit=commit,
    )


# ---------------------------------------------------------------- outputs


def _f(x, fmt="{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(summary: list[dict], rows: list[dict], info: dict, config: dict) -> str:
    lines = [
        f"Run {info['date']} on {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB RAM, local disk "
        f"({info['os']}); torch {info['torch']}, safetensors {info['safetensors']}, shardsafe at {info['commit'] or '?'}.",
        "",
        f"States: {', '.join(f'{c} {v / 2**30:.2f} GiB' for c, v in config['totals'].items())}; "
        f"{config['reps']} repetitions per method, interleaved; before each load the checkpoint was "
        + {"both": "read into the page cache (warm) and, in a second measurement, dropped from it (cold)",
           "warm": "read into the page cache (warm)", "cold": "dropped from the page cache (cold)"}[config.get("cache", "warm")]
        + ". "
        "Times are medians; GB/s is the whole checkpoint's bytes over the median time; "
        "ratios are speed ratios within this run (>1: shardsafe is faster).",
        "",
        "| case | operation | shardsafe s (spread) | GB/s | best peer GB/s | DCP best GB/s | limit GB/s | ×best peer | ×DCP | ×limit | extra RSS | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        rss = f"{s['extra_rss'] / _MiB:.0f} MiB" + (f" ({s['extra_pct']:.1f}%)" if s["extra_pct"] is not None else "")
        targets = ", ".join(f"{name} {'✅' if ok else '❌'}" for name, ok in s["targets"]) or "–"
        if s["verified"] is False:
            targets += " WRONG DATA"
        lines.append(
            f"| {s['case']} | {s['label']} | {s['shardsafe_s']:.3f} ({s['spread'][0]:.2f}–{s['spread'][1]:.2f}) | "
            f"{s['shardsafe_gbps']:.2f} | {_f(s['peer_gbps'])} {s['peer'] or ''} | {_f(s['dcp_gbps'])} | "
            f"{_f(s['limit_gbps'])} {s['limit'] or ''} | {_f(s['vs_peer'])} | {_f(s['vs_dcp'])} | {_f(s['vs_limit'])} | "
            f"{rss} | {targets} |"
        )
    lines += [
        "",
        "<details><summary>Every method</summary>",
        "",
        "| case | operation | method | median s | min–max s | GB/s | CPU s (all ranks) | extra peak RSS | verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pct = f" ({r['extra_pct']:.1f}%)" if r["extra_pct"] is not None else ""
        ver = {True: "yes", False: "NO", None: "–"}[r["verified"]]
        lines.append(
            f"| {r['case']} | {r['label']} | {r['method']} | {r['median_s']:.3f} | {r['min_s']:.3f}–{r['max_s']:.3f} | "
            f"{r['gbps']:.2f} | {r.get('cpu_s', 0.0):.2f} | {r['extra_rss'] / _MiB:.0f} MiB{pct} | {ver} |"
        )
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in sorted(rows, key=lambda r: r["method"] != "shardsafe")))
    colors = {m: plt.cm.tab20(i % 20) for i, m in enumerate(methods)}  # more methods than tab10 has colors
    fig, axes = plt.subplots(len(cases), 1, figsize=(14, 4.2 * len(cases)), squeeze=False)
    for ax, case in zip(axes[:, 0], cases):
        rs = [r for r in rows if r["case"] == case]
        labels = list(dict.fromkeys(r["label"] for r in rs))
        for gi, lab in enumerate(labels):
            grp = [r for r in rs if r["label"] == lab]
            grp.sort(key=lambda r: methods.index(r["method"]))
            w = 0.8 / max(len(grp), 1)
            for i, r in enumerate(grp):
                x = gi - 0.4 + w * (i + 0.5)
                lo, hi = r["gbps"] * r["median_s"] / r["max_s"], r["gbps"] * r["median_s"] / r["min_s"]
                ax.bar(x, r["gbps"], w, color=colors[r["method"]], label=r["method"],
                       yerr=[[max(r["gbps"] - lo, 0.0)], [max(hi - r["gbps"], 0.0)]], capsize=2, edgecolor="black" if r["method"] == "shardsafe" else None)
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
        ax.set_ylabel("GB/s (median, min–max)")
        ax.set_title(f"{case}")
        handles, names = ax.get_legend_handles_labels()
        uniq = dict(zip(names, handles))
        ax.legend(uniq.values(), uniq.keys(), ncol=5, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_json(path: str, records: list[dict], rows: list[dict], summary: list[dict], info: dict, config: dict) -> None:
    with open(path, "w") as f:
        json.dump(dict(machine=info, config=config, summary=summary, rows=rows, records=records), f, indent=1, default=str)


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def update_docs(doc: str, table: str, chart_rel: str) -> None:
    """Replace the generated part of ``doc`` (between the markers) with ``table`` and the chart."""
    replace_section(doc, BEGIN, END, f"{table}\n![throughput per operation and method]({chart_rel})\n")


def replace_section(doc: str, begin: str, end: str, body: str) -> None:
    """Put ``body`` between the ``begin`` and ``end`` markers of ``doc`` (appended if it has none)."""
    text = open(doc).read() if os.path.exists(doc) else "# Benchmarks\n"
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(doc, "w") as f:
        f.write(f"{head}{begin}\n{body}{end}{tail}")
