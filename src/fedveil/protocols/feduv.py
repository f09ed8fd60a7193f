"""FedUV (Alg. 2) and its baselines softmax and FedAwS, in one FedAvg harness.

All three methods train a user-verification net ``x -> g_theta(x) -> FC (W, b)`` (Table 2; any module
with a ``features`` feature extractor and an ``fc`` :class:`torch.nn.Linear` head) with FedAvg as the
paper's Algorithm 1, then deploy it with a per-user warm-up threshold, then evaluate (Table 3):

1. **Set-up.** FedUV, *Codeword Selection* of Alg. 2: the server gives every user a unique base vector
   ``b_u`` of ``l_b`` bits (:func:`fedveil.privacy.codewords.assign_base_vectors`); the user draws
   ``r_u`` (``l_r = k - l_b`` bits) from its own seeded generator, builds ``v_u = C(b_u || r_u)`` with
   the public BCH code ``C`` and keeps ``r_u`` and ``v_u``: it answers with an acknowledgement only.
   Softmax and FedAwS: the server gives every user its class index ``u`` (the row ``w_u`` of ``W``).
2. **Training**, Alg. 1: each round the server picks ``kappa = max(floor(eps K), 1)`` users uniformly
   without replacement, sends ``theta_{t-1}``; each runs UserUpdate (``E`` local epochs over its ``n_u``
   examples, reshuffled every epoch by its own generator, batches of ``B``, plain SGD with the round's
   rate ``eta_t = eta / (1 + decay (t - 1))``: Appendix B's "learning rate of 0.1 and learning rate
   decay of 0.01", read as Keras' time-based decay applied per round) and returns ``theta_t^u, n_u``;
   the server averages, weighted by ``n_u``. The losses:

   - FedUV: ``l_pos = max(0, 1 - (1/c) v_y^T sigma(W g(x) + b))`` with ``sigma`` scaling to norm
     ``sqrt(c)`` (Eq. 4, Alg. 2); ``c`` is the code length.
   - softmax: cross-entropy of the logits ``W g(x) + b`` (``c`` = number of users) with label ``y``.
   - FedAwS (Yu et al., ICML 2020): the cosine positive loss ``max(0, m - cos(g(x), w_y))^2`` with
     ``m = 0.9``; a user's request carries only its own row of ``W`` (the others are zeroed: FedAwS keeps
     class embeddings from other users, not from the server). After averaging ``theta`` the server sets
     each trained row ``w_u`` to user ``u``'s reply and runs ``spreadout_steps`` steps of gradient descent
     on ``reg_sp(W) / (K - 1)``, ``reg_sp(W) = sum_u sum_{u' != u} max(0, nu - ||w^_u - w^_u'||)^2`` over
     the unit-normalised rows ``w^`` (Euclidean distance), with ``nu = sqrt(2)`` (pairs pushed until
     orthogonal or further) and the round's learning rate (:func:`spreadout_regularizer`).
3. **Deployment and warm-up** (Alg. 2): every user receives the final model, scores its ``n`` warm-up
   inputs (its validation examples) and sets ``tau`` to the ``i``-th smallest score, ``i = floor(n (1 -
   q))`` (at least 1), for a target TPR ``q``; it then accepts an input when its score ``>= tau``
   (:func:`warmup_threshold`, :func:`verify`). The score is a cosine for every method: FedUV's Eq. 5
   ``(1/c) v_u^T sigma(W g(x) + b)``, and ``cos(g(x), w_u)`` for softmax and FedAwS.
4. **Evaluation** (:mod:`fedveil.eval.uv`): each user scores its own examples of a split (genuine) and
   every other user's examples of a probe set (impostors) and sends back two histograms and the
   counts its threshold accepts. The probe sets are the experimenter's evaluation data, readable by every
   simulated user; nothing of another user's *state* is.

The client pool :class:`UvClients` runs each phase for many users together (``batched=True``: one
``vmap`` over the users of a training phase, the probe set embedded once per evaluation) or one by one;
``tests/test_protocols_feduv.py`` shows both give the same numbers.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedveil.core.communicator import ClientId, Communicator
from fedveil.data.federated import FederatedDataset
from fedveil.errors import ConfigError, ValidationError
from fedveil.eval.uv import DEFAULT_BINS, UvEvaluation, evaluate_histograms, score_histogram
from fedveil.eval.verification import DEFAULT_FPR_TARGETS
from fedveil.models.device import resolve_device
from fedveil.models.feduv import Scaling, feduv_scores
from fedveil.models.flat import FlatModel
from fedveil.privacy.codes import BchCode, bch_code
from fedveil.privacy.codewords import (
    DEFAULT_BASE_BITS,
    Codeword,
    assign_base_vectors,
    make_codeword,
    validate_base_vectors,
)
from fedveil.protocols.common import RoundReport, client_rng, expect, fill_traffic
from fedveil.protocols.fedavg import FedAvgEngine, FitResult, fedavg_aggregate, select_connected
from fedveil.protocols.feduv_messages import (
    BaseVector,
    ClassAssignment,
    ClassReady,
    CodewordReady,
    Deploy,
    Deployed,
    EvalReply,
    EvalRequest,
    UvTrainReply,
    UvTrainRequest,
)
from fedveil.protocols.local import LocalOptimizer, local_train, local_train_cohort

__all__ = [
    "DEFAULT_TARGET_TPR",
    "FEDAWS_POSITIVE_MARGIN",
    "FEDAWS_SPREADOUT_MARGIN",
    "METHODS",
    "FedAwSMethod",
    "FedAwSServer",
    "FedUVMethod",
    "FedUVServer",
    "SoftmaxMethod",
    "SoftmaxServer",
    "UvClients",
    "UvMethod",
    "UvModel",
    "UvServer",
    "UvTrainConfig",
    "check_target_tpr",
    "spreadout_regularizer",
    "spreadout_step",
    "verify",
    "warmup_threshold",
]

DEFAULT_TARGET_TPR = 0.9
"""Sec. 4.2: "say q = 90%"."""

FEDAWS_POSITIVE_MARGIN = 0.9
"""FedAwS' positive loss ``max(0, 0.9 - cos(g(x), w_y))^2`` (Yu et al. 2020's cosine contrastive loss)."""

FEDAWS_SPREADOUT_MARGIN = math.sqrt(2.0)
"""``nu`` of ``reg_sp``: the distance of two orthogonal unit vectors."""


# --- settings -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UvTrainConfig:
    """Alg. 1 settings shared by the three methods.

    ``fraction`` is ``eps`` (users per round ``max(floor(eps K), 1)``; the paper: 0.01), ``local_epochs``
    ``E`` (paper: 1), ``batch_size`` ``B`` (not stated in the paper; 10 here), ``lr`` ``eta`` (0.1) and
    ``lr_decay`` (0.01, :meth:`lr_at`); ``timeout`` the simulated seconds a phase waits and
    ``min_replies`` the fewest replies that update the model.
    """

    fraction: float = 0.01
    local_epochs: int = 1
    batch_size: int = 10
    lr: float = 0.1
    lr_decay: float = 0.01
    timeout: float = 60.0
    min_replies: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"fraction {self.fraction!r} of users per round must be in (0, 1]")
        for name in ("local_epochs", "batch_size", "min_replies"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} {value!r} must be an integer >= 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr {self.lr!r} must be a finite number > 0")
        if not (math.isfinite(self.lr_decay) and self.lr_decay >= 0):
            raise ConfigError(f"lr_decay {self.lr_decay!r} must be a finite number >= 0")
        if not self.timeout > 0:
            raise ConfigError(f"timeout {self.timeout!r} must be > 0 seconds")

    def lr_at(self, rnd: int) -> float:
        """``eta_t = eta / (1 + decay (t - 1))`` for round ``t = 1, 2, ...``."""
        return self.lr / (1.0 + self.lr_decay * (rnd - 1))

    def cohort_size(self, num_users: int) -> int:
        """``kappa = max(floor(eps K), 1)`` (Alg. 1), at most ``K``."""
        return min(num_users, max(math.floor(self.fraction * num_users + 1e-9), 1))


def check_target_tpr(q: object) -> float:
    """``q`` as a float in the open interval (0, 1), or :class:`ConfigError` naming it."""
    if isinstance(q, bool) or not isinstance(q, (int, float, np.floating)) or not 0.0 < float(q) < 1.0:
        raise ConfigError(
            f"target TPR q={q!r} must be a number strictly between 0 and 1 (e.g. {DEFAULT_TARGET_TPR})"
        )
    return float(q)


def warmup_threshold(scores: np.ndarray, q: float = DEFAULT_TARGET_TPR) -> float:
    """Alg. 2 Warm-up: ``tau`` = the ``i``-th smallest of the ``n`` warm-up scores, ``i = floor(n (1 - q))``.

    ``i`` counts from 1; when ``n (1 - q) < 1`` the smallest score is used (``i = 1``), so at least a
    fraction ``q`` of the warm-up inputs (all of them then) is accepted by ``score >= tau``.
    """
    q = check_target_tpr(q)
    arr = np.asarray(scores, dtype=np.float64).ravel()
    if arr.size == 0 or not np.isfinite(arr).all():
        raise ValidationError(f"warm-up needs one or more scores, all finite; got {arr.size} scores")
    i = max(math.floor(arr.size * (1.0 - q) + 1e-9), 1)
    return float(np.partition(arr, i - 1)[i - 1])


def verify(scores: np.ndarray | float, tau: float) -> np.ndarray:
    """Eq. 5: accept (True) where ``score >= tau``."""
    return np.asarray(scores) >= tau


# --- the model, functionally --------------------------------------------------------------------------


class UvModel:
    """A verification net seen through one flat float32 vector (:class:`FlatModel`), split into its parts.

    ``net`` must hold every parameter in ``net.features`` (``x -> g(x)``, ``(B, D)``) and ``net.fc`` (an
    ``nn.Linear(D, c)``, with or without bias). :meth:`parts` evaluates ``g(x)``, ``W`` ``(c, D)`` and
    ``b`` ``(c,)`` (or ``None``) for a flat parameter vector, so losses and scores can use any of them.
    """

    def __init__(self, net: nn.Module) -> None:
        features, fc = getattr(net, "features", None), getattr(net, "fc", None)
        if not isinstance(features, nn.Module) or not isinstance(fc, nn.Linear):
            raise ConfigError("a UV net needs a 'features' module and an 'fc' nn.Linear head (Table 2)")
        self.net = net
        self.flat = FlatModel(net)
        stray = [n for n in self.flat.names if not n.startswith(("features.", "fc."))]
        if stray:
            raise ConfigError(f"parameters outside 'features' and 'fc' are not supported: {stray[:3]}")
        self.num_outputs = fc.out_features
        self.embedding_dim = fc.in_features
        self.has_bias = fc.bias is not None
        offsets = np.cumsum([0, *self.flat.sizes])
        self._slices = {
            name: slice(int(offsets[i]), int(offsets[i + 1])) for i, name in enumerate(self.flat.names)
        }

    @property
    def num_params(self) -> int:
        """Length of the flat vector."""
        return self.flat.num_params

    def initial(self) -> np.ndarray:
        """The net's current parameters, flat float32."""
        return self.flat.initial()

    def feature_params(self, p: torch.Tensor) -> torch.Tensor:
        """The parameters of ``features`` only, concatenated in flat order."""
        return torch.cat([p[s] for n, s in self._slices.items() if n.startswith("features.")])

    def slice_of(self, name: str) -> slice:
        """Where parameter ``name`` (e.g. ``"fc.weight"``) lies in the flat vector."""
        return self._slices[name]

    def parts(
        self, p: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(g(x) (B, D), W (c, D), b (c,) or None)`` under flat parameters ``p``."""
        params = self.flat.unflatten(p)
        feats = {k[len("features.") :]: v for k, v in params.items() if k.startswith("features.")}
        g = functional_call(self.net.features, feats, (x,))
        return g, params["fc.weight"], params.get("fc.bias")


def _linear(g: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    z = g @ w.T
    return z if b is None else z + b


# --- the three methods --------------------------------------------------------------------------------


class UvMethod(ABC):
    """What distinguishes FedUV, softmax and FedAwS on the user's side: the local loss, the
    representation an input is scored by, and the user's template it is compared with."""

    name: ClassVar[str]
    head_in_representation: ClassVar[bool] = False
    """Whether :meth:`representation` reads ``W`` and ``b`` (FedUV) or only ``g(x)`` (the baselines)."""

    @abstractmethod
    def loss(
        self, g: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor
    ) -> torch.Tensor:
        """Mean loss of a batch with features ``g`` ``(B, D)`` for the user whose ``target`` is given
        (FedUV: ``v_u`` ``(c,)``; baselines: the one-hot ``e_u`` ``(c,)``)."""

    @abstractmethod
    def representation(self, g: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """``(B, m)``: what a score compares with the template."""

    @abstractmethod
    def template(self, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The user's ``(m,)`` reference: FedUV ``v_u``; baselines ``w_u``."""

    @abstractmethod
    def scores(self, h: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
        """``(B,)`` verification scores in [-1, 1]."""


class FedUVMethod(UvMethod):
    """Alg. 2: ``l_pos = max(0, 1 - (1/c) v_y^T sigma(W g(x) + b))``; score ``(1/c) v_u^T sigma(...)``."""

    name = "feduv"
    head_in_representation = True

    def __init__(self) -> None:
        self.scale = Scaling()

    def representation(self, g: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return self.scale(_linear(g, w, b))

    def loss(
        self, g: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor
    ) -> torch.Tensor:
        out = self.representation(g, w, b)
        return torch.relu(1.0 - (out * target).sum(dim=1) / out.shape[1]).mean()

    def template(self, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return target

    def scores(self, h: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
        return feduv_scores(h, template)


class _CosineMethod(UvMethod):
    """Baselines scored by ``cos(g(x), w_u)`` with ``w_u`` the user's row of ``W``."""

    def representation(self, g: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return g

    def template(self, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return target @ w

    def scores(self, h: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
        return F.normalize(h, dim=1) @ F.normalize(template, dim=0)


class SoftmaxMethod(_CosineMethod):
    """Regular FedAvg with softmax cross-entropy over one class per user (Sec. 6.2's "softmax")."""

    name = "softmax"

    def loss(
        self, g: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor
    ) -> torch.Tensor:
        return -(F.log_softmax(_linear(g, w, b), dim=1) @ target).mean()


class FedAwSMethod(_CosineMethod):
    """FedAwS' client loss: only the positive term ``max(0, m - cos(g(x), w_y))^2``."""

    name = "fedaws"

    def __init__(self, positive_margin: float = FEDAWS_POSITIVE_MARGIN) -> None:
        if not (math.isfinite(positive_margin) and -1.0 < positive_margin <= 1.0):
            raise ConfigError(f"positive_margin {positive_margin!r} must be a cosine in (-1, 1]")
        self.positive_margin = positive_margin

    def loss(
        self, g: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor
    ) -> torch.Tensor:
        cos = self.scores(g, target @ w)
        return torch.relu(self.positive_margin - cos).square().mean()


METHODS: dict[str, type[UvMethod]] = {"feduv": FedUVMethod, "softmax": SoftmaxMethod, "fedaws": FedAwSMethod}


# --- FedAwS' server-side regulariser ------------------------------------------------------------------


def spreadout_regularizer(w: torch.Tensor, margin: float = FEDAWS_SPREADOUT_MARGIN) -> torch.Tensor:
    """``reg_sp(W) = sum_u sum_{u' != u} max(0, nu - ||w^_u - w^_u'||)^2`` over ordered pairs of the
    unit-normalised rows ``w^`` of ``W`` ``(K, D)`` (Sec. 3.3 of the FedUV paper; Yu et al. 2020)."""
    unit = F.normalize(w, dim=1)
    sq = (2.0 - 2.0 * unit @ unit.T).clamp_min(1e-12)
    off = ~torch.eye(w.shape[0], dtype=torch.bool)
    return torch.relu(margin - sq.sqrt()[off]).square().sum()


def spreadout_step(w: np.ndarray, *, margin: float, steps: int, lr: float) -> np.ndarray:
    """``steps`` steps of ``W <- W - lr grad(reg_sp(W) / (K - 1))`` on class embeddings ``(K, D)``."""
    t = torch.tensor(np.asarray(w, dtype=np.float32))
    scale = 1.0 / max(t.shape[0] - 1, 1)
    for _ in range(steps):
        t.requires_grad_(True)
        (grad,) = torch.autograd.grad(spreadout_regularizer(t, margin) * scale, t)
        t = (t - lr * grad).detach()
    return t.numpy()


# --- the clients --------------------------------------------------------------------------------------


class SplitSource(Protocol):
    """Named data sets of users (e.g. :class:`fedveil.data.mnist_uv.UvSplits`)."""

    def split(self, name: str) -> FederatedDataset: ...


@dataclass
class _User:
    """One user's own state. Only this user's handlers read it; ``codeword`` never leaves it."""

    index: int
    rng: np.random.Generator
    codeword: Codeword | None = None
    class_index: int | None = None
    deployed: torch.Tensor | None = None
    threshold: float | None = None


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.tensor(np.asarray(array, dtype=np.float32))


class UvClients:
    """The users of FedUV, softmax or FedAwS in a simulation (a ``ClientPool`` of the runtime).

    The users are those of ``data.split(train_split)``; each trains on its examples there (array
    ``x_key``), warms up on ``data.split(warmup_split)`` and is evaluated on whatever split and probe set
    an :class:`EvalRequest` names. User ``i`` draws everything random (``r_u``, batch order) from its own
    generator ``client_rng(seed, i)``. ``batched`` chooses the vmap path or the one-by-one path.
    ``device`` (:func:`~fedveil.models.device.resolve_device`) is where the users train and score: the
    net moves there, and each user's training examples move there once; replies carry host arrays.
    """

    def __init__(
        self,
        method: UvMethod,
        model: UvModel,
        data: SplitSource,
        *,
        seed: int,
        batched: bool = True,
        train_split: str = "train",
        warmup_split: str = "val",
        x_key: str = "x",
        code_cache_dir: str | None = None,
        eval_batch: int = 512,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = resolve_device(device)
        model.net.to(self.device)
        self._train_x: dict[ClientId, torch.Tensor] = {}
        self.method = method
        self.model = model
        self.data = data
        self.batched = batched
        self.train_split = train_split
        self.warmup_split = warmup_split
        self.x_key = x_key
        self.code_cache_dir = code_cache_dir
        self.eval_batch = eval_batch
        self.ids = list(data.split(train_split).user_ids)
        self._users = {cid: _User(i, client_rng(seed, i)) for i, cid in enumerate(self.ids)}
        self._codes: dict[tuple[int, int], BchCode] = {}

    def client_ids(self) -> list[ClientId]:
        """Every user of the training split."""
        return self.ids

    def rng_states(self) -> dict[ClientId, Any]:
        """Every user's generator state, for a resumed simulation
        (:func:`~fedveil.protocols.common.pool_rng_states`). A user's codeword is not among what is
        saved: set-up draws it again from the same seeded generator."""
        return {cid: user.rng.bit_generator.state for cid, user in self._users.items()}

    def set_rng_states(self, states: Mapping[ClientId, Any]) -> None:
        """Set the users' generators to ``states`` (from :meth:`rng_states`)."""
        for cid, state in states.items():
            self._users[cid].rng.bit_generator.state = state

    def handle_batch(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Dispatch each user's message to its phase; several users of one phase are handled together."""
        out: dict[ClientId, object] = {}
        phases: dict[type, dict[ClientId, object]] = {}
        for cid, m in msgs.items():
            phases.setdefault(type(m), {})[cid] = m
        handlers: dict[type, Callable[[dict[ClientId, object]], dict[ClientId, object]]] = {
            BaseVector: self._codeword,
            ClassAssignment: self._class,
            UvTrainRequest: self._train,
            Deploy: self._deploy,
            EvalRequest: self._evaluate,
        }
        for kind, group in phases.items():
            handler = handlers.get(kind)
            if handler is None:
                out.update({c: ValidationError(f"a UV user cannot handle {kind.__name__}") for c in group})
                continue
            try:
                out.update(handler(group))
            except (ValueError, RuntimeError) as exc:
                out.update({c: exc for c in group})
        return out

    # -- set-up

    def _code(self, n: int, k: int) -> BchCode:
        if (n, k) not in self._codes:
            self._codes[(n, k)] = bch_code(n, k, cache_dir=self.code_cache_dir)
        return self._codes[(n, k)]

    def _codeword(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Alg. 2, user side: ``v_u = C(b_u || r_u)`` with fresh local ``r_u``; reply with an ack only.
        A user that already holds a codeword of this code for the same ``b_u`` (a restarted server runs
        set-up again) keeps it: its training target does not change in the middle of a run."""
        out: dict[ClientId, object] = {}
        for cid, m in msgs.items():
            assert isinstance(m, BaseVector)
            if self.method.name != "feduv":
                out[cid] = ValidationError(f"a {self.method.name} user takes no base vector")
                continue
            code = self._code(m.code_n, m.code_k)
            if code.n != self.model.num_outputs:
                out[cid] = ValidationError(
                    f"code length {code.n} differs from the net's c={self.model.num_outputs}"
                )
                continue
            user = self._users[cid]
            held = user.codeword
            if (
                held is not None
                and (held.bits.size, held.base_bits.size + held.random_bits.size) == (code.n, code.k)
                and np.array_equal(held.base_bits, m.base_bits)
            ):
                out[cid] = CodewordReady(code.n)
                continue
            try:
                user.codeword = make_codeword(
                    np.array(m.base_bits), code, code.k - m.base_bits.size, user.rng
                )
            except (ConfigError, ValidationError) as exc:
                out[cid] = exc
                continue
            out[cid] = CodewordReady(code.n)
        return out

    def _class(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        out: dict[ClientId, object] = {}
        for cid, m in msgs.items():
            assert isinstance(m, ClassAssignment)
            if self.method.name == "feduv" or m.num_classes != self.model.num_outputs:
                out[cid] = ValidationError(
                    f"class assignment of {m.num_classes} classes does not fit a {self.method.name} net "
                    f"with c={self.model.num_outputs}"
                )
                continue
            if not 0 <= m.class_index < m.num_classes:
                out[cid] = ValidationError(f"class index {m.class_index} outside [0, {m.num_classes})")
                continue
            self._users[cid].class_index = m.class_index
            out[cid] = ClassReady(m.class_index)
        return out

    def _target(self, cid: ClientId) -> torch.Tensor:
        """The user's private training target: ``v_u`` (FedUV) or its one-hot class (baselines)."""
        user = self._users[cid]
        if self.method.name == "feduv":
            if user.codeword is None:
                raise ValidationError(f"user {cid} has no codeword yet: run codeword selection first")
            return torch.from_numpy(np.array(user.codeword.vector, dtype=np.float32)).to(self.device)
        if user.class_index is None:
            raise ValidationError(f"user {cid} has no class yet: run the class assignment first")
        one_hot = F.one_hot(torch.tensor(user.class_index), self.model.num_outputs)
        return one_hot.to(device=self.device, dtype=torch.float32)

    # -- training (Alg. 1, UserUpdate)

    def _loss(self, p: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        g, w, b = self.model.parts(p, x)
        return self.method.loss(g, w, b, target)

    def _train(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        jobs = {}
        for cid, m in msgs.items():
            assert isinstance(m, UvTrainRequest)
            if cid not in self._train_x:  # moved to the device once
                self._train_x[cid] = _tensor(self.data.split(self.train_split).array(cid, self.x_key)).to(
                    self.device
                )
            x = self._train_x[cid]
            rng = self._users[cid].rng
            orders = [
                torch.from_numpy(rng.permutation(len(x))).to(self.device) for _ in range(m.local_epochs)
            ]
            jobs[cid] = (m, x, self._target(cid), orders)
        new: dict[ClientId, tuple[np.ndarray, float]] = {}
        if self.batched:
            groups: dict[tuple[int, int, int, float, tuple[int, ...]], list[ClientId]] = {}
            for cid, (m, x, _, _) in jobs.items():
                groups.setdefault(
                    (len(x), m.local_epochs, m.batch_size, m.lr, tuple(x.shape[1:])), []
                ).append(cid)
            for (n, epochs, bsz, lr, _), group in groups.items():
                p = torch.stack([_tensor(jobs[c][0].weights) for c in group]).to(self.device)
                targets = torch.stack([jobs[c][2] for c in group])
                batches = []
                for e in range(epochs):
                    xs = torch.stack([jobs[c][1][jobs[c][3][e]] for c in group])
                    batches.extend((xs[:, s : s + bsz], targets) for s in range(0, n, bsz))
                p, mean_loss = local_train_cohort(self._loss, p, batches, LocalOptimizer(lr=lr), lr)
                new.update({c: (p[i].cpu().numpy(), float(mean_loss[i])) for i, c in enumerate(group)})
        else:
            for cid, (m, x, target, orders) in jobs.items():
                batches = [
                    (x[order][s : s + m.batch_size], target)
                    for order in orders
                    for s in range(0, len(x), m.batch_size)
                ]
                p0 = _tensor(m.weights).to(self.device)
                p, loss = local_train(self._loss, p0, batches, LocalOptimizer(lr=m.lr), m.lr)
                new[cid] = (p.cpu().numpy(), float(loss))
        return {
            cid: UvTrainReply(m.round, len(jobs[cid][1]), new[cid][1], new[cid][0])
            for cid, m in msgs.items()
            if isinstance(m, UvTrainRequest)
        }

    # -- deployment, warm-up and evaluation

    def _represent(self, p: torch.Tensor, x: np.ndarray) -> torch.Tensor:
        """The method's representation of inputs ``x`` under deployed weights ``p``, in fixed chunks."""
        xt = _tensor(x).to(self.device)
        with torch.no_grad():
            return torch.cat(
                [
                    self.method.representation(*self.model.parts(p, xt[s : s + self.eval_batch]))
                    for s in range(0, len(xt), self.eval_batch)
                ]
            )

    def _representation_key(self, p: torch.Tensor) -> bytes:
        """Digest of the parameters a representation depends on: users with equal keys share the
        probe set's representations (batched path only)."""
        used = p if self.method.head_in_representation else self.model.feature_params(p)
        return hashlib.blake2b(used.cpu().numpy().tobytes(), digest_size=16).digest()

    def _scores(self, cid: ClientId, h: torch.Tensor) -> np.ndarray:
        user = self._users[cid]
        assert user.deployed is not None
        w = user.deployed[self.model.slice_of("fc.weight")].view(self.model.num_outputs, -1)
        with torch.no_grad():
            template = self.method.template(self._target(cid), w)
            return self.method.scores(h, template).cpu().numpy()

    def _deploy(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Alg. 2 Warm-up, per user: score the warm-up inputs, keep ``tau`` locally."""
        out: dict[ClientId, object] = {}
        warmup = self.data.split(self.warmup_split)
        for cid, m in msgs.items():
            assert isinstance(m, Deploy)
            user = self._users[cid]
            user.deployed = _tensor(m.weights).to(self.device)
            x = warmup.array(cid, self.x_key)
            user.threshold = warmup_threshold(self._scores(cid, self._represent(user.deployed, x)), m.q)
            out[cid] = Deployed(len(x))
        return out

    def _evaluate(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Score own examples (genuine) and everybody else's probe examples (impostors); histograms."""
        out: dict[ClientId, object] = {}
        shared: dict[tuple[bytes, str], dict[str, torch.Tensor]] = {}
        for cid, m in msgs.items():
            assert isinstance(m, EvalRequest)
            user = self._users[cid]
            if user.deployed is None or user.threshold is None:
                out[cid] = ValidationError(f"user {cid} has no deployed model: deploy before evaluating")
                continue
            genuine_x = self.data.split(m.genuine).array(cid, self.x_key)
            probe = self.data.split(m.impostor)
            key = (self._representation_key(user.deployed), m.impostor) if self.batched else (b"", "")
            if self.batched and key in shared:
                reps = shared[key]
            else:
                reps = {o.user_id: self._represent(user.deployed, o.arrays[self.x_key]) for o in probe}
                if self.batched:
                    shared[key] = reps
            genuine = self._scores(cid, self._represent(user.deployed, genuine_x))
            impostor = np.concatenate(
                [self._scores(cid, h) for owner, h in reps.items() if owner != cid] or [np.zeros(0)]
            )
            tau = user.threshold
            out[cid] = EvalReply(
                int(np.sum(verify(genuine, tau))),
                int(np.sum(verify(impostor, tau))),
                score_histogram(genuine, m.bins),
                score_histogram(impostor, m.bins),
            )
        return out


# --- the servers --------------------------------------------------------------------------------------


class UvServer(ABC):
    """The server of the three methods: set-up (per method), Alg. 1 rounds, deployment, evaluation."""

    method: ClassVar[str]

    def __init__(
        self,
        cfg: UvTrainConfig,
        model: UvModel,
        rng: np.random.Generator,
        initial_weights: np.ndarray | None = None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.rng = rng
        weights = np.array(model.initial() if initial_weights is None else initial_weights, dtype=np.float32)
        if weights.shape != (model.num_params,):
            raise ConfigError(f"initial weights of shape {weights.shape}, expected ({model.num_params},)")
        self.members: list[ClientId] = []
        self.deployed: list[ClientId] = []
        self.engine = FedAvgEngine(
            weights,
            rng,
            select=lambda rnd, r, connected: self.select(connected),
            configure=self._configure,
            reply_type=UvTrainReply,
            aggregate=lambda rnd, results, current: self.aggregate(results, cfg.lr_at(rnd)),
            timeout=cfg.timeout,
            min_replies=cfg.min_replies,
        )

    @property
    def _weights(self) -> np.ndarray:
        return self.engine.current

    @property
    def weights(self) -> np.ndarray:
        """The global model, flat float32 (a copy)."""
        return self.engine.weights

    @abstractmethod
    async def setup(self, comm: Communicator) -> RoundReport:
        """Prepare every reachable user; those that answer become :attr:`members`."""

    def _weights_for(self, cid: ClientId, shared: np.ndarray) -> np.ndarray:
        """What user ``cid`` receives of the model (default: everything, the same object for all)."""
        return shared

    def select(self, connected: Sequence[ClientId]) -> list[ClientId]:
        """Alg. 1: ``kappa`` (of all ``K`` members) of the members ``connected`` now (a device that is down
        is never selected; fewer when fewer are connected, none: a round not applied), uniformly without
        replacement."""
        if not self.members:
            raise ConfigError("no members: run setup() before training")
        return select_connected(self.members, connected, self.cfg.cohort_size(len(self.members)), self.rng)

    async def run_round(self, rnd: int, comm: Communicator) -> RoundReport:
        """One Alg. 1 round on the FedAvg engine: select, UserUpdate on each selected user, aggregate."""
        report = await self.engine.run_round(rnd, comm)
        report.extra["lr"] = self.cfg.lr_at(rnd)
        return report

    def _configure(self, rnd: int, cohort: Sequence[ClientId], shared: np.ndarray) -> dict[ClientId, object]:
        cfg, lr = self.cfg, self.cfg.lr_at(rnd)
        return {
            c: UvTrainRequest(rnd, lr, cfg.local_epochs, cfg.batch_size, self._weights_for(c, shared))
            for c in cohort
        }

    def aggregate(self, replies: Mapping[ClientId, FitResult], lr: float) -> np.ndarray:
        """Alg. 1: ``theta_t = sum_u n_u theta_t^u / sum_u n_u`` (the engine's :func:`fedavg_aggregate`)."""
        return fedavg_aggregate(0, replies, self._weights)

    async def deploy(self, comm: Communicator, q: float = DEFAULT_TARGET_TPR) -> RoundReport:
        """Send the final model to every member; each runs its warm-up for target TPR ``q``."""
        q = check_target_tpr(q)
        before = comm.stats().copy()
        shared = self._weights
        msgs = {c: Deploy(q, self._weights_for(c, shared)) for c in self.members}

        def check(cid: ClientId, msg: Deployed) -> None:
            expect(msg.num_inputs >= 1, f"warm-up on {msg.num_inputs} inputs; at least 1 is needed")

        replies = await comm.request(
            msgs,
            phase="deploy",
            min_replies=len(msgs),
            timeout=self.cfg.timeout,
            expected=Deployed,
            validate=check,
        )
        self.deployed = [c for c in self.members if c in replies]
        report = RoundReport(0, bool(replies), None, 1, len(msgs), len(replies))
        return fill_traffic(report, before, comm.stats())

    async def evaluate(
        self,
        comm: Communicator,
        genuine: str,
        impostor: str,
        *,
        bins: int = DEFAULT_BINS,
        fpr_targets: Sequence[float] = DEFAULT_FPR_TARGETS,
    ) -> UvEvaluation:
        """Pooled ROC of every deployed user's genuine (``genuine`` split) and impostor (``impostor`` probe
        set) scores, from the users' histograms (:func:`fedveil.eval.uv.evaluate_histograms`)."""
        users = self.deployed
        if not users:
            raise ConfigError("no deployed users: run deploy() before evaluate()")
        request = EvalRequest(genuine, impostor, bins)

        def check(cid: ClientId, msg: EvalReply) -> None:
            for name in ("genuine_counts", "impostor_counts"):
                counts = getattr(msg, name)
                expect(counts.shape == (bins,), f"{name} of shape {counts.shape}, expected ({bins},)")
                expect(bool((counts >= 0).all()), f"{name} has negative counts")
            expect(
                0 <= msg.genuine_accepted <= int(msg.genuine_counts.sum()),
                "genuine_accepted exceeds its total",
            )
            expect(
                0 <= msg.impostor_accepted <= int(msg.impostor_counts.sum()),
                "impostor_accepted exceeds its total",
            )

        replies = await comm.request(
            {c: request for c in users},
            phase="evaluate",
            min_replies=len(users),
            timeout=self.cfg.timeout,
            expected=EvalReply,
            validate=check,
        )
        if not replies:
            raise ValidationError("no user answered the evaluation")
        return evaluate_histograms(
            sum(m.genuine_counts for m in replies.values()),
            sum(m.impostor_counts for m in replies.values()),
            genuine_accepted=sum(m.genuine_accepted for m in replies.values()),
            impostor_accepted=sum(m.impostor_accepted for m in replies.values()),
            users=len(replies),
            fpr_targets=fpr_targets,
        )


class FedUVServer(UvServer):
    """FedUV's server: Alg. 2's codeword selection, then plain FedAvg (it never sees a codeword).

    ``code_length`` is ``c`` (must equal the net's FC output size), ``message_length`` the BCH ``k``
    (default: the smallest valid ``k >= 64``, Table 1), ``base_bits`` ``l_b`` (paper: 32).
    """

    method = "feduv"

    def __init__(
        self,
        cfg: UvTrainConfig,
        model: UvModel,
        rng: np.random.Generator,
        *,
        code_length: int,
        message_length: int | None = None,
        base_bits: int = DEFAULT_BASE_BITS,
        code_cache_dir: str | None = None,
        initial_weights: np.ndarray | None = None,
    ) -> None:
        super().__init__(cfg, model, rng, initial_weights)
        self.code = bch_code(code_length, message_length, cache_dir=code_cache_dir)
        if self.code.n != model.num_outputs:
            raise ConfigError(
                f"code length {self.code.n} must equal the net's FC output size c={model.num_outputs}"
            )
        if self.code.k - base_bits < 32:
            raise ConfigError(
                f"BCH({self.code.n}, {self.code.k}) leaves k - l_b = {self.code.k - base_bits} random bits; "
                f"l_r >= 32 is needed: use l_b <= {self.code.k - 32} or a code with k >= {base_bits + 32}"
            )
        self.base_bits = base_bits
        self.base_vectors: dict[ClientId, np.ndarray] = {}

    async def setup(self, comm: Communicator) -> RoundReport:
        """Alg. 2, Codeword Selection: a unique ``b_u`` to each user; the users that build a codeword
        become members."""
        before = comm.stats().copy()
        users = list(comm.available())
        base = assign_base_vectors(len(users), self.base_bits, rng=self.rng)
        validate_base_vectors(base)
        self.base_vectors = dict(zip(users, base, strict=True))
        msgs = {c: BaseVector(self.code.n, self.code.k, b) for c, b in self.base_vectors.items()}

        def check(cid: ClientId, msg: CodewordReady) -> None:
            expect(msg.code_n == self.code.n, f"codeword of length {msg.code_n}, expected {self.code.n}")

        replies = await comm.request(
            msgs,
            phase="codewords",
            min_replies=len(msgs),
            timeout=self.cfg.timeout,
            expected=CodewordReady,
            validate=check,
        )
        self.members = [c for c in users if c in replies]
        report = RoundReport(0, bool(self.members), None, 1, len(msgs), len(replies))
        return fill_traffic(report, before, comm.stats())


class _ClassServer(UvServer):
    """Baselines: user ``i`` of the reachable users (in order) owns class ``i``; ``c`` must equal ``K``."""

    def __init__(
        self,
        cfg: UvTrainConfig,
        model: UvModel,
        rng: np.random.Generator,
        initial_weights: np.ndarray | None = None,
    ) -> None:
        super().__init__(cfg, model, rng, initial_weights)
        self.classes: dict[ClientId, int] = {}

    async def setup(self, comm: Communicator) -> RoundReport:
        before = comm.stats().copy()
        users = list(comm.available())
        if len(users) != self.model.num_outputs:
            raise ConfigError(
                f"{self.method} needs one class per user: {len(users)} users but the net has "
                f"c={self.model.num_outputs} outputs"
            )
        self.classes = {c: i for i, c in enumerate(users)}
        msgs = {c: ClassAssignment(i, len(users)) for c, i in self.classes.items()}

        def check(cid: ClientId, msg: ClassReady) -> None:
            expect(
                msg.class_index == self.classes[cid],
                f"took class {msg.class_index}, expected {self.classes[cid]}",
            )

        replies = await comm.request(
            msgs,
            phase="classes",
            min_replies=len(msgs),
            timeout=self.cfg.timeout,
            expected=ClassReady,
            validate=check,
        )
        self.members = [c for c in users if c in replies]
        report = RoundReport(0, bool(self.members), None, 1, len(msgs), len(replies))
        return fill_traffic(report, before, comm.stats())


class SoftmaxServer(_ClassServer):
    """Regular FedAvg of the softmax classifier: all of ``W`` is shared with every user."""

    method = "softmax"


class FedAwSServer(_ClassServer):
    """FedAwS (Yu et al. 2020): FedAvg of ``theta``, each user's own embedding row, then spreadout.

    ``spreadout_margin`` is ``nu``, ``spreadout_steps`` the number of gradient steps on
    ``reg_sp(W) / (K - 1)`` after every round, with learning rate ``spreadout_lr`` (default: the round's
    ``eta_t``). Users receive ``theta`` and their own row ``w_u`` only.
    """

    method = "fedaws"

    def __init__(
        self,
        cfg: UvTrainConfig,
        model: UvModel,
        rng: np.random.Generator,
        *,
        spreadout_margin: float = FEDAWS_SPREADOUT_MARGIN,
        spreadout_steps: int = 5,
        spreadout_lr: float | None = None,
        initial_weights: np.ndarray | None = None,
    ) -> None:
        super().__init__(cfg, model, rng, initial_weights)
        if model.has_bias:
            raise ConfigError("FedAwS reads the rows of W as class embeddings: build the net with bias=False")
        if not (math.isfinite(spreadout_margin) and 0 < spreadout_margin <= 2):
            raise ConfigError(f"spreadout_margin nu={spreadout_margin!r} must be a distance in (0, 2]")
        if isinstance(spreadout_steps, bool) or not isinstance(spreadout_steps, int) or spreadout_steps < 0:
            raise ConfigError(f"spreadout_steps {spreadout_steps!r} must be an integer >= 0")
        if spreadout_lr is not None and not (math.isfinite(spreadout_lr) and spreadout_lr > 0):
            raise ConfigError(f"spreadout_lr {spreadout_lr!r} must be a finite number > 0 (or None)")
        self.spreadout_margin = spreadout_margin
        self.spreadout_steps = spreadout_steps
        self.spreadout_lr = spreadout_lr
        self._rows = model.slice_of("fc.weight")

    def _embeddings(self, flat: np.ndarray) -> np.ndarray:
        return flat[self._rows].reshape(self.model.num_outputs, self.model.embedding_dim)

    def _weights_for(self, cid: ClientId, shared: np.ndarray) -> np.ndarray:
        """``theta`` and the user's own row of ``W``; every other class embedding zeroed."""
        own = shared.copy()
        w = self._embeddings(own)
        keep = w[self.classes[cid]].copy()
        w[:] = 0.0
        w[self.classes[cid]] = keep
        return own

    def aggregate(self, replies: Mapping[ClientId, FitResult], lr: float) -> np.ndarray:
        """FedAvg of ``theta``; row ``w_u`` from user ``u``'s reply; then ``reg_sp`` steps on ``W``."""
        out = super().aggregate(replies, lr)
        w = self._embeddings(self._weights).copy()
        for cid, m in replies.items():
            w[self.classes[cid]] = self._embeddings(np.asarray(m.weights))[self.classes[cid]]
        step_lr = lr if self.spreadout_lr is None else self.spreadout_lr
        w = spreadout_step(w, margin=self.spreadout_margin, steps=self.spreadout_steps, lr=step_lr)
        out[self._rows] = w.reshape(-1)
        return out
