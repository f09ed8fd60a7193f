"""The untrusted host side of the enclave (FDML's and PPFL's): it starts the enclave and relays opaque
bytes.

FDML Sec. V-A: the cloud controller runs the enclave but "cannot access the participants' embeddings
and local gradients". :class:`EnclaveHost` is what the FDML server calls. It never sees a key or a
plaintext embedding, derivative or gradient: it forwards client hellos and sealed records into the
enclave, returns sealed derivative records and quotes to the clients, and receives in the clear only
what FDML releases to the cloud: the loss, the number of active triplets and the aggregate gradient
for the optimizer step (Fig. 2 step 9).

Two transports carry the same bytes (``boundary=``):

``"process"``
    :class:`ProcessTransport`: the enclave runs in its own interpreter,
    ``python -m fedveil.enclave.process`` (spawned, not forked, and not through
    :mod:`multiprocessing`, whose spawn start method re-imports the parent's ``__main__`` and so
    could pull torch into the enclave), speaking length-prefixed frames over its stdin/stdout pipes.
    This is the command Gramine runs under SGX (``packaging/gramine/enclave.manifest.template``).
    A large request (a round's sealed gradients: about 86 MB for TouchAuth) does not go through the
    pipe: the host writes it into a shared memory region (a ``memfd`` the enclave process inherits) and
    sends only its length, flagged, and the enclave copies it into its own memory before reading it,
    as an SGX enclave copies its inputs in from untrusted memory
    (:data:`fedveil.enclave.process.SHARED_FLAG`). The bytes are the same either way.
``"inprocess"``
    :class:`InProcessTransport`: the same :class:`~fedveil.enclave.service.EnclaveService` called in
    the host's process, byte string in, byte string out; no isolation, for tests and fast simulation.

``tap`` (optional) is called as ``tap(direction, data)`` with ``"to_enclave"`` / ``"from_enclave"`` for
every byte string the host exchanges with the enclave after launch: a relay spy for tests.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fedveil.core.attestation_verify import ServerHello
from fedveil.core.heap import HEAP_RETAINING_ENV
from fedveil.enclave.channel import (
    RECORD_OVERHEAD,
    check_client_id,
    decode_array,
    encode_array,
    frame_parts,
    pack_frame,
    unpack_frame,
)
from fedveil.enclave.layerwise import ParamSpec
from fedveil.enclave.measure import EnclaveConfig
from fedveil.enclave.process import SHARED_ENV, SHARED_FLAG
from fedveil.enclave.service import FRAME_SLACK_BYTES, SESSION_BYTES, EnclaveMemoryError, EnclaveService
from fedveil.errors import CodecError, ConfigError, FedveilError, ValidationError
from fedveil.runtime.quoting import Launch, SimulatedPlatform

BOUNDARIES = ("process", "inprocess")
ENCLAVE_ENV = {
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    **HEAP_RETAINING_ENV,
}
"""The enclave runs its BLAS on one thread, as an SGX enclave with one TCS would (and because spinning
BLAS worker threads beside the host's own slow Alg. 1 down several-fold on a loaded 2-core machine). Its
heap keeps freed memory for the next request (:func:`fedveil.core.heap.retain_freed_memory`), as an SGX
enclave's preallocated heap does."""
ENCLAVE_COMMAND = ("-m", "fedveil.enclave.process")
_LENGTH = struct.Struct("<Q")
SHARED_MIN_BYTES = 256 * 1024
"""Requests at least this long go through the shared region; smaller ones are cheaper in the pipe."""
Tap = Callable[[str, bytes], None]


class EnclaveError(FedveilError):
    """The enclave refused a request; the message carries the enclave's error name and reason."""


class EnclaveProcessError(RuntimeError):
    """The enclave process stopped answering (it exited, or closed its pipes)."""


_ERRORS: dict[str, type[FedveilError]] = {
    "EnclaveMemoryError": EnclaveMemoryError,
    "ValidationError": ValidationError,
    "CodecError": CodecError,
    "ConfigError": ConfigError,
}


Buffer = bytes | bytearray | memoryview


class EnclaveTransport(Protocol):
    """Carries one request frame to the enclave and its reply frame back."""

    def request(self, *parts: Buffer) -> bytes:
        """Send the frame made of ``parts`` (in order, as :func:`~fedveil.enclave.channel.frame_parts`
        lists them); return the enclave's reply."""
        ...

    def close(self) -> None:
        """Stop the enclave (idempotent)."""
        ...


class InProcessTransport:
    """The enclave service in the host's own process: same bytes, no isolation."""

    def __init__(self) -> None:
        self._service = EnclaveService()

    def request(self, *parts: Buffer) -> bytes:
        """Hand the frame to the service and return its reply."""
        return self._service.handle(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        """Nothing to stop."""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):  # unflushed bytes for a dead process
                stream.close()


class ProcessTransport:
    """The enclave in a fresh interpreter (``python -m fedveil.enclave.process``) over stdin/stdout.

    ``command`` replaces that command line, e.g. ``["gramine-sgx", "enclave"]`` to run the same
    program inside SGX (``docs/tee.md``). The child gets its own session (terminal interrupts go to
    the host only) and is killed when the transport is closed or garbage collected.
    """

    def __init__(self, command: Sequence[str] | None = None, *, shared_bytes: int = 0) -> None:
        self.command = list(command) if command is not None else [sys.executable, *ENCLAVE_COMMAND]
        env = {**os.environ, **ENCLAVE_ENV}
        fd = None
        self._shared: mmap.mmap | None = None
        if shared_bytes > 0 and hasattr(os, "memfd_create"):
            fd = os.memfd_create("fedveil-enclave-requests", os.MFD_CLOEXEC)
            os.ftruncate(fd, shared_bytes)
            self._shared = mmap.mmap(fd, shared_bytes)
            env[SHARED_ENV] = str(fd)
        try:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,
                env=env,
                pass_fds=(fd,) if fd is not None else (),
            )
        finally:
            if fd is not None:
                os.close(fd)
        self._finalizer = weakref.finalize(self, _stop, self._proc)

    @property
    def pid(self) -> int:
        """The enclave process's id."""
        return self._proc.pid

    def _lost(self, what: str) -> EnclaveProcessError:
        code = self._proc.poll()
        state = "is still running" if code is None else f"exited with status {code}"
        return EnclaveProcessError(f"enclave process {self._proc.pid} {what}; it {state}")

    def request(self, *parts: Buffer) -> bytes:
        """Write one length-prefixed request (its parts straight into the shared region, or the pipe)
        and read the length-prefixed reply."""
        stdin, stdout = self._proc.stdin, self._proc.stdout
        if stdin is None or stdout is None or stdin.closed:
            raise EnclaveProcessError("the enclave process transport is closed")
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(v.nbytes for v in views)
        try:
            if self._shared is not None and SHARED_MIN_BYTES <= n <= len(self._shared):
                at = 0
                for v in views:
                    self._shared[at : at + v.nbytes] = v
                    at += v.nbytes
                stdin.write(_LENGTH.pack(n | SHARED_FLAG))
            else:
                stdin.write(_LENGTH.pack(n))
                for v in views:
                    stdin.write(v)
            stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._lost(f"stopped reading requests ({exc})") from exc
        head = stdout.read(_LENGTH.size)
        if len(head) != _LENGTH.size:
            raise self._lost("closed its reply stream")
        (n,) = _LENGTH.unpack(head)
        reply = stdout.read(n)
        if len(reply) != n:
            raise self._lost(f"sent {len(reply)} of a {n}-byte reply")
        return reply

    def close(self) -> None:
        """Ask the enclave to shut down, then make sure the process is gone."""
        if self._proc.poll() is None and self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self.request(pack_frame({"op": "shutdown"}))
                self._proc.wait(timeout=5)
            except (EnclaveProcessError, subprocess.TimeoutExpired):
                pass
        self._finalizer()


