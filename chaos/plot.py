"""``chaos.png``: one figure summarising a chaos report (faults, versions, loss, token fate).

The input is the report dict the chaos runner writes (times in seconds from each mode's start).
Any key may be missing, ``None`` or malformed: the affected panel says so and the rest of the
figure is still drawn, so a partial or crashed run still gets a picture.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MODE_ORDER = ("diloco", "dp")
MODE_LABELS = {"diloco": "Decoupled DiLoCo", "dp": "data-parallel"}
MODE_COLORS = {"diloco": "tab:blue", "dp": "tab:orange"}
STATE_COLORS = {"down": "red", "paused": "orange", "partitioned": "purple", "slow": "gold",
                "congested": "teal"}
FAULT_COLORS = {"kill": "black", "pause": "tab:brown", "slow": "tab:olive",
                "partition": "tab:pink"}
MERGED_COLOR = "tab:green"


# ----------------------------------------------------------------------------------------------
# Tolerant readers
# ----------------------------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` (bools, strings, NaN and inf included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    out = float(value)
    return out if math.isfinite(out) else None


def _dict(value: Any) -> dict[str, Any]:
    """``value`` if it is a mapping (with string keys), else an empty dict."""
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    return {}


def _pairs(value: Any) -> list[tuple[float, float]]:
    """The well-formed ``[x, y]`` numeric pairs of ``value``, sorted by ``x``."""
    out: list[tuple[float, float]] = []
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, Mapping)):
        return out
    for item in value:
        if isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and len(item) >= 2:
            x, y = _num(item[0]), _num(item[1])
            if x is not None and y is not None:
                out.append((x, y))
    out.sort(key=lambda p: p[0])
    return out


def _intervals(value: Any) -> list[tuple[float, float, str]]:
    """The well-formed ``[start, end, state]`` triples of ``value`` with ``end >= start``."""
    out: list[tuple[float, float, str]] = []
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, Mapping)):
        return out
    for item in value:
        if isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and len(item) >= 3:
            start, end = _num(item[0]), _num(item[1])
            if start is not None and end is not None and end >= start:
                out.append((start, end, str(item[2])))
    return out


def _faults(value: Any) -> list[tuple[float, str, str]]:
    """The well-formed faults of ``value`` as ``(at_s, kind, target)``."""
    out: list[tuple[float, str, str]] = []
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, Mapping)):
        return out
    for item in value:
        fault = _dict(item)
        at = _num(fault.get("at_s"))
        if at is not None:
            out.append((at, str(fault.get("kind") or "?"), str(fault.get("target") or "")))
    return out


def _reasons(value: Any) -> dict[str, float]:
    """A ``{reason: tokens}`` mapping (a bare number counts as reason ``"total"``)."""
    single = _num(value)
    if single is not None:
        return {"total": max(single, 0.0)}
    out: dict[str, float] = {}
    for reason, amount in _dict(value).items():
        n = _num(amount)
        if n is not None and n > 0:
            out[reason] = n
    return out


def _natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders ``learner-2`` before ``learner-10``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _lane_key(name: str) -> tuple[int, tuple[Any, ...]]:
    """Lane order: learners, shards, redis, the object store (blobs), then anything else."""
    low = name.lower()
    group = 4
    for rank, prefix in enumerate(("learner", "shard", "redis", "blobs")):
        if low.startswith(prefix):
            group = rank
            break
    return group, _natural_key(low)


def _modes(report: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The modes present in ``report``, known ones first, as ``(name, block)``."""
    blocks = _dict(report.get("modes"))
    names = [m for m in MODE_ORDER if m in blocks]
    names += sorted(m for m in blocks if m not in MODE_ORDER)
    return [(m, _dict(blocks[m])) for m in names]


def _label(mode: str) -> str:
    return MODE_LABELS.get(mode, mode)


def _color(mode: str, index: int) -> str:
    return MODE_COLORS.get(mode, f"C{(index + 2) % 10}")


def _fmt_s(value: Any) -> str:
    n = _num(value)
    return "n/a" if n is None else f"{n:.1f} s"


def _empty(ax: Axes, message: str) -> None:
    """Mark ``ax`` as having no data."""
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes,
            color="0.4", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


