"""Server-rendered SVG charts (pure functions to strings): no chart script, nothing fetched by the browser."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from loomd.ui.html import esc

PALETTE = ("#3b6fd4", "#2a9d6f", "#c0812b", "#8a63c9", "#c94f6d", "#4a9bb5", "#7c8a2e", "#b5654a", "#5a6b8c",
           "#a04ca0", "#3d8f8f", "#8f6d3d", "#666")
WIDTH, HEIGHT, PAD = 640, 200, 28


def _frame(body: str, top: float, label: str) -> str:
    axis = (f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - 4}" y2="{HEIGHT - PAD}" class="axis"/>'
            f'<text x="{PAD - 4}" y="12" class="tick" text-anchor="end">{top:g}</text>'
            f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" class="tick" text-anchor="end">0</text>')
    return (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{esc(label)}">'
            f"{axis}{body}</svg>")


def stacked_bars(columns: Sequence[str], series: Mapping[str, Sequence[float]], label: str) -> str:
    """One bar per column, stacked by series (e.g. memories per day by kind), with a legend under it."""
    if not columns:
        return '<p class="empty">nothing yet</p>'
    totals = [sum(values[i] for values in series.values()) for i in range(len(columns))]
    top = max(totals) or 1
    step = min(48.0, (WIDTH - PAD - 8) / len(columns))  # a lone bar stays a bar, not a wall
    scale = (HEIGHT - 2 * PAD + 12) / top
    bars = []
    for i, column in enumerate(columns):
        y = float(HEIGHT - PAD)
        for j, (name, values) in enumerate(series.items()):
            h = values[i] * scale
            if h <= 0:
                continue
            y -= h
            bars.append(f'<rect x="{PAD + 2 + i * step:.1f}" y="{y:.1f}" width="{max(1.0, step - 2):.1f}" '
                        f'height="{h:.1f}" fill="{PALETTE[j % len(PALETTE)]}">'
                        f"<title>{esc(column)} {esc(name)}: {values[i]:g}</title></rect>")
    ticks = "".join(
        f'<text x="{PAD + 2 + i * step + step / 2:.1f}" y="{HEIGHT - PAD + 14}" class="tick" text-anchor="middle">'
        f"{esc(c)}</text>" for i, c in enumerate(columns) if i % max(1, len(columns) // 8) == 0)
    legend = " ".join(f'<i style="color:{PALETTE[j % len(PALETTE)]}">■ {esc(name)}</i>'
                      for j, name in enumerate(series))
    return _frame("".join(bars) + ticks, top, label) + f'<div class="legend">{legend}</div>'


def line(columns: Sequence[str], values: Sequence[float], label: str) -> str:
    """A line with its points (e.g. the store's growth)."""
    if not values:
        return '<p class="empty">nothing yet</p>'
    top = max(values) or 1
    step = (WIDTH - PAD - 12) / max(1, len(values) - 1)
    points = [(PAD + 4 + i * step, HEIGHT - PAD - v * (HEIGHT - 2 * PAD + 12) / top) for i, v in enumerate(values)]
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5"><title>{esc(c)}: {v:g}</title></circle>'
                   for (x, y), c, v in zip(points, columns, values, strict=True))
    last = len(columns) - 1
    ticks = "".join(
        f'<text x="{x:.1f}" y="{HEIGHT - PAD + 14}" class="tick" text-anchor="{"end" if i == last else "middle"}">'
        f"{esc(c)}</text>" for i, ((x, _), c) in enumerate(zip(points, columns, strict=True))
        if i % max(1, len(columns) // 6) == 0 or i == last)
    return _frame(f'<polyline class="line" points="{path}"/>{dots}{ticks}', top, label)
