"""Gradient inversion: what DLG, iDLG and Inverting Gradients share.

All three attacks solve the gradient-matching problem of Zhu, Liu and Han, "Deep Leakage from Gradients"
(NeurIPS 2019), Eq. 4,

    x'*, y'* = argmin_{x', y'} D(grad_W l(F(x', W), y'), grad_W)

over a dummy batch ``x'`` (and, for DLG, a dummy soft label ``y'``), where ``grad_W`` is the gradient the
observer saw. They differ in ``D``, the optimiser and the labels:

- DLG (:mod:`.dlg`): squared L2 distance, L-BFGS, label optimised as ``softmax`` of dummy logits;
- iDLG (:mod:`.idlg`): DLG with the label read off the last layer's gradient (Zhao, Mopuri and Bilen 2020);
- Inverting Gradients (:mod:`.inverting_gradients`): ``1 - cosine`` plus total variation, signed Adam,
  box constraint (Geiping, Bauermeister, Droege and Moeller, NeurIPS 2020, Eq. 4).

The observed gradient is ``view.as_gradient()``: for a ``kind="delta"`` view (FedAvg's model delta after
``local_steps`` steps of SGD) that is ``-delta / (lr * local_steps)``, the mean gradient over the local
steps, matched as if it were one gradient at the broadcast weights. This is an approximation (exact for one
local step); Geiping et al. invert the unrolled local steps of federated averaging instead, which is not
done here.

``D`` runs only over the parameters in ``view.update``. Parameters the observer did not see
(``view.hidden``: the AIoT private projector of [AIoT], Sec. 5.5) enter the dummy forward
pass with the values in ``view.model`` (the attacker's guess, or the true values for the "upper bound"
attacker); with ``optimize_hidden=True`` they are optimised jointly with the dummy input, as that paper's
attacker does. The model in the view is never modified: the dummy forward pass uses
``torch.func.functional_call`` on copies of its parameters and buffers, in the module's current
train/eval mode.

:func:`client_gradient_view` builds what an observer of undefended FedAvg-SGD sees (the mean cross-entropy
gradient of one batch); :func:`evaluate_inversion` scores a result against the private batch with
:func:`~fedveil.attacks.image_metrics.reconstruction_metrics`; :func:`save_inversion_grid` draws the
originals above the reconstructions at successive iterations (as [AIoT], Fig. 4).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedveil.attacks.image_metrics import as_images, reconstruction_metrics
from fedveil.attacks.views import ObserverView, UpdateView, require_update_view
from fedveil.core.atomic import atomic_file
from fedveil.errors import ConfigError, ValidationError
from fedveil.models.device import resolve_device

__all__ = [
    "Distance",
    "GradientTarget",
    "InversionResult",
    "client_gradient_view",
    "cosine_distance",
    "dummy_gradients",
    "evaluate_inversion",
    "gradient_matching",
    "gradient_target",
    "save_inversion_grid",
    "squared_l2_distance",
    "total_variation",
]

Distance = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], torch.Tensor]
Init = Literal["uniform", "normal"]
INITS: tuple[str, ...] = ("uniform", "normal")


@dataclass(frozen=True, eq=False)
class InversionResult:
    """What a gradient inversion attack reconstructed.

    ``images`` ``(B, C, H, W)`` in ``[0, 1]`` (the iterate of least objective, clamped) and ``labels``
    ``(B,)``: the attack's labels (``label_source``: ``"optimised"`` by DLG, ``"inferred"`` from the last
    layer's gradient, or ``"given"``). ``history`` holds ``(iteration, images)`` snapshots of the iterates
    (iteration 0 is the initialisation), ``losses[k]`` the objective after ``k`` iterations, both of the
    restart that reached the least objective. ``restarts`` is the number of runs made, ``seconds`` covers
    them all; ``evaluations`` counts objective evaluations (one L-BFGS iteration makes up to 20).
    """

    attack: str
    images: torch.Tensor
    labels: torch.Tensor
    history: list[tuple[int, torch.Tensor]]
    losses: list[float]
    final_loss: float
    seconds: float
    iterations: int
    restarts: int
    evaluations: int
    label_source: str

    @property
    def iterations_per_second(self) -> float:
        """Optimiser iterations (over all restarts) per second of wall-clock time."""
        return self.iterations * self.restarts / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True, eq=False)
class GradientTarget:
    """The gradient-matching problem one view poses.

    ``names`` are the view's parameters in the model's order, ``observed`` their observed gradients
    (``view.as_gradient()``), ``params`` detached copies of all the model's parameters (those in ``names``
    require grad, to differentiate the dummy loss by), ``buffers`` copies of its buffers.
    """

    view: UpdateView
    names: tuple[str, ...]
    observed: tuple[torch.Tensor, ...]
    params: Mapping[str, torch.Tensor]
    buffers: Mapping[str, torch.Tensor]
    image_shape: tuple[int, int, int]
    batch_size: int
    num_classes: int


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    return seed


def gradient_target(
    view: ObserverView,
    attack: str,
    *,
    image_shape: Sequence[int],
    batch_size: int | None = None,
    device: str | torch.device = "cpu",
) -> GradientTarget:
    """The matching problem of ``view`` for images of ``image_shape`` ``(C, H, W)``, posed on ``device``
    (:func:`~fedveil.models.device.resolve_device`: the observed gradients and copies of the model's
    parameters and buffers move there; the view itself is not changed).

    ``batch_size`` defaults to ``view.num_samples`` (else 1). A sealed view raises
    :class:`~fedveil.attacks.views.NoPlaintextView`; a model that does not map a ``(B, C, H, W)`` batch to
    ``(B, num_classes)`` logits raises :class:`ValidationError`.
    """
    uv = require_update_view(view, attack)
    shape = tuple(image_shape)
    if len(shape) != 3 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ConfigError(f"image_shape must be three positive integers (C, H, W), got {image_shape!r}")
    batch = _positive_int("batch_size", batch_size if batch_size is not None else uv.num_samples or 1)
    observed_all = uv.as_gradient()
    names = tuple(n for n, _ in uv.model.named_parameters() if n in observed_all)
    where = resolve_device(device)
    params = {
        n: p.detach().clone().to(where).requires_grad_(n in observed_all)
        for n, p in uv.model.named_parameters()
    }
    buffers = {n: b.detach().clone().to(where) for n, b in uv.model.named_buffers()}
    probe = torch.zeros((batch, *shape), dtype=next(iter(params.values())).dtype, device=where)
    try:
        with torch.no_grad():
            out = functional_call(uv.model, {**params, **buffers}, (probe,))
    except RuntimeError as exc:
        raise ValidationError(
            f"{attack}: the model in the view does not accept images of shape {shape} (batch {batch}): {exc}"
        ) from exc
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != batch:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValidationError(
            f"{attack}: the model maps a batch of {batch} to {got}, expected ({batch}, classes)"
        )
    observed = tuple(observed_all[n].to(device=where, dtype=params[n].dtype) for n in names)
    return GradientTarget(uv, names, observed, params, buffers, shape, batch, int(out.shape[1]))


def dummy_gradients(
    target: GradientTarget,
    x: torch.Tensor,
    label: torch.Tensor,
    *,
    hidden: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``grad_W l(F(x, W), label)`` for the view's parameters, differentiable in ``x`` (DLG, Alg. 1 line 4).

    ``l`` is the batch-mean cross-entropy; ``label`` is either ``(B,)`` class indices (iDLG, IG) or
    ``(B, K)`` probabilities (DLG's ``softmax`` of the dummy label logits, cross-entropy with soft
    targets). ``hidden`` overrides hidden parameters that are being optimised. A parameter the output
    does not depend on has a zero gradient.
    """
    params = {**target.params, **(hidden or {})}
    logits = functional_call(target.view.model, {**params, **target.buffers}, (x,))
    if label.ndim == 1:
        loss = F.cross_entropy(logits, label)
    else:
        loss = -(label * F.log_softmax(logits, dim=-1)).sum(-1).mean()
    wrt = [params[n] for n in target.names]
    grads = torch.autograd.grad(loss, wrt, create_graph=True, allow_unused=True)
    return tuple(torch.zeros_like(p) if g is None else g for p, g in zip(wrt, grads, strict=True))


