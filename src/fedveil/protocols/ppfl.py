"""PPFL: greedy layer-wise federated training inside client and server TEEs ([PPFL]).

**Stages.** A :class:`~fedveil.models.vision.LayerwiseNet` is a chain of layer units. PPFL trains its
convolutional units one at a time (or in blocks of ``k``, Sec. 6.5), each with a classifier ``C`` atop
it, until all convolutional layers are trained; "then, the classifier atop all Conv layers is finally
trained" (Sec. 6.2): :func:`plan_stages`. A convolutional stage trains the units of its block and a
classifier that "follows the last convolutional layer and fully-connected layers of the target model"
(Sec. 6.2): a fresh copy of the model's last convolutional unit (its input channels set to what the stage
outputs) followed by the model's FC units (the first one's input size recomputed); for the stage of the
last convolutional layer, which nothing convolutional follows, a fresh copy of the FC units. The final stage
(Table 4's "clf.") trains the model's own FC units atop all the frozen convolutional layers, so that the
trained network *is* the target model (:func:`stage_net`). With ``classifier_stage=False`` there is no
final stage and the last convolutional stage trains the model's own FC units as its classifier instead
(one stage fewer). The paper's Fig. 2 curves are the accuracy of "layer + classifier" after each stage.

**Alg. 1 (server)** (:class:`PpflServer`): for each stage, the clients whose TEE holds more than the
stage's training memory ``S_l`` (:func:`tee_memory`) are eligible; ``theta_l`` is initialised inside
the server's enclave (:mod:`fedveil.enclave.layerwise`); each round a cohort of the eligible clients
(all of them, as in Alg. 1, unless ``clients_per_round`` is set: Table 3 trains 10 of 100 per round)
receives ``theta_l`` sealed to its TEE, and their sealed updates are averaged inside the enclave
(the one :class:`~fedveil.protocols.fedavg.FedAvgEngine`, with the model held in the enclave). After
``rounds_per_stage`` rounds, or earlier when the stage's evaluation accuracy stops improving for
``patience`` evaluations, the stage's layers are released to the REE and broadcast to every client,
frozen. A convolutional stage's classifier is a training aid and never leaves the enclave; the final
stage's layers (the model's own FC layers) are released unless ``keep_classifier_in_tee`` keeps them
inside (Sec. 4.1's defence of the last layer against membership inference; :func:`kept_on_release`). With
``target_accuracy`` training stops as soon as an evaluation reaches it (Table 3's "rounds to reach").

**Alg. 2 (client)** (:class:`PpflClients`): the REE runs the frozen, released layers ``1..l-1`` on the
client's examples (model partitioned execution) and hands ``T_{l-1}`` and the labels to its TEE
(:class:`ClientTee`), which opens ``theta_l``, trains layer and classifier for ``local_epochs`` epochs
with SGD (momentum, and the rate decayed by ``epoch_decay`` after each epoch) and seals the result to the
server's enclave. The REE computes ``T_{l-1}`` once per round for all the client's examples (the
frozen layers do not change within a round), rather than again in every epoch as Eq. 2 counts it.

**Emulated TEEs.** In simulation the trusted computations (server enclave, client TEEs) run in the
same process as their hosts; the boundary is the protocol: the host, the REE and the network handle
``theta_l`` only as AES-GCM records bound to a session agreed after attestation (X25519 + HKDF, the
enclave's simulated quote verified by each client TEE), which is an improvement on the paper's
hard-coded AES-CBC keys (Sec. 5.1); ``tests/test_protocols_ppfl.py`` relays every byte of a whole run
through a spy and finds no trained value in it. The server's enclave can also run in its own process
(``boundary="process"``). Client TEEs are not attested to the server (the paper's neither).

**On an accelerator.** ``device`` is where the simulation computes each client, its REE and its
emulated TEE alike (:class:`PpflClients`): the frozen layers, and the TEE's training and evaluation of
``theta_l``, which is opened from its record in host memory, moves to the device, and comes back to
host memory to be sealed. An emulated TEE on a GPU is still emulated: what protects ``theta_l`` is the
sealed channel, not hardware, exactly as on the CPU. On a real deployment the TEE computes on the
device's CPU (TrustZone's secure world and an SGX enclave cannot reach a GPU), so there only the REE's
frozen layers could use an accelerator; the GPU setting is for simulating many clients faster. The
server's enclave stays numpy on the CPU in every case.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedveil.core.attestation_verify import EnclaveClientSession
from fedveil.core.communicator import ClientId, Communicator
from fedveil.data.federated import FederatedDataset
from fedveil.enclave.layerwise import ParamSpec
from fedveil.errors import ConfigError, FedveilError, ValidationError
from fedveil.models.device import resolve_device
from fedveil.models.flat import FlatModel
from fedveil.models.measure import LiveBytes
from fedveil.models.vision import LayerwiseNet
from fedveil.models.zoo import INITS, darknet_bound
from fedveil.protocols.common import RoundReport, client_rng, expect
from fedveil.protocols.enclave_relay import LayerwiseEnclave
from fedveil.protocols.fedavg import BATCH_BELOW_PARAMS, FedAvgEngine, FitResult, select_connected
from fedveil.protocols.local import LocalOptimizer, local_train, local_train_cohort
from fedveil.protocols.messages import Register, RegistrationCall, SessionOffer, SessionReady
from fedveil.protocols.ppfl_messages import (
    LayerEvalReply,
    LayerEvalRequest,
    LayerFitReply,
    LayerFitRequest,
    LayerRelease,
    LayerReleased,
    PublicLayers,
    PublicLayersSet,
)
from fedveil.protocols.registration import attest_clients, register_clients

__all__ = [
    "ClientTee",
    "PpflClients",
    "PpflConfig",
    "PpflServer",
    "Stage",
    "StageNet",
    "TeeMemory",
    "kept_on_release",
    "measure_tee_memory",
    "plan",
    "plan_stages",
    "plan_transfer",
    "public_unit_values",
    "stage_net",
    "tee_memory",
]

HIKEY_TEE_BYTES = 16 * 2**20
"""The HiKey 960's TrustZone secure memory, PPFL Sec. 5.1: every device's TEE size by default."""
TEE_ATTRIBUTE = "tee_bytes"
ROLE_ATTRIBUTE = "role"


# --- stages ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` trains the model's layer units ``units`` (a block; one unit by default) with a
    classifier atop them; ``last`` when its classifier is the model's own FC units. A transfer stage
    (``classifier`` false, :func:`plan_transfer`) trains the model's last units themselves, with no
    classifier of its own. ``pool``: how the classifier's input is brought to the spatial size the
    model's last convolution sees (:data:`CLASSIFIER_POOLS`, :func:`stage_net`)."""

    index: int
    units: tuple[int, ...]
    last: bool
    classifier: bool = True
    pool: str = "none"


CLASSIFIER_POOLS = ("none", "avg", "max")
"""How a conv stage's classifier takes the stage's output. ``none``: as it is, so an early stage's
classifier (the model's last conv unit and FC units, PPFL Sec. 6.2) flattens a full-resolution map into
its first FC layer: VGG9's first stage then carries a 65,536 x 512 layer (33.6 M values), more than a
96 MiB enclave holds. ``avg`` / ``max``: adaptive average or max pooling first, to the spatial size of
the last conv unit's input, so every stage's classifier has exactly the model's FC shapes (no parameters
added)."""


