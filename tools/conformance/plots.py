"""Inline SVG plots of a conformance report (no dependency, no external resource).

- :func:`numerics_svg`: per backend, each numerics case's relative error natively and under mpx
  against its tolerance, on a log axis;
- :func:`traces_svg`: per backend, each loss-scale trace natively against the spec (log2 axis),
  with the first step where they diverge marked.

>>> svg = numerics_svg("torch", [("numerics.exp.mixed_float16", 1e-5, 2e-4, 1e-7)])
>>> svg.startswith("<svg") and "exp fp16" in svg
True
"""

from __future__ import annotations

import html
import math

__all__ = ["COLORS", "first_divergence", "numerics_svg", "standalone", "traces_svg"]

COLORS = {"native": "#d9730d", "mpx": "#2b6cb0", "spec": "#555", "tolerance": "#c53030"}
_FLOOR = 1e-9  # errors of exactly 0 are drawn here


def _label(case: str) -> str:
    parts = case.split(".")
    short = {"mixed_float16": "fp16", "mixed_bfloat16": "bf16", "float32": "fp32"}
    return " ".join([parts[1], *[short.get(p, p) for p in parts[2:]]])


def _num(x: float) -> str:
    return f"{x:.1f}"


def numerics_svg(backend: str, rows: list[tuple[str, float, float | None, float | None]]) -> str:
    """One panel: ``rows`` are (case id, tolerance, native error, mpx error); None where not run."""
    left, top, step, height = 58, 44, 22, 190
    width = left + step * max(1, len(rows)) + 70
    lo, hi = -9, 1  # log10 range

    def y(err: float) -> float:
        v = math.log10(max(err, _FLOOR)) if math.isfinite(err) else hi
        return top + (hi - min(max(v, lo), hi)) / (hi - lo) * height

    e = html.escape
    out = [f"<svg class='plot' role='img' width='{width}' height='{top + height + 110}' "
           f"viewBox='0 0 {width} {top + height + 110}' aria-label='numerics error against tolerance, {e(backend)}'>",
           f"<text x='{left}' y='16' font-size='13' font-weight='600'>{e(backend)}: relative error vs tolerance "
           "(log scale)</text>"]  # fmt: skip
    for p in range(lo, hi + 1):
        yy = _num(y(10.0**p))
        out.append(f"<line x1='{left}' x2='{width - 10}' y1='{yy}' y2='{yy}' stroke='#eee'/>")
        tick = f"1e{p}" if p > lo else f"0, 1e{p}"
        out.append(f"<text x='{left - 6}' y='{yy}' font-size='10' text-anchor='end' dominant-baseline='middle'>{tick}</text>")
    out.append(f"<line x1='{left}' x2='{left}' y1='{top}' y2='{top + height}' stroke='#999'/>")
    for i, (case, tol, native, mpx_err) in enumerate(rows):
        x = left + step * i + step / 2
        out.append(f"<line x1='{_num(x - 8)}' x2='{_num(x + 8)}' y1='{_num(y(tol))}' y2='{_num(y(tol))}' "
                   f"stroke='{COLORS['tolerance']}' stroke-width='2'><title>tolerance {tol:g}</title></line>")  # fmt: skip
        if native is not None:
            mark = "✗" if native > tol else ""
            out.append(f"<circle cx='{_num(x - 3)}' cy='{_num(y(native))}' r='4' fill='{COLORS['native']}'>"
                       f"<title>{e(case)} native {native:.3g} {mark}</title></circle>")  # fmt: skip
        if mpx_err is not None:
            out.append(f"<rect x='{_num(x)}' y='{_num(y(mpx_err) - 3.5)}' width='7' height='7' fill='{COLORS['mpx']}'>"
                       f"<title>{e(case)} mpx {mpx_err:.3g}</title></rect>")  # fmt: skip
        ty = top + height + 8
        out.append(f"<text font-size='10' transform='translate({_num(x + 3)},{ty}) rotate(60)'>{e(_label(case))}</text>")
    lx = left + 4
    out.append(f"<circle cx='{lx}' cy='29' r='4' fill='{COLORS['native']}'/><text x='{lx + 8}' y='33' font-size='11'>native</text>"
               f"<rect x='{lx + 60}' y='25.5' width='7' height='7' fill='{COLORS['mpx']}'/><text x='{lx + 72}' y='33' font-size='11'>mpx</text>"
               f"<line x1='{lx + 110}' x2='{lx + 126}' y1='29' y2='29' stroke='{COLORS['tolerance']}' stroke-width='2'/>"
               f"<text x='{lx + 130}' y='33' font-size='11'>tolerance (errors of 0 sit on the bottom line)</text>")  # fmt: skip
    out.append("</svg>")
    return "".join(out)


