"""A Gantt chart of a simulated step (matplotlib, imported only here)."""

from __future__ import annotations

__all__ = ["plot"]

_COLORS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "optimizer": "#8172B2",
    "copy": "#CCB974",
    "wait": "#BBBBBB",
    "all_gather": "#DD8452",
    "reduce_scatter": "#C44E52",
    "all_reduce": "#937860",
    "all_to_all": "#DA8BC3",
}


def plot(result, path=None, ax=None, title=None):
    """Draws ``result.spans``, one row per stream, colour by kind; saves to ``path`` if given."""
    try:
        import matplotlib

        if ax is None and path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is the demo extra
        raise ImportError("SimResult.plot needs matplotlib: pip install 'fsdpfn[demo]'") from e
    streams = sorted({s.stream for s in result.spans}, key=lambda s: (s != "compute", s))
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(streams)))
    scale = 1e3
    for row, stream in enumerate(streams):
        for s in (s for s in result.spans if s.stream == stream):
            ax.barh(
                row,
                (s.end - s.start) * scale,
                left=s.start * scale,
                color=_COLORS.get(s.kind, "#999999"),
                edgecolor="white",
                linewidth=0.3,
            )
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels(streams)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [
        matplotlib.patches.Patch(color=c, label=k) for k, c in _COLORS.items() if any(s.kind == k for s in result.spans)
    ]
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), fontsize=8, frameon=False
    )
    ax.set_title(
        title or f"step {result.step_time * 1e3:,.1f} ms, exposed communication {result.exposed_comm * 1e3:,.1f} ms"
    )
    fig = fig or ax.figure
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