# ----------------------------------------------------------------------------------------------
# Panels
# ----------------------------------------------------------------------------------------------


def _plot_timeline(ax: Axes, mode: str, block: Mapping[str, Any], horizon: float | None) -> None:
    """One lane per worker, coloured bars for states, triangles at fault times."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.set_title(f"{mode}: faults and states", loc="left", fontsize=10)
    timeline = {w: _intervals(v) for w, v in _dict(block.get("timeline")).items()}
    faults = _faults(block.get("faults"))
    lanes = sorted(set(timeline) | {t for _, _, t in faults if t}, key=_lane_key)
    if not lanes and not faults:
        _empty(ax, "no timeline or faults recorded")
        return
    row = {w: i for i, w in enumerate(lanes)}
    other_row = len(lanes)  # faults without a target
    seen_states: list[str] = []
    for worker, spans in timeline.items():
        for start, end, state in spans:
            color = STATE_COLORS.get(state, "0.6")
            ax.broken_barh([(start, max(end - start, 1e-9))], (row[worker] - 0.35, 0.7),
                           facecolors=color, edgecolors="none", alpha=0.85)
            if state not in seen_states:
                seen_states.append(state)
    seen_kinds: list[str] = []
    for at, kind, target in faults:
        y = row.get(target, other_row)
        ax.plot([at], [y - 0.45], marker="v", ms=6, ls="none",
                color=FAULT_COLORS.get(kind, "tab:gray"), markeredgecolor="white", mew=0.5)
        if kind not in seen_kinds:
            seen_kinds.append(kind)
    labels = list(lanes)
    if any(t not in row for _, _, t in faults):
        labels.append("(untargeted)")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.9)
    ends = [e for spans in timeline.values() for _, e, _ in spans] + [a for a, _, _ in faults]
    right = max([horizon or 0.0, *ends, 1.0])
    ax.set_xlim(0.0, right * 1.01)
    ax.set_xlabel("seconds", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    handles: list[Any] = [Patch(color=c, label=s) for s, c in STATE_COLORS.items()]
    if any(s not in STATE_COLORS for s in seen_states):
        handles.append(Patch(color="0.6", label="other state"))
    handles += [Line2D([], [], marker="v", ls="none", color=FAULT_COLORS.get(k, "tab:gray"),
                       label=f"fault: {k}") for k in seen_kinds]
    ax.legend(handles=handles, fontsize=6, ncol=min(len(handles), 4), loc="lower right",
              bbox_to_anchor=(1.0, 1.0), frameon=False, borderaxespad=0.1)


def _plot_versions(ax: Axes, mode: str, block: Mapping[str, Any], horizon: float | None) -> None:
    """Step lines of each fragment's version over time."""
    ax.set_title(f"{mode}: fragment versions", loc="left", fontsize=10)
    series = {f: _pairs(v) for f, v in _dict(block.get("versions")).items()}
    series = {f: s for f, s in series.items() if s}
    if not series:
        _empty(ax, "no fragment versions recorded")
        return
    for frag in sorted(series, key=_natural_key):
        xs, ys = zip(*series[frag], strict=True)
        ax.step(xs, ys, where="post", lw=0.9, label=f"fragment {frag}")
    if horizon:
        ax.set_xlim(0.0, horizon * 1.01)
    ax.set_xlabel("seconds", fontsize=8)
    ax.set_ylabel("version", fontsize=8)
    ax.grid(alpha=0.3)
    if len(series) <= 8:
        ax.legend(fontsize=6, ncol=2, loc="upper left")


def _loss_unit(report: Mapping[str, Any]) -> str:
    """The task's loss unit: the report's, else (a report written before it recorded one)
    nats/byte for the built-in GPT and nats/token for a custom task."""
    unit = report.get("loss_unit")
    if isinstance(unit, str) and unit:
        return unit
    task = _dict(_dict(report.get("config")).get("model")).get("task")
    return "nats/byte" if task is None else "nats/token"


