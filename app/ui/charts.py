"""The overview's small charts, drawn here as inline SVG: no script, no library, nothing
fetched. The page's Content-Security-Policy forbids inline styles, so every colour is a class
of ui.css and the SVG carries only geometry; each bar or point has a `<title>` (the browser's
own tooltip) and the chart an accessible name and its numbers as data attributes, so a reader
without the picture, or a test, gets the same figures.

No I/O here: app/ui/routes.py reads the minutes (`Reads.minutes`) and passes them in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from markupsafe import Markup, escape

WIDTH = 360
HEIGHT = 96
LEFT = 44  # room for the scale's labels
RIGHT = 6
TOP = 8
BOTTOM = 18  # room for the time labels


@dataclass(frozen=True)
class Series:
    name: str
    values: Sequence[float | None]  # one per minute, oldest first; None: nothing to show
    css: str  # a class of ui.css: s0, s1, ...


def _fmt_count(value: float) -> str:
    return f"{value:.0f}"


def _scale(top: float) -> float:
    """A round maximum for the scale: 1, 2 or 5 times a power of ten, at least `top`."""
    if top <= 0:
        return 1.0
    step = 1.0
    while step * 10 <= top:
        step *= 10
    while step > top * 10:
        step /= 10
    for multiple in (1, 2, 5, 10):
        if step * multiple >= top:
            return step * multiple
    return step * 10


def _latest(series: Series, fmt: Callable[[float], str]) -> str:
    value = next((v for v in reversed(series.values) if v is not None), None)
    return "none" if value is None else fmt(value)


def chart(
    name: str,
    testid: str,
    minutes: Sequence[datetime],
    series: Sequence[Series],
    *,
    bars: bool = False,
    fmt: Callable[[float], str] = _fmt_count,
) -> Markup:
    """An SVG chart of `series` over `minutes`: bars (the first series) or lines."""
    count = max(len(minutes), 1)
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = HEIGHT - TOP - BOTTOM
    known = [v for s in series for v in s.values if v is not None]
    top = _scale(max(known, default=0.0))
    slot = plot_w / count

    def x(i: int) -> float:
        return LEFT + slot * i + slot / 2

    def y(value: float) -> float:
        return TOP + plot_h - plot_h * (value / top)

    def label(i: int) -> str:
        return minutes[i].astimezone(UTC).strftime("%H:%M") if i < len(minutes) else ""

    summary = "; ".join(f"{s.name}: latest {_latest(s, fmt)}" for s in series)
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{escape(name)}: {escape(summary)}" data-testid="{escape(testid)}" '
        f'data-minutes="{len(minutes)}" data-max="{escape(fmt(max(known, default=0.0)))}">',
        f"<title>{escape(name)}</title>",
        f'<line class="axis" x1="{LEFT}" y1="{TOP + plot_h}" x2="{WIDTH - RIGHT}" '
        f'y2="{TOP + plot_h}"/>',
        f'<line class="grid" x1="{LEFT}" y1="{TOP}" x2="{WIDTH - RIGHT}" y2="{TOP}"/>',
        f'<text class="scale" x="{LEFT - 4}" y="{TOP + 4}" text-anchor="end">'
        f"{escape(fmt(top))}</text>",
        f'<text class="scale" x="{LEFT - 4}" y="{TOP + plot_h}" text-anchor="end">0</text>',
        f'<text class="scale" x="{LEFT}" y="{HEIGHT - 4}">{label(0)}</text>',
        f'<text class="scale" x="{WIDTH - RIGHT}" y="{HEIGHT - 4}" text-anchor="end">'
        f"{label(len(minutes) - 1)} UTC</text>",
    ]
    for s in series[:1] if bars else series:
        if bars:
            for i, value in enumerate(s.values):
                if not value:
                    continue
                height = plot_h * (value / top)
                parts.append(
                    f'<rect class="bar {s.css}" x="{LEFT + slot * i + slot * 0.1:.1f}" '
                    f'y="{TOP + plot_h - height:.1f}" width="{slot * 0.8:.1f}" '
                    f'height="{height:.1f}"><title>{label(i)} UTC: {escape(fmt(value))} '
                    f"{escape(s.name)}</title></rect>"
                )
            continue
        run: list[str] = []
        for i, value in enumerate([*s.values, None]):
            if value is not None:
                run.append(f"{x(i):.1f},{y(value):.1f}")
                parts.append(
                    f'<circle class="point {s.css}" cx="{x(i):.1f}" cy="{y(value):.1f}" r="1.6">'
                    f"<title>{label(i)} UTC: {escape(fmt(value))} {escape(s.name)}</title></circle>"
                )
            elif run:
                parts.append(f'<polyline class="line {s.css}" points="{" ".join(run)}"/>')
                run = []
    parts.append("</svg>")
    # Safe: every text above is escaped, the rest is numbers this function computed.
    return Markup("".join(parts))  # noqa: S704