@dataclass(frozen=True)
class LossResult:
    """Step 5's outcome as the host sees it: each accepted client's sealed ``derivatives`` record
    (to forward to that client), the released ``loss`` (``None`` if no client was accepted) and
    ``num_active`` triplets, the clients ``rejected`` with the reason, and the enclave's
    ``peak_bytes`` for the call."""

    derivatives: dict[str, bytes]
    loss: float | None
    num_active: int
    rejected: dict[str, str]
    peak_bytes: int


@dataclass(frozen=True)
class AggregateResult:
    """Step 9's outcome: the released Eq. 2 ``gradient`` (``None`` if no gradient was accepted), the
    clients ``accepted`` and ``rejected`` (with the reason), the number of requests (``batches``) it
    took and the largest ``peak_bytes`` of any of them."""

    gradient: np.ndarray | None
    accepted: list[str]
    rejected: dict[str, str]
    batches: int
    peak_bytes: int


@dataclass(frozen=True)
class LayerAggregateResult:
    """A PPFL round's averaging as the host sees it: the clients whose updates were ``accepted``, those
    ``rejected`` (with the reason), the clients' mean training ``loss`` (``None`` if none was
    accepted: the layer is then unchanged) and the enclave's ``peak_bytes``."""

    accepted: list[str]
    rejected: dict[str, str]
    loss: float | None
    peak_bytes: int


