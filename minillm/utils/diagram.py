"""Boxes, arrows and cell grids for the notebooks' conceptual diagrams (plumbing, not a lesson).

A notebook draws a diagram (a block's shapes, a memory layout, a cache filling, a schedule over
time) from these few shapes, so every diagram in the course looks alike and each notebook's
cell shows only what the picture says. Coordinates are data units of a canvas `width` by
`height`; (0, 0) is the lower left.

    fig, ax = canvas(8, 3, "x -> RMSNorm -> y")
    box(ax, 0, 1, 2, 1, "x\\n[B, S, D]", role="activation")
    arrow(ax, (2, 1.5), (3, 1.5), "normalise")
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Rectangle

# One colour per role, so a weight looks like a weight in every notebook.
COLORS = {
    "activation": "#dbe9f6",  # tensors that flow: hidden states, q/k/v, logits
    "weight": "#fde2c4",  # parameters read from the checkpoint
    "op": "#e4f1dc",  # a computation: matmul, softmax, norm
    "cache": "#efe0f5",  # the KV cache, its blocks and slots
    "free": "#f4f4f4",  # unused memory, free blocks
    "highlight": "#fbd3d3",  # the one thing the picture is about
}


def canvas(width: float, height: float, title: str | None = None, scale: float = 1.0):
    """A figure whose axes run 0..width by 0..height in data units, without ticks or frame."""
    fig, ax = plt.subplots(figsize=(width * scale, height * scale))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title)
    return fig, ax


def box(ax, x: float, y: float, w: float, h: float, text: str = "", role: str = "activation",
        fontsize: float = 9, **patch_kw) -> FancyBboxPatch:
    """A rounded box with centred text; `role` picks its colour from COLORS."""
    patch = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                           facecolor=COLORS[role], edgecolor="0.25", linewidth=1, **patch_kw)
    ax.add_patch(patch)
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)
    return patch


def arrow(ax, start: tuple[float, float], end: tuple[float, float], text: str = "",
          fontsize: float = 8, color: str = "0.3", offset: tuple[float, float] = (0.1, 0.1)) -> None:
    """An arrow from start to end, with an optional label beside its midpoint."""
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, linewidth=1.2))
    if text:
        mid = ((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1])
        ax.text(*mid, text, fontsize=fontsize, color=color, ha="left", va="bottom")


def cells(ax, x: float, y: float, labels: list[str], roles: list[str] | str = "activation",
          size: float = 0.6, vertical: bool = False, fontsize: float = 8) -> list[tuple[float, float]]:
    """A row (or column) of square cells, e.g. a storage's elements or a cache's slots.

    Returns each cell's centre, so arrows can point at a cell.
    """
    roles = [roles] * len(labels) if isinstance(roles, str) else roles
    if len(roles) != len(labels):
        raise ValueError(f"cells: {len(labels)} labels but {len(roles)} roles")
    centres = []
    for i, (label, role) in enumerate(zip(labels, roles)):
        cx, cy = (x, y - i * size) if vertical else (x + i * size, y)
        ax.add_patch(Rectangle((cx, cy), size, size, facecolor=COLORS[role], edgecolor="0.25", linewidth=0.8))
        ax.text(cx + size / 2, cy + size / 2, label, ha="center", va="center", fontsize=fontsize)
        centres.append((cx + size / 2, cy + size / 2))
    return centres