def squared_l2_distance(dummy: Sequence[torch.Tensor], observed: Sequence[torch.Tensor]) -> torch.Tensor:
    """DLG's distance ``||grad' - grad||^2`` summed over parameters (Zhu et al. 2019, Alg. 1 line 5)."""
    return torch.stack([(d - o).pow(2).sum() for d, o in zip(dummy, observed, strict=True)]).sum()


def cosine_distance(dummy: Sequence[torch.Tensor], observed: Sequence[torch.Tensor]) -> torch.Tensor:
    """``1 - <grad', grad> / (||grad'|| ||grad||)`` over the concatenation of all parameters' gradients
    (Geiping et al. 2020, Eq. 4, as their ``reconstruction_costs`` with ``cost_fn="sim"``)."""
    dot = sum((d * o).sum() for d, o in zip(dummy, observed, strict=True))
    norm_d = torch.sqrt(sum(d.pow(2).sum() for d in dummy))
    norm_o = torch.sqrt(sum(o.pow(2).sum() for o in observed))
    return 1.0 - dot / (norm_d * norm_o).clamp_min(torch.finfo(norm_d.dtype).tiny)


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic total variation, mean ``|dx|`` plus mean ``|dy|`` (Geiping et al. 2020, Eq. 4; their
    ``TV``)."""
    dx = (x[:, :, :, :-1] - x[:, :, :, 1:]).abs().mean()
    dy = (x[:, :, :-1, :] - x[:, :, 1:, :]).abs().mean()
    return dx + dy


@dataclass
class _Run:
    best_loss: float
    best_x: torch.Tensor
    best_label: torch.Tensor | None
    history: list[tuple[int, torch.Tensor]]
    losses: list[float]
    evaluations: int


def _one_run(
    target: GradientTarget,
    gen: torch.Generator,
    *,
    distance: Distance,
    optimizer: Literal["lbfgs", "adam"],
    iterations: int,
    lr: float,
    init: str,
    labels: torch.Tensor | None,
    tv_weight: float,
    signed: bool,
    box: bool,
    lr_milestones: Sequence[int],
    snapshot_every: int,
    optimize_hidden: bool,
) -> _Run:
    dtype = target.observed[0].dtype
    size = (target.batch_size, *target.image_shape)
    draw = torch.rand if init == "uniform" else torch.randn
    where = target.observed[0].device  # drawn on the host (the seeded generator's), then moved there
    x = draw(size, generator=gen, dtype=dtype).to(where).requires_grad_(True)
    label_logits = None
    if labels is None:
        label_logits = torch.randn((target.batch_size, target.num_classes), generator=gen, dtype=dtype)
        label_logits = label_logits.to(where).requires_grad_(True)
    hidden = (
        {n: target.params[n].detach().clone().requires_grad_(True) for n in target.view.hidden}
        if optimize_hidden
        else {}
    )
    variables = [x, *([label_logits] if label_logits is not None else []), *hidden.values()]
    opt: torch.optim.Optimizer = (
        torch.optim.LBFGS(variables, lr=lr, max_iter=20, history_size=100)
        if optimizer == "lbfgs"
        else torch.optim.Adam(variables, lr=lr)
    )
    sched = (
        torch.optim.lr_scheduler.MultiStepLR(opt, list(lr_milestones), gamma=0.1) if lr_milestones else None
    )
    run = _Run(math.inf, x.detach().clone(), None, [(0, x.detach().clamp(0, 1).clone())], [], 0)

    def objective() -> torch.Tensor:
        label = labels if label_logits is None else F.softmax(label_logits, dim=-1)
        loss = distance(dummy_gradients(target, x, label, hidden=hidden), target.observed)
        if tv_weight:
            loss = loss + tv_weight * total_variation(x)
        value = float(loss.detach())
        run.evaluations += 1
        if value < run.best_loss:
            run.best_loss = value
            run.best_x = x.detach().clone()
            run.best_label = None if label_logits is None else label_logits.detach().clone()
        return loss

    def closure() -> torch.Tensor:
        loss = objective()
        for v, g in zip(variables, torch.autograd.grad(loss, variables), strict=True):
            v.grad = g
        if signed:
            x.grad = x.grad.sign()
        return loss

    for it in range(1, iterations + 1):
        loss = float(opt.step(closure).detach())
        run.losses.append(loss)
        if not math.isfinite(loss):
            break
        if box:
            with torch.no_grad():
                x.clamp_(0.0, 1.0)
        if sched is not None:
            sched.step()
        if it % snapshot_every == 0 or it == iterations:
            run.history.append((it, x.detach().clamp(0, 1).clone()))
    else:
        run.losses.append(float(objective().detach()))
    return run


def gradient_matching(
    target: GradientTarget,
    *,
    attack: str,
    distance: Distance,
    optimizer: Literal["lbfgs", "adam"],
    iterations: int,
    lr: float,
    seed: int,
    init: str = "uniform",
    labels: torch.Tensor | None = None,
    label_source: str = "optimised",
    tv_weight: float = 0.0,
    signed: bool = False,
    box: bool = False,
    lr_milestones: Sequence[int] = (),
    restarts: int = 1,
    stop_below: float | None = None,
    snapshot_every: int | None = None,
    optimize_hidden: bool = False,
) -> InversionResult:
    """Minimise ``distance(dummy gradient, observed) + tv_weight * TV(x)`` over a seeded dummy batch.

    ``labels`` ``(B,)`` fixes the labels (iDLG, IG); ``None`` optimises DLG's dummy label logits jointly.
    ``optimizer="lbfgs"`` runs ``iterations`` calls of ``torch.optim.LBFGS.step`` (``max_iter=20``, no line
    search, as the DLG reference code); ``"adam"`` one Adam step per iteration, the image gradient
    replaced by its sign when ``signed``, the learning rate divided by 10 at ``lr_milestones``, the image
    clamped to ``[0, 1]`` after each step when ``box``. Each of ``restarts`` runs starts from a fresh
    draw (``init``: ``"uniform"`` on ``[0, 1]`` or ``"normal"``, DLG's ``randn``) of one generator seeded
    with ``seed``; the result is the iterate with the least objective over all runs (an attacker can
    compute it; it uses no knowledge of the private data). With ``stop_below`` the restarts stop as soon
    as a run reaches an objective at most ``stop_below``. A non-finite objective ends that run.
    Snapshots are taken every ``snapshot_every`` iterations (default ``iterations // 8``).
    """
    iterations = _positive_int("iterations", iterations)
    restarts = _positive_int("restarts", restarts)
    every = _positive_int(
        "snapshot_every", snapshot_every if snapshot_every is not None else max(1, iterations // 8)
    )
    seed = _check_seed(seed)
    if init not in INITS:
        raise ConfigError(f"init must be one of {INITS}, got {init!r}")
    if optimizer not in ("lbfgs", "adam"):
        raise ConfigError(f"optimizer must be 'lbfgs' or 'adam', got {optimizer!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"lr must be a positive finite number, got {lr!r}")
    if (
        isinstance(tv_weight, bool)
        or not isinstance(tv_weight, (int, float))
        or not (math.isfinite(tv_weight) and tv_weight >= 0)
    ):
        raise ConfigError(f"tv_weight must be a non-negative finite number, got {tv_weight!r}")
    if stop_below is not None and (
        isinstance(stop_below, bool)
        or not isinstance(stop_below, (int, float))
        or not (math.isfinite(stop_below) and stop_below >= 0)
    ):
        raise ConfigError(f"stop_below must be None or a non-negative finite number, got {stop_below!r}")
    if optimize_hidden and not target.view.hidden:
        raise ConfigError(f"{attack}: optimize_hidden=True but the view hides no parameter")
    if labels is not None:
        labels = torch.as_tensor(labels).to(target.observed[0].device)
        if labels.shape != (target.batch_size,) or labels.dtype != torch.int64:
            raise ValidationError(
                f"{attack}: labels have shape {tuple(labels.shape)} and dtype {labels.dtype}, "
                f"expected ({target.batch_size},) int64"
            )
        if labels.min() < 0 or labels.max() >= target.num_classes:
            raise ValidationError(
                f"{attack}: labels {labels.tolist()} outside the model's {target.num_classes} classes"
            )
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    runs: list[_Run] = []
    while len(runs) < restarts and not (stop_below is not None and runs and runs[-1].best_loss <= stop_below):
        runs.append(
            _one_run(
                target,
                gen,
                distance=distance,
                optimizer=optimizer,
                iterations=iterations,
                lr=float(lr),
                init=init,
                labels=labels,
                tv_weight=float(tv_weight),
                signed=signed,
                box=box,
                lr_milestones=lr_milestones,
                snapshot_every=every,
                optimize_hidden=optimize_hidden,
            )
        )
    seconds = time.perf_counter() - start
    best = min(runs, key=lambda r: r.best_loss)
    if labels is not None:
        out_labels = labels.clone()
    elif best.best_label is not None:
        out_labels = best.best_label.argmax(dim=-1)
    else:
        raise ValidationError(
            f"{attack}: the objective was not finite at the initialisation; nothing to report"
        )
    return InversionResult(
        attack=attack,
        images=best.best_x.clamp(0.0, 1.0).cpu(),
        labels=out_labels.cpu(),
        history=[(it, image.cpu()) for it, image in best.history],
        losses=best.losses,
        final_loss=best.best_loss,
        seconds=seconds,
        iterations=iterations,
        restarts=len(runs),
        evaluations=sum(r.evaluations for r in runs),
        label_source=label_source,
    )


def client_gradient_view(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    observer: str = "server: per-client gradient",
    hidden: Sequence[str] = (),
    attacker_model: nn.Module | None = None,
) -> UpdateView:
    """The view of an observer of undefended FedAvg-SGD: the mean cross-entropy gradient of one batch.

    The gradient of ``F.cross_entropy(model(x), y)`` (batch mean) is taken for every trainable parameter
    of ``model`` except those in ``hidden`` (they stay on the device, e.g. the AIoT private projector);
    ``model``'s ``.grad`` fields are not touched. The view's model is ``model`` itself, or, when given, a
    copy of ``attacker_model`` (same architecture, holding the attacker's guess for ``hidden``) with the
    shared parameters and buffers of ``model`` copied in, as the broadcast gives them; a gradient that does
    not fit the attacker's model (a missing parameter, another shape) is rejected by :class:`UpdateView`,
    naming the parameter.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise ValidationError(f"x and y must be tensors, got {type(x).__name__} and {type(y).__name__}")
    if y.ndim != 1 or y.dtype != torch.int64 or x.shape[:1] != y.shape:
        raise ValidationError(
            f"labels y have shape {tuple(y.shape)} and dtype {y.dtype}: expected ({x.shape[0]},) int64, "
            "one class index per example of x"
        )
    params = dict(model.named_parameters())
    for name in hidden:
        if name not in params:
            raise ValidationError(f"{observer}: hidden parameter {name!r} is not in the model")
    shared = [(n, p) for n, p in params.items() if p.requires_grad and n not in hidden]
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, [p for _, p in shared])
    view_model = model
    if attacker_model is not None:
        view_model = copy.deepcopy(attacker_model)
        theirs = dict(view_model.state_dict(keep_vars=True))
        with torch.no_grad():
            for name, value in model.state_dict().items():
                if name not in hidden and name in theirs and theirs[name].shape == value.shape:
                    theirs[name].copy_(value)
    return UpdateView(
        observer=observer,
        kind="gradient",
        update={n: g.detach().clone() for (n, _), g in zip(shared, grads, strict=True)},
        model=view_model,
        num_samples=int(x.shape[0]),
        hidden=tuple(hidden),
    )


def evaluate_inversion(
    result: InversionResult, original_images: torch.Tensor, original_labels: torch.Tensor | None = None
) -> dict[str, object]:
    """:func:`~fedveil.attacks.image_metrics.reconstruction_metrics` of ``result`` against the private batch,
    plus the attack's name, ``final_loss``, ``seconds``, ``iterations_per_second`` and ``label_source``."""
    metrics = reconstruction_metrics(
        original_images, result.images, original_labels, None if original_labels is None else result.labels
    )
    metrics.update(
        attack=result.attack,
        final_loss=result.final_loss,
        seconds=result.seconds,
        iterations_per_second=result.iterations_per_second,
        label_source=result.label_source,
    )
    return metrics


def save_inversion_grid(
    path: str | Path,
    originals: torch.Tensor,
    result: InversionResult,
    *,
    original_labels: torch.Tensor | None = None,
    max_rows: int = 9,
    dpi: int = 100,
) -> Path:
    """A PNG grid: the originals in the first row, below them the reconstructions at successive snapshot
    iterations (as [AIoT], Fig. 4), columns in the originals' order after
    :func:`~fedveil.attacks.image_metrics.match_permutation`, titled with the metrics.

    At most ``max_rows - 1`` snapshots are drawn (evenly spaced, the last always included). ``path`` must
    end in ``.png``; missing parent folders are created and the file is replaced atomically.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"path must end in .png, got {str(out)!r}")
    max_rows = _positive_int("max_rows", max_rows)
    if max_rows < 2:
        raise ConfigError(f"max_rows must be at least 2 (originals and one snapshot), got {max_rows}")
    orig = as_images(originals, "originals").to(torch.float32)
    metrics = evaluate_inversion(result, orig, original_labels)
    perm = torch.as_tensor(metrics["permutation"])
    snaps = result.history
    if len(snaps) > max_rows - 1:
        picks = torch.linspace(0, len(snaps) - 1, max_rows - 1).round().long().unique().tolist()
        snaps = [snaps[i] for i in picks]
    rows = [("original", orig), *((f"iter {it}", imgs[perm]) for it, imgs in snaps)]
    batch = orig.shape[0]
    fig = Figure(figsize=(1.3 * batch + 0.9, 1.3 * len(rows) + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), batch, squeeze=False)
    for r, (name, imgs) in enumerate(rows):
        for b in range(batch):
            ax = axes[r][b]
            img = imgs[b].detach().clamp(0, 1)
            if img.shape[0] == 1:
                ax.imshow(img[0].numpy(), cmap="gray", vmin=0.0, vmax=1.0)
            else:
                ax.imshow(img.permute(1, 2, 0).numpy()[..., :3])
            ax.set_xticks([])
            ax.set_yticks([])
            if b == 0:
                ax.set_ylabel(name, fontsize=8)
    title = (
        f"{result.attack}: MSE {metrics['mse_mean']:.4f}  PSNR {metrics['psnr_mean']:.1f} dB  "
        f"SSIM {metrics['ssim_mean']:.3f}"
    )
    if "label_accuracy" in metrics:
        title += f"  label acc {metrics['label_accuracy']:.2f}"
    fig.suptitle(title, fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as fh:
        fig.savefig(fh, format="png", dpi=_positive_int("dpi", dpi))
    return out