class EnclaveHost:
    """The FDML server's handle on its enclave (module docstring). Build with :meth:`start`; one
    request at a time (not thread-safe); a context manager that shuts the enclave down."""

    def __init__(
        self,
        transport: EnclaveTransport,
        platform: SimulatedPlatform,
        launch: Launch,
        config: EnclaveConfig,
        *,
        tap: Tap | None = None,
    ) -> None:
        self._transport = transport
        self._platform = platform
        self._launch = launch
        self.config = config
        self._tap = tap
        self._sessions: set[str] = set()

    @classmethod
    def start(
        cls,
        config: EnclaveConfig | None = None,
        *,
        platform: SimulatedPlatform,
        boundary: str = "process",
        tap: Tap | None = None,
    ) -> EnclaveHost:
        """Start an enclave with ``config`` (default :class:`EnclaveConfig`) on ``platform``, across
        ``boundary`` ``"process"`` or ``"inprocess"``; the platform measures and launches it."""
        config = EnclaveConfig() if config is None else config
        if boundary not in BOUNDARIES:
            raise ConfigError(f"boundary {boundary!r} is not one of {', '.join(BOUNDARIES)}")
        transport: EnclaveTransport = (
            ProcessTransport(shared_bytes=config.memory_limit_bytes)
            if boundary == "process"
            else InProcessTransport()
        )
        try:
            launch = platform.launch(transport.request, config)
        except BaseException:
            transport.close()
            raise
        return cls(transport, platform, launch, config, tap=tap)

    @property
    def measurement(self) -> bytes:
        """The measurement the platform took at launch (informational: clients must compare the quote
        with a value they obtained independently, e.g. ``fedveil enclave measure``)."""
        return self._launch.measurement

    def close(self) -> None:
        """Shut the enclave down."""
        self._transport.close()

    def __enter__(self) -> EnclaveHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, header: Mapping[str, Any], blobs: list[bytes]) -> tuple[dict[str, Any], list[memoryview]]:
        parts = frame_parts(header, blobs)
        if self._tap is not None:
            self._tap("to_enclave", b"".join(parts))
        reply = self._transport.request(*parts)
        if self._tap is not None:
            self._tap("from_enclave", reply)
        head, out = unpack_frame(reply)
        if head.get("ok") is not True:
            kind = _ERRORS.get(str(head.get("error")), EnclaveError)
            raise kind(f"enclave refused {header['op']}: {head.get('error')}: {head.get('message')}")
        return head, out

    def open_session(self, client_hello: bytes) -> bytes:
        """Relay a client hello into the enclave, get its REPORT quoted by the platform, and return
        the server hello (enclave session key + quote) for the client to verify."""
        head, out = self._call({"op": "open_session"}, [client_hello])
        if len(out) != 2:
            raise EnclaveError(f"enclave answered open_session with {len(out)} blobs, expected 2")
        self._sessions.add(head["client"])
        quote = self._platform.quote(self._launch.launch_id, bytes(out[1]))
        return ServerHello(bytes(out[0]), quote).encode()

    def loss_and_derivatives(self, rnd: int, sealed: Mapping[str, bytes], *, attempt: int = 0) -> LossResult:
        """FDML step 5 (Alg. 1) inside the enclave over each client's sealed embeddings record."""
        clients = [check_client_id(c) for c in sealed]
        head, out = self._call(
            {"op": "loss", "round": rnd, "attempt": attempt, "clients": clients}, [sealed[c] for c in clients]
        )
        accepted = head["clients"]
        return LossResult(
            derivatives={c: bytes(b) for c, b in zip(accepted, out, strict=True)},
            loss=head["loss"],
            num_active=head["num_active"],
            rejected=dict(head["rejected"]),
            peak_bytes=head["peak_bytes"],
        )

    def _batches(self, sealed: Mapping[str, bytes]) -> Iterator[list[str]]:
        """Split clients into requests the enclave can hold: request and plaintexts (about twice the
        sealed bytes), Eq. 2's float64 work and the running aggregate, and the sessions, within the
        memory limit (the enclave's own check has the last word)."""
        largest = max(len(b) for b in sealed.values())
        resident = 2 * largest + SESSION_BYTES * len(self._sessions)
        room = self.config.memory_limit_bytes - 8 * largest - resident - 4 * FRAME_SLACK_BYTES
        batch: list[str] = []
        used = 0
        for cid, record in sealed.items():
            cost = 2 * (len(record) + RECORD_OVERHEAD)
            if batch and used + cost > room:
                yield batch
                batch, used = [], 0
            batch.append(cid)
            used += cost
        yield batch

    def aggregate(
        self,
        rnd: int,
        sealed: Mapping[str, bytes],
        num_samples: Mapping[str, int],
        *,
        attempt: int = 0,
    ) -> AggregateResult:
        """FDML step 9 (Eq. 2) inside the enclave over each client's sealed gradient record, weighted
        by ``num_samples`` (|d_i|); the aggregate is released for the host's optimizer step. Clients
        are sent in as many requests as the enclave's memory limit needs."""
        if not sealed:
            raise ValidationError(f"round {rnd}: aggregate needs at least one sealed gradient")
        if set(sealed) != set(num_samples):
            raise ValidationError("aggregate: sealed gradients and num_samples name different clients")
        batches = list(self._batches(sealed))
        rejected: dict[str, str] = {}
        accepted: list[str] = []
        peak = 0
        gradient: np.ndarray | None = None
        for i, batch in enumerate(batches):
            final = i == len(batches) - 1
            head, out = self._call(
                {
                    "op": "aggregate",
                    "round": rnd,
                    "attempt": attempt,
                    "clients": batch,
                    "num_samples": [int(num_samples[c]) for c in batch],
                    "final": final,
                },
                [sealed[c] for c in batch],
            )
            rejected.update(head["rejected"])
            accepted.extend(head["clients"])
            peak = max(peak, head["peak_bytes"])
            if final and out:
                gradient = np.array(decode_array(out[0], dtype=head["dtype"], ndim=1))
        return AggregateResult(gradient, accepted, rejected, len(batches), peak)

    # --- PPFL (Alg. 1; fedveil.enclave.layerwise) ------------------------------------------------------

    def layer_begin(
        self, stage: int, specs: Sequence[ParamSpec], seed: int, initial: np.ndarray | None = None
    ) -> int:
        """Initialise layer stage ``stage`` inside the enclave from its parameter ``specs`` (the host
        never sees the values), or from ``initial``, public values the host hands in (a model pre-trained
        on public data, PPFL Sec. 4.3); returns its number of values."""
        blobs = [] if initial is None else [encode_array(np.asarray(initial, dtype=np.float32))]
        head, _ = self._call(
            {"op": "layer_begin", "stage": stage, "seed": seed, "specs": [s.to_json() for s in specs]}, blobs
        )
        return int(head["size"])

    def layer_broadcast(
        self, rnd: int, stage: int, clients: Sequence[str], *, kept: bool = False
    ) -> dict[str, bytes]:
        """The layer in training (or, with ``kept``, the tail kept inside after it) sealed to each of
        ``clients`` for round ``rnd``: one opaque ``model`` record per client."""
        names = [check_client_id(c) for c in clients]
        head, out = self._call(
            {"op": "layer_broadcast", "round": rnd, "stage": stage, "clients": names, "kept": kept}, []
        )
        return {c: bytes(b) for c, b in zip(head["clients"], out, strict=True)}

    def layer_aggregate(
        self,
        rnd: int,
        stage: int,
        sealed: Mapping[str, bytes],
        num_samples: Mapping[str, int],
        *,
        weighted: bool = False,
    ) -> LayerAggregateResult:
        """Open the clients' sealed updates and average them inside (Alg. 1), in as many requests as the
        enclave's memory limit needs; only the mean training loss comes out."""
        if set(sealed) != set(num_samples):
            raise ValidationError("layer_aggregate: sealed updates and num_samples name different clients")
        accepted: list[str] = []
        rejected: dict[str, str] = {}
        batches = list(self._batches(sealed)) if sealed else [[]]
        peak, loss = 0, None
        for i, batch in enumerate(batches):
            head, _ = self._call(
                {
                    "op": "layer_aggregate",
                    "round": rnd,
                    "stage": stage,
                    "clients": batch,
                    "num_samples": [int(num_samples[c]) for c in batch],
                    "weighted": weighted,
                    "final": i == len(batches) - 1,
                },
                [sealed[c] for c in batch],
            )
            accepted.extend(head["clients"])
            rejected.update(head["rejected"])
            peak, loss = max(peak, head["peak_bytes"]), head["loss"]
        return LayerAggregateResult(accepted, rejected, loss, peak)

    def layer_release(self, stage: int, *, keep: int = 0) -> np.ndarray:
        """End ``stage``: the trained layer released to the REE, but for its last ``keep`` values."""
        _, out = self._call({"op": "layer_release", "stage": stage, "keep": keep}, [])
        return np.array(decode_array(out[0], dtype="<f4", ndim=1))