def _has(module: nn.Module, kind: type) -> bool:
    return any(isinstance(m, kind) for m in module.modules())


def conv_units(model: LayerwiseNet) -> int:
    """The number of leading layer units that hold a convolution (PPFL trains those layer-wise)."""
    units = model.layer_units()
    count = 0
    while count < len(units) and _has(units[count], nn.Conv2d):
        count += 1
    if count == 0 or any(_has(u, nn.Conv2d) for u in units[count:]):
        raise ConfigError(
            f"{type(model).__name__} is not a chain of convolutional units followed by FC units: "
            "PPFL's stages need one"
        )
    if count == len(units):
        raise ConfigError(f"{type(model).__name__} has no FC units to build the classifiers from")
    return count


def plan_stages(
    model: LayerwiseNet, block_size: int = 1, *, classifier_stage: bool = True, classifier_pool: str = "none"
) -> list[Stage]:
    """The stages of PPFL on ``model``: its convolutional units in blocks of ``block_size`` (Sec. 6.5),
    then (``classifier_stage``) the model's FC units atop them (module docstring); ``classifier_pool``
    (:data:`CLASSIFIER_POOLS`) for the conv stages' classifiers."""
    if classifier_pool not in CLASSIFIER_POOLS:
        raise ConfigError(f"classifier pool {classifier_pool!r} is not one of {', '.join(CLASSIFIER_POOLS)}")
    if _has(model, nn.modules.batchnorm._BatchNorm):
        raise ConfigError(
            f"{type(model).__name__} has BatchNorm layers; PPFL here trains networks without them (their "
            "running statistics would need their own aggregation): use lenet, alexnet, vgg9 or vgg16"
        )
    count = conv_units(model)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= count:
        raise ConfigError(
            f"block size {block_size!r} must be an integer from 1 to the {count} convolutional layers of "
            f"{type(model).__name__}"
        )
    starts = list(range(0, count, block_size))
    stages = [
        Stage(
            i,
            tuple(range(s, min(s + block_size, count))),
            not classifier_stage and s + block_size >= count,
            pool=classifier_pool,
        )
        for i, s in enumerate(starts)
    ]
    if classifier_stage:
        total = len(model.layer_units())
        stages.append(Stage(len(stages), tuple(range(count, total)), True, classifier=False))
    return stages


def plan(
    model: LayerwiseNet,
    *,
    block_size: int = 1,
    train_last: int | None = None,
    classifier_stage: bool = True,
    classifier_pool: str = "none",
) -> list[Stage]:
    """The stages both sides derive from the settings: layer-wise (:func:`plan_stages`) or, with
    ``train_last``, the one transfer stage (:func:`plan_transfer`)."""
    if train_last is not None:
        return plan_transfer(model, train_last)
    return plan_stages(model, block_size, classifier_stage=classifier_stage, classifier_pool=classifier_pool)


def kept_on_release(stage: Stage, net: StageNet, *, final: bool, keep_in_tee: bool) -> int:
    """How many of ``theta_l``'s last values stay in the enclave when ``stage`` ends: a convolutional
    stage's aid classifier always (it is never released); on the ``final`` stage with ``keep_in_tee``
    (Sec. 4.1's defence of the last layer against membership inference) its classifier or, for a
    classifier-free stage, all of it (the model's FC units); otherwise nothing."""
    if final and keep_in_tee:
        return net.classifier_size if stage.classifier else sum(p.numel() for p in net.parameters())
    return 0 if stage.last else net.classifier_size


def plan_transfer(model: LayerwiseNet, train_last: int) -> list[Stage]:
    """Transfer of public knowledge (PPFL Sec. 4.3, Appendix A.1): one stage in which the clients'
    TEEs train the model's last ``train_last`` layer units (FC and convolutional alike), atop the
    first ones, pre-trained on public data and frozen in every REE."""
    if _has(model, nn.modules.batchnorm._BatchNorm):
        raise ConfigError(
            f"{type(model).__name__} has BatchNorm layers; PPFL here trains networks without them"
        )
    count = len(model.layer_units())
    if isinstance(train_last, bool) or not isinstance(train_last, int) or not 1 <= train_last <= count:
        raise ConfigError(
            f"train_last {train_last!r} must be an integer from 1 to the {count} layer units of "
            f"{type(model).__name__}"
        )
    return [Stage(0, tuple(range(count - train_last, count)), True, classifier=False)]


class StageNet(nn.Module):
    """What a client TEE trains in one stage: the stage's ``layers`` and the ``classifier`` atop them."""

    def __init__(self, layers: Sequence[nn.Module], classifier: nn.Sequential) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self.classifier = classifier

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """``C(layers(T_{l-1}))``: logits."""
        return self.classifier(self.layers(t))

    @property
    def classifier_size(self) -> int:
        """Number of classifier parameters (the tail of ``theta_l``)."""
        return sum(p.numel() for p in self.classifier.parameters())


def _replace_first(module: nn.Module, kind: type, make: Callable[[Any], nn.Module]) -> None:
    """Replace the first submodule of type ``kind`` (in module order) by ``make(old)``."""
    for name, sub in module.named_modules():
        if isinstance(sub, kind):
            parent_name, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, child, make(sub))
            return
    raise ConfigError(f"no {kind.__name__} in {type(module).__name__} to adapt")


def _shape_after(units: Sequence[nn.Module], shape: tuple[int, ...]) -> tuple[int, ...]:
    with torch.no_grad():
        x = torch.zeros(1, *shape)
        for unit in units:
            x = unit.eval()(x)
    return tuple(x.shape[1:])


def stage_input_shape(model: LayerwiseNet, stage: Stage) -> tuple[int, ...]:
    """The shape of ``T_{l-1}``, what the REE hands the TEE for one example."""
    return _shape_after(model.layer_units()[: stage.units[0]], model.input_shape)


def stage_net(model: LayerwiseNet, stage: Stage) -> StageNet:
    """The layers and classifier a TEE trains in ``stage`` (module docstring); fresh copies whose values
    are placeholders: the server's enclave initialises ``theta_l``."""
    units = model.layer_units()
    layers = [copy.deepcopy(units[i]) for i in stage.units]
    if not stage.classifier:
        return StageNet(layers, nn.Sequential())
    count = conv_units(model)
    heads = [copy.deepcopy(u) for u in units[count:]]
    if stage.units[-1] == count - 1:
        return StageNet(layers, nn.Sequential(*heads))
    out_shape = _shape_after(units[: stage.units[-1] + 1], model.input_shape)
    pooling: list[nn.Module] = []
    side = _shape_after(units[: count - 1], model.input_shape)[1:]
    if stage.pool != "none" and out_shape[1:] != side:
        pool = nn.AdaptiveAvgPool2d if stage.pool == "avg" else nn.AdaptiveMaxPool2d
        pooling.append(pool(side))
        out_shape = (out_shape[0], *side)
    conv = copy.deepcopy(units[count - 1])
    _replace_first(
        conv,
        nn.Conv2d,
        lambda c: nn.Conv2d(
            out_shape[0],
            c.out_channels,
            c.kernel_size,
            c.stride,
            c.padding,
            c.dilation,
            c.groups,
            c.bias is not None,
        ),
    )
    features = math.prod(_shape_after([conv], out_shape))
    _replace_first(heads[0], nn.Linear, lambda f: nn.Linear(features, f.out_features, f.bias is not None))
    return StageNet(layers, nn.Sequential(*pooling, conv, *heads))