def _plot_val_loss(ax: Axes, report: Mapping[str, Any],
                   modes: list[tuple[str, dict[str, Any]]]) -> None:
    """Validation loss vs wall time for every mode, with fault-free final losses dashed."""
    ax.set_title("Validation loss vs wall time", loc="left", fontsize=10)
    fault_free = _dict(report.get("fault_free"))
    drawn = False
    for i, (mode, block) in enumerate(modes):
        points = _pairs(block.get("val_loss"))
        color = _color(mode, i)
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2, color=color, label=f"{_label(mode)} (chaos)")
            drawn = True
    names = [m for m, _ in modes] + sorted(m for m in fault_free if m not in dict(modes))
    for i, mode in enumerate(names):
        ref = _num(_dict(fault_free.get(mode)).get("final_val_loss"))
        if ref is not None:
            ax.axhline(ref, ls="--", lw=1.0, color=_color(mode, i),
                       label=f"{_label(mode)} fault-free final ({ref:.3f})")
            drawn = True
    if not drawn:
        _empty(ax, "no validation loss recorded")
        return
    ax.set_xlabel("wall time (s)", fontsize=8)
    ax.set_ylabel(f"validation loss ({_loss_unit(report)})", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _plot_goodput(ax: Axes, modes: list[tuple[str, dict[str, Any]]]) -> None:
    """Goodput (%) per mode, with downtime and recovery times as panel text."""
    ax.set_title("Goodput", loc="left", fontsize=10)
    if not modes:
        _empty(ax, "no modes")
        return
    values: list[float] = []
    lines: list[str] = []
    for i, (mode, block) in enumerate(modes):
        g = _num(block.get("goodput"))
        pct = 100.0 * g if g is not None else None
        values.append(pct or 0.0)
        bar = ax.bar(i, pct or 0.0, color=_color(mode, i), width=0.6)
        ax.bar_label(bar, labels=["n/a" if pct is None else f"{pct:.1f}%"], fontsize=7)
        rec = _dict(block.get("recovery_s"))
        n = _num(rec.get("n"))
        lines.append(
            f"{mode}: goodput {'n/a' if pct is None else f'{pct:.1f}%'}\n"
            f"  downtime {_fmt_s(block.get('global_downtime_s'))}\n"
            f"  recovery p50 {_fmt_s(rec.get('p50'))}, max {_fmt_s(rec.get('max'))}"
            f" (n={'n/a' if n is None else int(n)})")
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels([m for m, _ in modes], fontsize=8)
    ax.set_xlim(-0.6, len(modes) - 0.4)
    top = max([100.0, *values])
    ax.set_ylim(0.0, top * (1.15 + 0.3 * len(modes)))
    ax.set_yticks([t for t in ax.get_yticks() if 0.0 <= t <= top * 1.05])
    ax.set_ylabel("goodput (%)", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.text(0.02, 0.98, "\n".join(lines), transform=ax.transAxes, va="top", ha="left",
            fontsize=6.5, family="monospace",
            bbox={"boxstyle": "round", "fc": "white", "ec": "0.8", "alpha": 0.9})


def _plot_token_fate(ax: Axes, modes: list[tuple[str, dict[str, Any]]]) -> None:
    """Stacked bars per mode: merged, discarded and lost tokens as fractions of processed."""
    import matplotlib as mpl

    ax.set_title("Token fate (fraction of processed)", loc="left", fontsize=10)
    fates: list[tuple[str, float, float, dict[str, float], dict[str, float]]] = []
    for mode, block in modes:
        tokens = _dict(_dict(block.get("token_fate")).get("tokens"))
        merged = max(_num(tokens.get("merged")) or 0.0, 0.0)
        discarded = _reasons(tokens.get("discarded"))
        lost = _reasons(tokens.get("lost"))
        processed = _num(tokens.get("processed"))
        if processed is None or processed <= 0:
            processed = merged + sum(discarded.values()) + sum(lost.values())
        fates.append((mode, processed, merged, discarded, lost))
    if not any(p > 0 for _, p, _, _, _ in fates):
        _empty(ax, "no token fate recorded")
        return
    d_reasons = sorted({r for f in fates for r in f[3]})
    l_reasons = sorted({r for f in fates for r in f[4]})
    blues, reds = mpl.colormaps["Blues"], mpl.colormaps["Reds"]

    def shade(cmap: Any, k: int, n: int) -> Any:
        return cmap(0.45 + 0.45 * (k / max(n - 1, 1)))

    colors: dict[tuple[str, str], Any] = {("merged", ""): MERGED_COLOR}
    colors.update({("discarded", r): shade(blues, k, len(d_reasons))
                   for k, r in enumerate(d_reasons)})
    colors.update({("lost", r): shade(reds, k, len(l_reasons)) for k, r in enumerate(l_reasons)})
    labelled: set[tuple[str, str]] = set()
    for i, (_, processed, merged, discarded, lost) in enumerate(fates):
        if processed <= 0:
            ax.text(i, 0.02, "no tokens", ha="center", fontsize=7, color="0.4")
            continue
        parts = [(("merged", ""), merged)]
        parts += [(("discarded", r), discarded.get(r, 0.0)) for r in d_reasons]
        parts += [(("lost", r), lost.get(r, 0.0)) for r in l_reasons]
        bottom = 0.0
        for key, amount in parts:
            frac = amount / processed
            if frac <= 0:
                continue
            label = "merged" if key[0] == "merged" else f"{key[0]}: {key[1]}"
            ax.bar(i, frac, bottom=bottom, width=0.6, color=colors[key],
                   label=label if key not in labelled else None, edgecolor="white", lw=0.3)
            labelled.add(key)
            bottom += frac
        ax.text(i, bottom + 0.01, f"{merged / processed:.0%} merged", ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(range(len(fates)))
    ax.set_xticklabels([f[0] for f in fates], fontsize=8)
    ax.set_xlim(-0.6, len(fates) - 0.4)
    ax.set_ylim(0.0, 1.15)
    ax.set_ylabel("fraction of processed tokens", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)


# ----------------------------------------------------------------------------------------------
# Figure
# ----------------------------------------------------------------------------------------------


def _build(report: Mapping[str, Any]) -> Figure:
    """Lay out and draw every panel."""
    import matplotlib.pyplot as plt

    modes = _modes(report)
    script = _dict(report.get("script"))
    duration = _num(script.get("duration_s"))
    fig = plt.figure(figsize=(14, 10), layout="constrained")
    grid = fig.add_gridspec(3, 12, height_ratios=[1.25, 1.0, 1.0])
    n = max(len(modes), 1)
    width = 12 // n if 12 % n == 0 else 0
    if modes and width:
        for i, (mode, block) in enumerate(modes):
            cols = slice(i * width, (i + 1) * width)
            horizon = max(duration or 0.0, _num(block.get("wall_s")) or 0.0) or None
            _plot_timeline(fig.add_subplot(grid[0, cols]), mode, block, horizon)
            _plot_versions(fig.add_subplot(grid[1, cols]), mode, block, horizon)
    elif modes:  # more modes than fit evenly: nest a sub-grid per row
        top = grid[0, :].subgridspec(1, len(modes))
        mid = grid[1, :].subgridspec(1, len(modes))
        for i, (mode, block) in enumerate(modes):
            horizon = max(duration or 0.0, _num(block.get("wall_s")) or 0.0) or None
            _plot_timeline(fig.add_subplot(top[0, i]), mode, block, horizon)
            _plot_versions(fig.add_subplot(mid[0, i]), mode, block, horizon)
    else:
        _empty(fig.add_subplot(grid[0, :]), "no modes in this report")
        _empty(fig.add_subplot(grid[1, :]), "no fragment versions")
    _plot_val_loss(fig.add_subplot(grid[2, 0:5]), report, modes)
    _plot_goodput(fig.add_subplot(grid[2, 5:8]), modes)
    _plot_token_fate(fig.add_subplot(grid[2, 8:12]), modes)
    name = script.get("name") or "chaos run"
    seed = script.get("seed")
    title = f"{name}" + (f"  (seed {seed})" if seed is not None else "")
    if duration is not None:
        title += f"  {duration:.0f} s script"
    fig.suptitle(title, fontsize=12)
    return fig


def plot_chaos(report: dict[str, Any], path: Path) -> None:
    """Render ``chaos.png`` for a chaos ``report`` to ``path``; missing data never raises."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = _build(report if isinstance(report, Mapping) else {})
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
