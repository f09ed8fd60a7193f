"""PNG plots of verification metrics (ROC curves), drawn with matplotlib's Agg canvas, and what every plot
of a run shares: one colour per method (:func:`method_colours`) and the PNG writer (:func:`save_png`).

The figures are plain :class:`matplotlib.figure.Figure` objects attached to a ``FigureCanvasAgg``; pyplot is
never imported, so nothing is registered in pyplot's global figure manager and no backend is switched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from fedveil.errors import ConfigError
from fedveil.eval.verification import Roc

__all__ = ["method_colours", "plot_roc", "roc_figure", "save_png"]


def method_colours(methods: Iterable[str]) -> dict[str, str]:
    """One colour (``"#rrggbb"``) per method, in order of first appearance: matplotlib's ``tab10``, then
    ``tab20``'s lighter shades for methods 11 to 20, then round again. A run computes this map once from
    its methods and passes it to every plot it draws, so a method has the same colour in all of them."""
    palette = [to_hex(c) for c in colormaps["tab10"].colors]
    palette += [to_hex(c) for c in colormaps["tab20"].colors[1::2]]
    out: dict[str, str] = {}
    for name in methods:
        if name not in out:
            out[name] = palette[len(out) % len(palette)]
    return out


def save_png(fig: Figure, path: str | Path, *, dpi: int | None = None) -> Path:
    """Write ``fig`` as a PNG at ``path`` (which must end in ``.png``; missing parent folders are
    created) at ``dpi`` (default: the figure's own) and return the path."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"path must end in .png, got {str(out)!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=dpi if dpi is not None else "figure")
    return out


def plot_roc(
    curves: Mapping[str, Roc],
    path: str | Path,
    *,
    title: str = "ROC",
    log_fpr: bool = False,
    log_tpr: bool = False,
    dpi: int = 120,
    colours: Mapping[str, str] | None = None,
) -> Path:
    """Draw one or more ROC curves (TPR against FPR) into a PNG file at ``path`` and return its path
    (:func:`roc_figure` draws them; ``path`` must end in ``.png``, missing parent folders are created)."""
    if Path(path).suffix.lower() != ".png":
        raise ConfigError(f"path must end in .png, got {str(path)!r}")
    fig = roc_figure(curves, title=title, log_fpr=log_fpr, log_tpr=log_tpr, colours=colours)
    return save_png(fig, path, dpi=dpi)


def roc_figure(
    curves: Mapping[str, Roc],
    *,
    title: str = "ROC",
    log_fpr: bool = False,
    log_tpr: bool = False,
    colours: Mapping[str, str] | None = None,
) -> Figure:
    """One or more ROC curves (TPR against FPR) on one axes, each in its ``colours`` entry (default:
    :func:`method_colours` of the curves' names).

    Each curve is labelled ``"<name> (AUC = x.xxx)"``, the area by the trapezoidal rule over the curve's
    vertices. With ``log_fpr=True`` the FPR axis is logarithmic: vertices with FPR = 0 cannot be drawn
    there and are left out, and the axis starts at the smallest positive FPR of all curves (at most 0.1).
    Otherwise the chance diagonal is drawn too. ``log_tpr=True`` (with ``log_fpr``) gives log-log axes,
    as membership-inference papers draw them (Carlini et al. 2022, Fig. 1): vertices with TPR = 0 are left
    out too and the dotted chance line starts at the smallest positive FPR.
    """
    if not curves:
        raise ConfigError("curves is empty; give at least one name -> Roc")
    for name, roc in curves.items():
        if not isinstance(roc, Roc):
            raise ConfigError(f"curves[{name!r}] must be a Roc, got {type(roc).__name__}")
    if log_tpr and not log_fpr:
        raise ConfigError("log_tpr=True needs log_fpr=True (log-log axes)")
    colours = colours if colours is not None else method_colours(curves)
    fig = Figure(figsize=(5.0, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, roc in curves.items():
        keep = (roc.fpr > 0) & ((roc.tpr > 0) if log_tpr else True) if log_fpr else slice(None)
        ax.plot(
            roc.fpr[keep], roc.tpr[keep], color=colours.get(name), label=f"{name} (AUC = {roc.auc():.3f})"
        )
    if log_fpr:
        positive = [roc.fpr[roc.fpr > 0] for roc in curves.values()]
        smallest = min((float(p.min()) for p in positive if p.size), default=0.1)
        ax.set_xscale("log")
        ax.set_xlim(min(smallest, 0.1), 1.0)
    else:
        ax.plot([0.0, 1.0], [0.0, 1.0], linestyle=":", color="grey", linewidth=1.0)
        ax.set_xlim(0.0, 1.0)
    if log_tpr:
        low = min(smallest, 0.1)
        ax.plot([low, 1.0], [low, 1.0], linestyle=":", color="grey", linewidth=1.0)
        ax.set_yscale("log")
        ax.set_ylim(low, 1.01)
    else:
        ax.set_ylim(0.0, 1.01)
    ax.set_xlabel("false positive rate (FPR)" + (", log scale" if log_fpr else ""))
    ax.set_ylabel("true positive rate (TPR)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    return fig