def param_specs(net: nn.Module, init: str = "torch") -> list[ParamSpec]:
    """The initialisation ``init`` (:data:`fedveil.models.zoo.INITS`) of each parameter of ``net``, for
    the enclave to draw ``theta_l`` from. ``torch``: PyTorch's default, ``U(-1/sqrt(fan_in),
    1/sqrt(fan_in))`` for convolution and linear weights and biases; ``darknet``: Darknet's,
    ``U(-sqrt(2/fan_in), sqrt(2/fan_in))`` weights and zero biases
    (:func:`fedveil.models.zoo.darknet_init_`)."""
    if init not in INITS:
        raise ConfigError(f"unknown initialisation {init!r}; choose one of {', '.join(INITS)}")
    specs = []
    for module in net.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            fan_in = module.weight[0].numel()
            if init == "darknet":
                specs.append(ParamSpec(tuple(module.weight.shape), "uniform", darknet_bound(fan_in)))
                if module.bias is not None:
                    specs.append(ParamSpec(tuple(module.bias.shape), "zeros"))
                continue
            bound = 1.0 / math.sqrt(fan_in)
            for p in module.parameters(recurse=False):
                specs.append(ParamSpec(tuple(p.shape), "uniform", bound))
        elif any(True for _ in module.parameters(recurse=False)):
            raise ConfigError(
                f"PPFL cannot initialise the parameters of {type(module).__name__} in the enclave"
            )
    return specs


# --- TEE memory (Alg. 1's S_l) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TeeMemory:
    """``S_l``: bytes a TEE holds to train one stage at one batch size (float32 throughout).

    ``parameters``: ``theta_l`` (layer + classifier); ``gradients``: twice their size (the per-tensor
    gradients the backward pass produces and the flat vector they are gathered into); ``optimizer``: the
    momentum buffer (SGD with momentum; two moments for Adam) and the step's one temporary (the in-place
    step of :func:`~fedveil.protocols.local.local_train`);
    ``activations``: the batch of ``T_{l-1}`` handed in, every tensor the forward pass saves for the
    backward pass (found with autograd's saved-tensor hooks on one forward pass), and twice the largest
    of them for the backward pass's gradient buffers (the gradients of one activation and of the next).

    Against the measured peak of the same steps (:func:`measure_tee_memory`, batch 16) the model is within
    5% for LeNet and VGG9 stages; for AlexNet, whose stages run two or three full-resolution 128-channel
    convolutions, the measured peak is 0.71 to 1.21 times the model's figure (the first stage's backward
    pass holds three activation gradients at once; the last needs no gradient of its input): the test
    ``tests/test_protocols_ppfl.py`` holds every single-layer stage to measured / predicted in
    [0.7, 1.25], or, for a final stage of a few KiB (AlexNet's one FC layer), to within 64 KiB of fixed
    temporaries. A block of AlexNet's first two layers measures 1.32 times the model's figure (60.7 against
    46.0 MiB at batch 16): for blocks of full-resolution convolutions, give TEEs that margin.
    """

    stage: int
    batch_size: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        """``S_l`` in bytes."""
        return self.parameters + self.gradients + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        """JSON-ready, with the total."""
        return {
            "stage": self.stage,
            "batch_size": self.batch_size,
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
        }


def tee_memory(
    net: StageNet, input_shape: tuple[int, ...], batch_size: int, optimizer: LocalOptimizer, *, stage: int = 0
) -> TeeMemory:
    """The memory model of :class:`TeeMemory` for ``net`` on inputs ``(batch_size, *input_shape)``."""
    p = 4 * sum(q.numel() for q in net.parameters())
    moments = 2 if optimizer.name == "adam" else (1 if optimizer.momentum else 0)
    params = {q.untyped_storage().data_ptr() for q in net.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    t = torch.zeros(batch_size, *input_shape)
    params.add(t.untyped_storage().data_ptr())
    net.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logits = net(t)
    del logits
    activations = t.numel() * 4 + sum(saved.values()) + 2 * max(saved.values(), default=0)
    return TeeMemory(stage, batch_size, p, 2 * p, p * (moments + 1), activations)


def measure_tee_memory(
    net: StageNet, input_shape: tuple[int, ...], batch_size: int, optimizer: LocalOptimizer, *, seed: int = 0
) -> int:
    """Measured peak bytes of two local training steps of ``net`` on random inputs: the flat
    parameters, plus the peak of every tensor storage allocated during the steps while alive (counted
    under a ``TorchDispatchMode``); compare with :func:`tee_memory`."""
    gen = torch.Generator().manual_seed(seed)
    flat = FlatModel(net)
    p = torch.from_numpy(flat.initial())
    batches = [
        (torch.randn(batch_size, *input_shape, generator=gen), torch.zeros(batch_size, dtype=torch.int64))
        for _ in range(2)
    ]
    net.train()
    meter = LiveBytes()
    with meter:
        local_train(
            lambda q, t, y: nn.functional.cross_entropy(flat(q, t), y),
            p,
            batches,
            optimizer,
            0.01,
            inplace=True,
        )
    return 4 * p.numel() + meter.peak


def public_unit_values(model: LayerwiseNet, public: nn.Module) -> list[np.ndarray]:
    """The public model's values, one flat float32 vector per layer unit of ``model``; ``public`` must
    have ``model``'s architecture (the same parameter names and shapes), else a :class:`ConfigError`
    naming the first difference."""
    theirs = {name: p.detach() for name, p in public.named_parameters()}
    ours = dict(model.named_parameters())
    if set(theirs) != set(ours):
        missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        raise ConfigError(
            f"the public model's parameters differ from {type(model).__name__}'s: missing {missing[:4]}, "
            f"unexpected {extra[:4]}"
        )
    for name, p in ours.items():
        if tuple(theirs[name].shape) != tuple(p.shape):
            raise ConfigError(
                f"public parameter {name} has shape {tuple(theirs[name].shape)}; "
                f"{type(model).__name__} needs {tuple(p.shape)}"
            )
    values = []
    for i, unit in enumerate(model.layer_units()):
        names = [f"units.{i}.{n}" for n, _ in unit.named_parameters()]
        parts = [theirs[n].reshape(-1).numpy().astype(np.float32) for n in names]
        values.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32))
    return values


# --- the client TEE and REE -------------------------------------------------------------------------------