def standalone(svg: str) -> str:
    """An inline ``<svg>`` as a file of its own (which needs the SVG namespace; inline SVG in HTML does not)."""
    return svg.replace("<svg ", "<svg xmlns='http://www.w3.org/2000/svg' ", 1)


def first_divergence(spec: list[float], observed: list[float]) -> int | None:
    """The first step (0-based) where two traces differ, or None when they are equal."""
    for i, (a, b) in enumerate(zip(spec, observed, strict=False)):
        if a != b:
            return i
    return None if len(spec) == len(observed) else min(len(spec), len(observed))


def traces_svg(backend: str, traces: list[tuple[str, list[float], list[float] | None]]) -> str:
    """Small multiples: ``traces`` are (case id, spec scales, native scales or None where it produced none)."""
    pw, ph, cols = 250, 120, 4
    rows = max(1, math.ceil(len(traces) / cols))
    width, height = pw * cols + 10, ph * rows + 34
    e = html.escape
    out = [f"<svg class='plot' role='img' width='{width}' height='{height}' "
           f"viewBox='0 0 {width} {height}' aria-label='scale traces native vs spec, {e(backend)}'>",
           f"<text x='4' y='16' font-size='13' font-weight='600'>{e(backend)}: loss scale per step, native vs spec "
           "(log2 scale)</text>",
           f"<line x1='430' x2='450' y1='12' y2='12' stroke='{COLORS['spec']}' stroke-width='3'/>"
           "<text x='454' y='16' font-size='11'>spec (mpx)</text>"
           f"<line x1='530' x2='550' y1='12' y2='12' stroke='{COLORS['native']}' stroke-width='2' stroke-dasharray='4 2'/>"
           "<text x='554' y='16' font-size='11'>native</text>"
           f"<circle cx='620' cy='12' r='4' fill='none' stroke='{COLORS['tolerance']}' stroke-width='2'/>"
           "<text x='628' y='16' font-size='11'>first divergence</text>"]  # fmt: skip
    for k, (case, spec, native) in enumerate(traces):
        ox, oy = (k % cols) * pw + 8, (k // cols) * ph + 30
        values = [v for v in [*spec, *(native or [])] if v > 0 and math.isfinite(v)] or [1.0]
        lo, hi = math.log2(min(values)), math.log2(max(values))
        hi = hi if hi > lo else lo + 1
        n = max(len(spec), len(native or []), 2)
        x0, x1, y0, y1 = ox + 26, ox + pw - 14, oy + 22, oy + ph - 18

        def xy(i: int, v: float, x0=x0, x1=x1, y0=y0, y1=y1, lo=lo, hi=hi, n=n) -> str:
            yv = math.log2(v) if v > 0 and math.isfinite(v) else lo
            return f"{_num(x0 + (x1 - x0) * i / (n - 1))},{_num(y1 - (y1 - y0) * (yv - lo) / (hi - lo))}"

        at = first_divergence(spec, native) if native is not None else None
        status = "no native trace" if native is None else ("matches" if at is None else f"diverges at step {at + 1}")
        out.append(f"<rect x='{ox}' y='{oy}' width='{pw - 8}' height='{ph - 6}' fill='#fafafa' stroke='#ddd'/>")
        out.append(f"<text x='{ox + 4}' y='{oy + 13}' font-size='10.5'>{e(case.split('.', 1)[1])}: {status}</text>")
        out.append(f"<text x='{ox + 2}' y='{y0 + 4}' font-size='9'>2^{hi:.0f}</text>"
                   f"<text x='{ox + 2}' y='{y1}' font-size='9'>2^{lo:.0f}</text>")  # fmt: skip
        out.append(f"<polyline fill='none' stroke='{COLORS['spec']}' stroke-width='3' stroke-opacity='.6' "
                   f"points='{' '.join(xy(i, v) for i, v in enumerate(spec))}'/>")  # fmt: skip
        if native:
            out.append(f"<polyline fill='none' stroke='{COLORS['native']}' stroke-width='1.6' stroke-dasharray='4 2' "
                       f"points='{' '.join(xy(i, v) for i, v in enumerate(native))}'/>")  # fmt: skip
        if at is not None and native and at < len(native):
            cx, cy = xy(at, native[at]).split(",")
            out.append(f"<circle cx='{cx}' cy='{cy}' r='4.5' fill='none' stroke='{COLORS['tolerance']}' stroke-width='2'>"
                       f"<title>step {at + 1}: spec {f'{spec[at]:g}' if at < len(spec) else '-'}, native {native[at]:g}"
                       "</title></circle>")  # fmt: skip
    out.append("</svg>")
    return "".join(out)