class ClientTee:
    """One client's emulated TEE (TrustZone in the paper): it holds its session with the server's
    enclave, and ``theta_l`` and the optimiser state only while it trains (Alg. 2).

    ``device`` (a resolved :class:`torch.device`; ``None``: the CPU) is where the emulation computes:
    ``theta_l`` is opened in host memory and moves there, the REE's batches are expected there, and the
    trained values come back to host memory to be sealed (module docstring, "On an accelerator")."""

    def __init__(
        self, session: EnclaveClientSession, tee_bytes: int, device: torch.device | None = None
    ) -> None:
        self.session = session
        self.tee_bytes = tee_bytes
        self.device = torch.device("cpu") if device is None else device

    def train(
        self,
        rnd: int,
        record: bytes,
        net: StageNet,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        optimizer: LocalOptimizer,
        rates: Sequence[float],
    ) -> bytes:
        """Open ``theta_l``, train it on the REE's ``(T_{l-1}, y)`` batches, seal it and the mean loss."""
        flat = FlatModel(net)
        theta = self.open(rnd, record, flat.num_params)
        net.train()
        p, loss = local_train(
            lambda q, t, y: nn.functional.cross_entropy(flat(q, t), y),
            torch.from_numpy(theta).to(self.device),
            batches,
            optimizer,
            rates,
            inplace=True,
        )
        return self.seal(rnd, p, loss)

    def open(self, rnd: int, record: bytes, size: int) -> np.ndarray:
        """``theta_l`` of round ``rnd`` opened from the server enclave's record; ``size`` values or a
        :class:`ValidationError`."""
        theta = np.array(self.session.open_model(rnd, record), dtype=np.float32)
        if theta.shape != (size,):
            raise ValidationError(f"sealed layer of {theta.size} values, the stage has {size}")
        return theta

    def seal(self, rnd: int, p: torch.Tensor, loss: torch.Tensor) -> bytes:
        """The trained ``theta_l^(j)`` and the mean loss, copied to host memory and sealed to the server's
        enclave."""
        return self.session.seal_update(rnd, np.append(p.detach().cpu().numpy(), np.float32(float(loss))))

    def evaluate(
        self, rnd: int, record: bytes, net: nn.Module, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[int, float]:
        """Open the sealed values into ``net`` and score it on ``(T, y)`` (``net``, ``T`` and ``y`` on
        :attr:`device`): correct count, summed loss."""
        flat = FlatModel(net)
        theta = np.array(self.session.open_model(rnd, record), dtype=np.float32)
        if theta.shape != (flat.num_params,):
            raise ValidationError(f"sealed values of {theta.size}, the evaluated part has {flat.num_params}")
        with torch.no_grad():
            net.eval()
            logits = flat(torch.from_numpy(theta).to(self.device), inputs)
            loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
        return int((logits.argmax(1) == labels).sum()), float(loss)


class PpflClients:
    """The PPFL devices (a ``ClientPool``): each an REE holding its examples and the released layers,
    and a :class:`ClientTee` (Alg. 2).

    ``model`` is the public architecture both sides know; ``block_size``, ``train_last`` and
    ``classifier_stage`` give the stages, as :class:`PpflConfig` does. ``tee_bytes`` gives each client's
    TEE size (default :data:`HIKEY_TEE_BYTES`). ``evaluators`` are devices that hold an evaluation split
    and only evaluate (a held-out device, so that per-round accuracy needs no plaintext at the server).
    ``batched``: train a round's cohort as one vectorised computation (:meth:`_fit_cohort`); ``None``
    (default) where the stage's network is small enough for that to be faster (the FedAvg engine's rule,
    :data:`~fedveil.protocols.fedavg.BATCH_BELOW_PARAMS`).

    ``device`` (:func:`~fedveil.models.device.resolve_device`) is where the simulation computes each
    client, its REE and its emulated TEE alike: the examples and labels move there once, copies of the
    released layers once per release, the activations ``T_{l-1}`` stay there for the TEE, and each TEE
    trains and evaluates its stage there (:class:`ClientTee`), ``theta_l`` opened and sealed in host
    memory. The released layers the REE keeps (:attr:`frozen`, :meth:`trained_model`) and the server's
    enclave stay on the CPU (module docstring, "On an accelerator").
    """

    def __init__(
        self,
        model: LayerwiseNet,
        data: FederatedDataset,
        *,
        optimizer: LocalOptimizer,
        seed: int,
        block_size: int = 1,
        train_last: int | None = None,
        classifier_stage: bool = True,
        classifier_pool: str = "none",
        sessions: Mapping[ClientId, EnclaveClientSession],
        tee_bytes: Mapping[ClientId, int] | None = None,
        evaluators: Sequence[ClientId] = (),
        x_key: str = "x",
        y_key: str = "y",
        batched: bool | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = resolve_device(device)
        self._arrays: dict[tuple[ClientId, str], torch.Tensor] = {}
        self._on_device: dict[ClientId, list[nn.Module]] = {}
        self.model = model
        self.batched = batched
        self.data = data
        self.optimizer = optimizer
        self.stages = plan(
            model,
            block_size=block_size,
            train_last=train_last,
            classifier_stage=classifier_stage,
            classifier_pool=classifier_pool,
        )
        self.evaluators = set(evaluators)
        unknown = self.evaluators - set(data.user_ids)
        if unknown:
            raise ConfigError(f"evaluators {sorted(unknown)} are not users of the data set")
        sizes = dict(tee_bytes or {})
        self.tees = {
            cid: ClientTee(sessions[cid], int(sizes.get(cid, HIKEY_TEE_BYTES)), self.device)
            for cid in data.user_ids
        }
        self.rngs = {cid: client_rng(seed, i) for i, cid in enumerate(data.user_ids)}
        self.x_key, self.y_key = x_key, y_key
        self.frozen: dict[ClientId, list[nn.Module]] = {cid: [] for cid in data.user_ids}
        self.released: dict[ClientId, int] = {cid: -1 for cid in data.user_ids}
        self.heads: dict[ClientId, nn.Module] = {}
        self.withheld: set[ClientId] = set()
        self._nets: dict[int, StageNet] = {}

    def client_ids(self) -> list[ClientId]:
        """Every device, trainers and evaluators."""
        return list(self.data.user_ids)

    def net(self, stage: int) -> StageNet:
        """The stage's layers + classifier (architecture only; one module shared, used functionally), on
        the device where the TEEs train it."""
        if stage not in self._nets:
            self._nets[stage] = stage_net(self.model, self.stages[stage]).to(self.device)
        return self._nets[stage]

    def handle_batch(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Dispatch one phase's messages; an error is the device's reply (a dropout). Training requests
        of a stage whose network has at most ``BATCH_BELOW_PARAMS`` parameters (or any, with
        ``batched=True``) run as one vectorised cohort where their schedules agree (:meth:`_fit_cohort`)."""
        out: dict[ClientId, object] = {}
        fits = {c: m for c, m in msgs.items() if isinstance(m, LayerFitRequest)}
        if len(fits) > 1:
            out.update(self._fit_cohort(fits))
        for cid, m in msgs.items():
            if cid in out:
                continue
            try:
                out[cid] = self._handle(cid, m)
            except FedveilError as exc:
                out[cid] = exc
        return out

    def _batched(self, stage: int) -> bool:
        if self.batched is not None:
            return self.batched
        return FlatModel(self.net(stage)).num_params <= BATCH_BELOW_PARAMS

    def _fit_cohort(self, fits: Mapping[ClientId, LayerFitRequest]) -> dict[ClientId, object]:
        """Alg. 2 for several devices at once: each REE prepares its batches and each TEE opens its own
        ``theta_l``; the training steps of a group of devices with the same stage, data size and
        schedule run as one ``vmap`` over them (:func:`~fedveil.protocols.local.local_train_cohort`,
        equal to one by one: ``tests/test_protocols_ppfl.py``); each TEE seals its own result. In
        simulation, as every emulated TEE, the vectorised step runs in the simulator's process."""
        out: dict[ClientId, object] = {}
        groups: dict[tuple[Any, ...], list[ClientId]] = {}
        prepared: dict[
            ClientId, tuple[int, list[tuple[torch.Tensor, torch.Tensor]], list[float], np.ndarray]
        ] = {}
        for cid, m in fits.items():
            if not (0 <= m.stage < len(self.stages)) or not self._batched(m.stage):
                continue
            try:
                n, batches, rates = self._prepare(cid, m)
                theta = self.tees[cid].open(m.round, m.record, FlatModel(self.net(m.stage)).num_params)
            except FedveilError as exc:
                out[cid] = exc
                continue
            prepared[cid] = (n, batches, rates, theta)
            shape = (m.stage, m.round, tuple(tuple(b[0].shape) for b in batches), tuple(rates))
            groups.setdefault(shape, []).append(cid)
        for (stage, rnd, _, _), group in groups.items():
            net = self.net(stage)
            flat = FlatModel(net)
            net.train()
            first = prepared[group[0]]
            batches = [
                (
                    torch.stack([prepared[c][1][i][0] for c in group]),
                    torch.stack([prepared[c][1][i][1] for c in group]),
                )
                for i in range(len(first[1]))
            ]
            p = torch.from_numpy(np.stack([prepared[c][3] for c in group])).to(self.device)
            p, losses = local_train_cohort(
                lambda q, t, y, f=flat: nn.functional.cross_entropy(f(q, t), y),
                p,
                batches,
                self.optimizer,
                first[2],
            )
            for i, cid in enumerate(group):
                out[cid] = LayerFitReply(
                    rnd, stage, prepared[cid][0], self.tees[cid].seal(rnd, p[i], losses[i])
                )
        return out

    def _handle(self, cid: ClientId, m: object) -> object:
        tee = self.tees[cid]
        if isinstance(m, RegistrationCall):
            if tee.session.used:
                tee.session = tee.session.renewed()
            role = "eval" if cid in self.evaluators else "train"
            attributes = {TEE_ATTRIBUTE: str(tee.tee_bytes), ROLE_ATTRIBUTE: role}
            return Register("ppfl", attributes, tee.session.hello())
        if isinstance(m, SessionOffer):
            tee.session.establish(m.server_hello)
            return SessionReady("ppfl")
        if isinstance(m, LayerRelease):
            return self._freeze(cid, m)
        if isinstance(m, PublicLayers):
            return self._public(cid, m)
        if isinstance(m, LayerFitRequest):
            return self._fit(cid, m)
        if isinstance(m, LayerEvalRequest):
            return self._evaluate(cid, m)
        raise ValidationError(f"a PPFL device cannot handle {type(m).__name__}")

    def _stage(self, stage: int) -> Stage:
        expect(0 <= stage < len(self.stages), f"stage {stage} is not one of the {len(self.stages)} stages")
        return self.stages[stage]

    def _freeze(self, cid: ClientId, m: LayerRelease) -> LayerReleased:
        stage = self._stage(m.stage)
        expect(
            m.stage == self.released[cid] + 1,
            f"release of stage {m.stage}, expected {self.released[cid] + 1}",
        )
        net = self.net(m.stage)
        layers = copy.deepcopy(net.layers).cpu()
        size = sum(p.numel() for p in layers.parameters())
        final = stage.index == len(self.stages) - 1
        withheld = final and not stage.classifier and m.weights.size == 0
        expect(
            m.weights.size in (size, size + net.classifier_size) or withheld,
            f"release of {m.weights.size} values, stage {stage.index}'s layers have {size}",
        )
        expect(
            m.weights.size == size or stage.last,
            f"stage {stage.index}'s classifier is a training aid and is never released",
        )
        self.released[cid] = m.stage
        if withheld:
            self.withheld.add(cid)
            return LayerReleased(m.stage)
        FlatModel(layers).load_into_module(np.asarray(m.weights[:size]))
        self.frozen[cid].extend(layers.eval().requires_grad_(False))
        if m.weights.size > size:
            head = copy.deepcopy(net.classifier).cpu()
            FlatModel(head).load_into_module(np.asarray(m.weights[size:]))
            self.heads[cid] = head.eval().requires_grad_(False)
        return LayerReleased(m.stage)

    def _public(self, cid: ClientId, m: PublicLayers) -> PublicLayersSet:
        """Freeze the public layer units the transfer stage trains atop (PPFL Sec. 4.3)."""
        first = self.stages[0].units[0]
        expect(
            not self.stages[0].classifier and m.units == first,
            f"public layers of {m.units} units; this device's plan trains from unit {first} on "
            f"{'with' if self.stages[0].classifier else 'without'} a classifier",
        )
        expect(self.released[cid] == -1 and not self.frozen[cid], "public layers come before any training")
        layers = nn.Sequential(*(copy.deepcopy(u) for u in self.model.layer_units()[:first]))
        size = sum(p.numel() for p in layers.parameters())
        expect(
            m.weights.size == size,
            f"public layers of {m.weights.size} values, units 0..{first - 1} have {size}",
        )
        FlatModel(layers).load_into_module(np.asarray(m.weights))
        self.frozen[cid] = list(layers.eval().requires_grad_(False))
        return PublicLayersSet(m.units)

    def trained_model(self, cid: ClientId) -> nn.Module:
        """The network as device ``cid``'s REE holds it after training: the released layers and, unless
        the classifier stayed in the TEEs, the released classifier (the target model's FC layers); after
        a transfer stage, the public units and the trained last ones."""
        last = self.stages[-1]
        if not last.classifier and self.released[cid] == last.index and cid not in self.withheld:
            return nn.Sequential(*self.frozen[cid])
        if cid not in self.heads:
            raise ValidationError(
                f"device {cid} holds no released classifier (kept in the TEE, or not trained)"
            )
        return nn.Sequential(*self.frozen[cid], self.heads[cid])

    def _activations(self, cid: ClientId, key: str) -> torch.Tensor:
        """``T_{l-1}`` for all the client's examples: the frozen layers run in the REE, on the device,
        where the result stays for the TEE."""
        x = self._client_tensor(cid, key, torch.float32)
        with torch.no_grad():
            for unit in self._ree_units(cid):
                x = unit(x)
        return x

    def _client_tensor(self, cid: ClientId, key: str, dtype: torch.dtype) -> torch.Tensor:
        """The client's array ``key`` as ``dtype`` on the device, moved there once."""
        if (cid, key) not in self._arrays:
            value = torch.tensor(self.data.array(cid, key), dtype=dtype)
            self._arrays[(cid, key)] = value.to(self.device)
        return self._arrays[(cid, key)]

    def _ree_units(self, cid: ClientId) -> list[nn.Module]:
        """The REE's frozen layers on the device: on the CPU those of :attr:`frozen` themselves, elsewhere
        a copy of each, made once after its release."""
        if self.device.type == "cpu":
            return self.frozen[cid]
        held = self._on_device.setdefault(cid, [])
        held.extend(copy.deepcopy(unit).to(self.device) for unit in self.frozen[cid][len(held) :])
        return held

    def _check_ready(self, cid: ClientId, stage: int) -> None:
        expect(
            self.released[cid] == stage - 1,
            f"stage {stage} needs the layers of stages 0..{stage - 1}; this device froze up to "
            f"{self.released[cid]}",
        )

    def _fit(self, cid: ClientId, m: LayerFitRequest) -> LayerFitReply:
        n, batches, rates = self._prepare(cid, m)
        sealed = self.tees[cid].train(m.round, m.record, self.net(m.stage), batches, self.optimizer, rates)
        return LayerFitReply(m.round, m.stage, n, sealed)

    def _prepare(
        self, cid: ClientId, m: LayerFitRequest
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]], list[float]]:
        """The REE's part of Alg. 2: ``T_{l-1}`` of the device's examples through the frozen layers, in
        shuffled mini-batches per epoch, with each step's rate (decayed per epoch)."""
        self._check_ready(cid, m.stage)
        expect(cid not in self.evaluators, "an evaluation device does not train")
        expect(m.local_epochs >= 1 and m.batch_size >= 1, "local_epochs and batch_size must be >= 1")
        expect(math.isfinite(m.lr) and m.lr > 0, f"lr {m.lr} must be > 0")
        expect(
            math.isfinite(m.epoch_decay) and 0 < m.epoch_decay <= 1,
            f"epoch_decay {m.epoch_decay} not in (0, 1]",
        )
        t = self._activations(cid, self.x_key)
        y = self._client_tensor(cid, self.y_key, torch.int64)
        expect(len(t) == len(y) and len(t) > 0, f"device {cid} has {len(t)} inputs and {len(y)} labels")
        batches, rates = [], []
        for epoch in range(m.local_epochs):
            order = torch.from_numpy(self.rngs[cid].permutation(len(t))).to(self.device)
            for s in range(0, len(t), m.batch_size):
                idx = order[s : s + m.batch_size]
                batches.append((t[idx], y[idx]))
                rates.append(m.lr * m.epoch_decay**epoch)
        return len(t), batches, rates

    def _evaluate(self, cid: ClientId, m: LayerEvalRequest) -> LayerEvalReply:
        net = self.net(m.stage)
        evaluated: nn.Module = net
        if self.released[cid] == m.stage:
            evaluated = net.classifier if self._stage(m.stage).classifier else net.layers
        else:
            self._check_ready(cid, m.stage)
        t = self._activations(cid, self.x_key)
        y = self._client_tensor(cid, self.y_key, torch.int64)
        expect(len(t) == len(y) and len(t) > 0, f"device {cid} has {len(t)} inputs and {len(y)} labels")
        correct, loss_sum = self.tees[cid].evaluate(m.round, m.record, evaluated, t, y)
        return LayerEvalReply(m.round, m.stage, len(t), correct, loss_sum)


# --- the server (Alg. 1) ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PpflConfig:
    """PPFL's knobs (module docstring); defaults are Sec. 6.2's: 10 local epochs, SGD at 0.01 decayed by
    0.99 after each epoch, momentum 0.5, batch 16, all 16 MiB TEEs, and a final stage for the classifier
    (``classifier_stage``). ``block_size``: conv layers per stage (Sec. 6.5); ``train_last``: transfer of
    public knowledge, one stage training the model's last units (Sec. 4.3; the server needs a public
    model); ``keep_classifier_in_tee``: the final stage's values stay in the TEEs (Sec. 4.1);
    ``classifier_pool``: how a conv stage's classifier takes its input (:data:`CLASSIFIER_POOLS`)."""

    rounds_per_stage: int = 10
    clients_per_round: int | None = None
    local_epochs: int = 10
    batch_size: int = 16
    lr: float = 0.01
    epoch_decay: float = 0.99
    momentum: float = 0.5
    block_size: int = 1
    train_last: int | None = None
    classifier_stage: bool = True
    classifier_pool: str = "none"
    keep_classifier_in_tee: bool = False
    target_accuracy: float | None = None
    patience: int | None = None
    eval_every: int = 1
    weighted: bool = False
    min_clients: int = 1
    seed: int = 0
    timeout: float = 600.0

    def __post_init__(self) -> None:
        for name in (
            "rounds_per_stage",
            "local_epochs",
            "batch_size",
            "block_size",
            "eval_every",
            "min_clients",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ppfl.{name} must be an integer >= 1, not {value!r}")
        if self.train_last is not None and (
            isinstance(self.train_last, bool) or not isinstance(self.train_last, int) or self.train_last < 1
        ):
            raise ConfigError(f"ppfl.train_last {self.train_last!r} must be an integer >= 1 (or null)")
        if self.clients_per_round is not None and self.clients_per_round < 1:
            raise ConfigError(
                f"ppfl.clients_per_round {self.clients_per_round!r} must be >= 1 (or null: all)"
            )
        if self.classifier_pool not in CLASSIFIER_POOLS:
            raise ConfigError(
                f"ppfl.classifier_pool {self.classifier_pool!r} is not one of {', '.join(CLASSIFIER_POOLS)}"
            )
        if not 0 < self.epoch_decay <= 1:
            raise ConfigError(f"ppfl.epoch_decay {self.epoch_decay!r} must lie in (0, 1]")
        if self.train_last is not None and self.keep_classifier_in_tee:
            raise ConfigError(
                "ppfl.keep_classifier_in_tee keeps a stage's classifier inside; a transfer stage "
                "(ppfl.train_last) has none: drop one of the two settings"
            )
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ConfigError(f"ppfl.target_accuracy {self.target_accuracy!r} must lie in (0, 1]")
        if self.patience is not None and self.patience < 1:
            raise ConfigError(f"ppfl.patience {self.patience!r} must be >= 1 (or null: never stop early)")
        self.optimizer()

    def optimizer(self) -> LocalOptimizer:
        """The clients' SGD (the per-epoch decay is applied through the step rates)."""
        return LocalOptimizer("sgd", lr=self.lr, momentum=self.momentum)

    def stages(self, model: LayerwiseNet) -> list[Stage]:
        """The stages both sides derive from the settings: layer-wise (:func:`plan_stages`) or, with
        ``train_last``, the one transfer stage (:func:`plan_transfer`)."""
        return plan(
            model,
            block_size=self.block_size,
            train_last=self.train_last,
            classifier_stage=self.classifier_stage,
            classifier_pool=self.classifier_pool,
        )


@dataclass
class StageReport:
    """One stage: its units, ``S_l``, eligible clients, and a line per round."""

    stage: int
    units: tuple[int, ...]
    memory: TeeMemory
    eligible: int
    rounds: list[dict[str, Any]] = field(default_factory=list)
    stopped: str = ""

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (a checkpoint keeps the finished stages' reports)."""
        return {
            "stage": self.stage,
            "units": list(self.units),
            "memory": self.memory.as_dict(),
            "eligible": self.eligible,
            "rounds": self.rounds,
            "stopped": self.stopped,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> StageReport:
        """The report :meth:`to_json` wrote; a :class:`ConfigError` names what is missing."""
        try:
            memory = {k: int(value["memory"][k]) for k in ("stage", "batch_size", "parameters", "gradients")}
            memory.update(
                optimizer=int(value["memory"]["optimizer"]), activations=int(value["memory"]["activations"])
            )
            return cls(
                int(value["stage"]),
                tuple(int(u) for u in value["units"]),
                TeeMemory(**memory),
                int(value["eligible"]),
                list(value["rounds"]),
                str(value["stopped"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"a checkpointed stage report is incomplete: {exc!r}") from exc


@dataclass
class StageProgress:
    """Where a stage in training stood after its round ``round`` (``stage_round`` of the stage): the
    lines of its rounds so far, the best accuracy and evaluations since it for ``patience``, and the
    layer as the enclave ``sealed`` it (:meth:`~fedveil.runtime.enclave_host.EnclaveHost.layer_seal`;
    the host never holds it in the clear), and why the stage ended there when it did (``stopped``:
    ``"target"``, ``"converged"`` or, after its last round, ``"rounds"``; ``None`` while it goes on).
    What a run needs to continue the stage after that round."""

    stage: int
    round: int
    stage_round: int
    rounds: list[dict[str, Any]]
    best: float
    since: int
    sealed: bytes
    stopped: str | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, but for ``sealed`` (a checkpoint stores it as bytes)."""
        return {
            "stage": self.stage,
            "round": self.round,
            "stage_round": self.stage_round,
            "rounds": self.rounds,
            "best": self.best,
            "since": self.since,
            "stopped": self.stopped,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any], sealed: bytes) -> StageProgress:
        """What :meth:`to_json` wrote, with the sealed layer; a :class:`ConfigError` names what is missing."""
        try:
            return cls(
                int(value["stage"]),
                int(value["round"]),
                int(value["stage_round"]),
                list(value["rounds"]),
                float(value["best"]),
                int(value["since"]),
                sealed,
                None if value.get("stopped") is None else str(value["stopped"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"a checkpointed stage in training is incomplete: {exc!r}") from exc


class PpflServer:
    """Alg. 1 over a :class:`Communicator`, with the layer in training held in ``enclave``, which draws
    each stage's initial values as ``init`` says (:func:`param_specs`)."""

    def __init__(
        self,
        model: LayerwiseNet,
        cfg: PpflConfig,
        enclave: LayerwiseEnclave,
        rng: np.random.Generator,
        *,
        public: nn.Module | None = None,
        init: str = "torch",
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.init = init
        self.enclave = enclave
        self.rng = rng
        self.stages = cfg.stages(model)
        self.public: list[np.ndarray] = []
        if cfg.train_last is not None:
            if public is None:
                raise ConfigError(
                    "ppfl.train_last needs a public model to transfer (PPFL Sec. 4.3): train one on public "
                    "data or load pre-trained weights"
                )
            self.public = public_unit_values(model, public)
        self.nets = [stage_net(model, s) for s in self.stages]
        opt = cfg.optimizer()
        self.memory = [
            tee_memory(net, stage_input_shape(model, s), cfg.batch_size, opt, stage=s.index)
            for s, net in zip(self.stages, self.nets, strict=True)
        ]
        self.members: list[ClientId] = []
        self.evaluators: list[ClientId] = []
        self.tee_bytes: dict[ClientId, int] = {}
        self.round = 0
        self.reports: list[StageReport] = []
        self.sealing_secret: bytes | None = None

    async def setup(self, comm: Communicator, *, timeout: float = 60.0) -> None:
        """Registration (with each device's TEE size) and attestation; then check, before any training,
        that every stage has enough eligible devices (Alg. 1's ``S^(n) > S_l``)."""
        _, regs = await register_clients(comm, "ppfl", group_by=ROLE_ATTRIBUTE, timeout=timeout)
        done = await attest_clients(comm, self.enclave.open_session, regs, "ppfl", timeout=timeout)
        for cid in sorted(done):
            attributes = regs[cid].attributes
            try:
                self.tee_bytes[cid] = int(attributes.get(TEE_ATTRIBUTE, ""))
            except ValueError:
                continue
            (self.evaluators if attributes.get(ROLE_ATTRIBUTE) == "eval" else self.members).append(cid)
        need = max(self.cfg.min_clients, self.cfg.clients_per_round or 1)
        largest = max((self.tee_bytes[c] for c in self.members), default=0)
        for memory, stage in zip(self.memory, self.stages, strict=True):
            eligible = len(self.eligible(memory))
            if eligible < need:
                raise ConfigError(
                    f"stage {stage.index} (layer units {list(stage.units)}) needs S_l = {memory.total} bytes "
                    f"({memory.total / 2**20:.1f} MiB) of TEE at batch {self.cfg.batch_size}; {eligible} of "
                    f"{len(self.members)} devices have more (need {need}); the largest TEE is {largest} bytes"
                )

    def eligible(self, memory: TeeMemory) -> list[ClientId]:
        """The members whose TEE holds more than the stage needs (Alg. 1: ``S^(n) > S_l``)."""
        return [c for c in self.members if self.tee_bytes[c] > memory.total]

    async def _evaluate(self, comm: Communicator, stage: int, *, kept: bool = False) -> dict[str, float]:
        if not self.evaluators:
            return {}
        records = self.enclave.layer_broadcast(self.round, stage, self.evaluators, kept=kept)
        rnd = self.round
        replies = await comm.request(
            {c: LayerEvalRequest(rnd, stage, records[c]) for c in self.evaluators},
            phase="evaluate",
            min_replies=len(self.evaluators),
            timeout=self.cfg.timeout,
            expected=LayerEvalReply,
            validate=lambda cid, msg: expect(
                (msg.round, msg.stage) == (rnd, stage), "evaluation of another round"
            ),
        )
        n = sum(r.num_samples for r in replies.values())
        if not n:
            return {}
        return {
            "accuracy": sum(r.correct for r in replies.values()) / n,
            "test_loss": sum(r.loss_sum for r in replies.values()) / n,
        }

    async def train(
        self,
        comm: Communicator,
        progress: Callable[[dict[str, Any]], None] | None = None,
        *,
        resume: Sequence[tuple[StageReport, np.ndarray]] = (),
        on_stage: Callable[[StageReport, np.ndarray], None] | None = None,
        partial: StageProgress | None = None,
        on_round: Callable[[StageProgress], None] | None = None,
        resumed: Callable[[], None] | None = None,
    ) -> list[StageReport]:
        """Alg. 1 over all stages; returns a report per stage (and calls ``progress`` per round,
        ``on_round`` after each round that its stage follows with another and after the final stage's
        last round, with the stage's progress and its layer sealed under :attr:`sealing_secret`, and
        ``on_stage`` with each stage's report and released values when it ends). The final stage's
        sealed layer is what a run needs when the TEEs keep its classifier (``keep_classifier_in_tee``:
        the kept tail cannot be released, so only the enclave's sealed copy outlives it).

        ``resume`` continues an interrupted run: the reports and released values of the stages it had
        finished (in order, not the final one). They are released to every device again (they were
        public: the REE held them in the clear), and training goes on with the next stage, from
        ``partial`` when the run stopped inside it: the enclave unseals its layer and the stage goes on
        after ``partial``'s round (a final stage that had ended there is released and ends the run).
        ``resumed`` is called then, before the next round (to rewind the generators); set :attr:`round`
        to the interrupted run's last round first, so that rounds keep advancing."""
        if len(resume) >= len(self.stages):
            raise ConfigError(f"{len(resume)} finished stages to resume, the plan has {len(self.stages)}")
        if self.public:
            await self._send_public(comm)
        for index, (report, released) in enumerate(resume):
            if report.stage != index:
                raise ConfigError(f"resumed stage reports are out of order: {report.stage} at {index}")
            self.reports.append(report)
            await self._release(comm, index, np.asarray(released, dtype=np.float32))
        if partial is not None and partial.stage != len(resume):
            raise ConfigError(f"the stage in training is {partial.stage}; {len(resume)} stages are finished")
        if resumed is not None:
            resumed()
        if resume and resume[-1][0].stopped == "target":
            return self.reports
        todo = zip(self.stages, self.nets, self.memory, strict=True)
        for stage, net, memory in list(todo)[len(resume) :]:
            report = await self._train_stage(comm, stage, net, memory, progress, partial, on_round)
            partial = None
            keep = kept_on_release(
                stage, net, final=stage is self.stages[-1], keep_in_tee=self.cfg.keep_classifier_in_tee
            )
            released = self.enclave.layer_release(stage.index, keep=keep)
            await self._release(comm, stage.index, released)
            if on_stage is not None:
                on_stage(report, released)
            if report.stopped == "target":
                break
        return self.reports

    async def _train_stage(
        self,
        comm: Communicator,
        stage: Stage,
        net: StageNet,
        memory: TeeMemory,
        progress: Callable[[dict[str, Any]], None] | None,
        partial: StageProgress | None = None,
        on_round: Callable[[StageProgress], None] | None = None,
    ) -> StageReport:
        """One stage of Alg. 1: ``theta_l`` initialised in the enclave (or unsealed there from
        ``partial``: :meth:`train`), then FedAvg rounds through it."""
        cfg = self.cfg
        eligible = self.eligible(memory)
        report = StageReport(stage.index, stage.units, memory, len(eligible))
        self.reports.append(report)
        final = stage is self.stages[-1]
        best, since, first, last = -1.0, 0, 1, cfg.rounds_per_stage
        if partial is not None:
            secret = self._secret()
            self.enclave.layer_unseal(stage.index, partial.round, secret, partial.sealed)
            report.rounds = list(partial.rounds)
            best, since, first = partial.best, partial.since, partial.stage_round + 1
            if partial.stopped is not None:
                last = partial.stage_round
                report.stopped = "" if partial.stopped == "rounds" else partial.stopped
        else:
            initial = np.concatenate([self.public[u] for u in stage.units]) if self.public else None
            self.enclave.layer_begin(stage.index, param_specs(net, self.init), cfg.seed, initial)
        timing: dict[str, float] = {}
        outcome: dict[str, Any] = {}
        size = cfg.clients_per_round or len(eligible)

        def configure(rnd: int, cohort: Sequence[ClientId], _: Any) -> dict[ClientId, object]:
            start = time.perf_counter()
            records = self.enclave.layer_broadcast(rnd, stage.index, cohort)
            timing["broadcast"] = time.perf_counter() - start
            return {
                c: LayerFitRequest(
                    rnd, stage.index, cfg.lr, cfg.epoch_decay, cfg.local_epochs, cfg.batch_size, records[c]
                )
                for c in cohort
            }

        def aggregate(rnd: int, results: Mapping[ClientId, FitResult], _: Any) -> None:
            start = time.perf_counter()
            agg = self.enclave.layer_aggregate(
                rnd,
                stage.index,
                {c: r.record or b"" for c, r in results.items()},
                {c: r.num_samples for c, r in results.items()},
                weighted=cfg.weighted,
            )
            timing["aggregate"] = time.perf_counter() - start
            outcome.update(loss=agg.loss, accepted=len(agg.accepted), rejected=len(agg.rejected))

        def check(cid: ClientId, msg: LayerFitReply) -> None:
            expect(msg.stage == stage.index, f"reply for stage {msg.stage}, expected {stage.index}")

        engine = FedAvgEngine(
            None,
            self.rng,
            select=lambda rnd, r, connected: select_connected(eligible, connected, size, r),
            configure=configure,
            reply_type=LayerFitReply,
            aggregate=aggregate,
            timeout=cfg.timeout,
            check=check,
        )
        for stage_round in range(first, last + 1):
            self.round += 1
            timing.clear()
            outcome.clear()
            start = time.perf_counter()
            rr: RoundReport = await engine.run_round(self.round, comm)
            elapsed = time.perf_counter() - start
            line: dict[str, Any] = {
                "stage": stage.index,
                "round": self.round,
                "stage_round": stage_round,
                "applied": rr.applied and outcome.get("accepted", 0) > 0,
                "clients": rr.gradients,
                "loss": outcome.get("loss"),
                "bytes_up": rr.bytes_up,
                "bytes_down": rr.bytes_down,
                "dropouts": dict(rr.dropouts),
                "seconds_broadcast": timing.get("broadcast", 0.0),
                "seconds_aggregate": timing.get("aggregate", 0.0),
                "seconds_train": elapsed - timing.get("broadcast", 0.0) - timing.get("aggregate", 0.0),
            }
            if stage_round % cfg.eval_every == 0 or stage_round == cfg.rounds_per_stage:
                line.update(await self._evaluate(comm, stage.index))
            report.rounds.append(line)
            if progress is not None:
                progress(line)
            accuracy = line.get("accuracy")
            if accuracy is not None and cfg.target_accuracy is not None and accuracy >= cfg.target_accuracy:
                report.stopped = "target"
            elif accuracy is not None and cfg.patience is not None:
                best, since = (accuracy, 0) if accuracy > best else (best, since + 1)
                if since >= cfg.patience:
                    report.stopped = "converged"
            ended = report.stopped or ("rounds" if stage_round == cfg.rounds_per_stage else None)
            if on_round is not None and (ended is None or final):
                sealed = self.enclave.layer_seal(stage.index, self.round, self._secret())
                on_round(
                    StageProgress(
                        stage.index, self.round, stage_round, list(report.rounds), best, since, sealed, ended
                    )
                )
            if report.stopped:
                break
        return report

    def _secret(self) -> bytes:
        if self.sealing_secret is None:
            raise ConfigError("a sealed layer needs the run's sealing secret: set PpflServer.sealing_secret")
        return self.sealing_secret

    async def _send_public(self, comm: Communicator) -> None:
        """Transfer (PPFL Sec. 4.3, step 1 of Fig. 1): the public model's first units, before the
        transfer stage trains the rest from the public values inside the TEEs."""
        first = self.stages[0].units[0]
        if first == 0:
            return
        message = PublicLayers(first, np.concatenate(self.public[:first]).astype(np.float32))
        await self._to_everyone(
            comm,
            message,
            "public",
            PublicLayersSet,
            lambda cid, msg: expect(msg.units == first, f"froze {msg.units} units, sent {first}"),
        )

    async def _release(self, comm: Communicator, stage: int, weights: np.ndarray) -> None:
        """Broadcast the released layer(s) to every device's REE, which freezes them."""
        await self._to_everyone(
            comm,
            LayerRelease(stage, weights),
            "release",
            LayerReleased,
            lambda cid, msg: expect(msg.stage == stage, f"froze stage {msg.stage}, expected {stage}"),
        )

    async def _to_everyone(
        self,
        comm: Communicator,
        message: object,
        phase: str,
        expected: type,
        validate: Callable[[ClientId, Any], None],
    ) -> None:
        """Send one message in the clear to every device (trainers and evaluators); all must answer."""
        everyone = [*self.members, *self.evaluators]
        await comm.request(
            dict.fromkeys(everyone, message),
            phase=phase,
            min_replies=len(everyone),
            timeout=self.cfg.timeout,
            expected=expected,
            validate=validate,
        )

    async def evaluate_kept(self, comm: Communicator) -> dict[str, float]:
        """After training with ``keep_classifier_in_tee``: the final model's evaluation, its classifier
        sealed from the enclave into the evaluators' TEEs."""
        last = self.reports[-1].stage
        self.round += 1
        return await self._evaluate(comm, last, kept=True)

    def released_layers(self) -> int:
        """How many stages were trained."""
        return len(self.reports)
