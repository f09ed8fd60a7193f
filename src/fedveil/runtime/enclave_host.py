"""The untrusted host side of the enclave (FDML's and PPFL's): it starts the enclave and relays opaque
bytes.

FDML Sec. V-A: the cloud controller runs the enclave but "cannot access the participants' embeddings
and local gradients". :class:`EnclaveHost` is what the FDML server calls. It never sees a key or a
plaintext embedding, derivative or gradient: it forwards client hellos and sealed records into the
enclave, returns sealed derivative records and quotes to the clients, and receives in the clear only
what FDML releases to the cloud: the loss, the number of active triplets (with the active fraction
and the loss over all valid triplets, for watching training) and the aggregate gradient for the
optimizer step (Fig. 2 step 9).

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
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fedveil.core.attestation_verify import ServerHello
from fedveil.core.heap import HEAP_RETAINING_ENV
from fedveil.enclave.aggregate import DEFAULT_MAX_UPLOAD_NORM, check_max_upload_norm
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
from fedveil.enclave.process import COPIED, SHARED_ENV, SHARED_FLAG
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
STEP9_REQUEST_BYTES = 8 * 2**20
"""Sealed gradient bytes per step-9 request (at least one record each). The enclave's Eq. 2 gives the same
bits however the records are cut into requests (:class:`fedveil.enclave.aggregate.GradientSum`), so the
cut is a matter of speed: a streamed round leaves only its last request to compute after the last upload,
and each request costs one trip across the boundary."""
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
    """Carries request frames to the enclave and their reply frames back, in order."""

    def submit(self, *parts: Buffer) -> None:
        """Send the frame made of ``parts`` (in order, as :func:`~fedveil.enclave.channel.frame_parts`
        lists them) without waiting for its reply: the enclave may compute it while the host goes on.
        The parts may be reused once this returns."""
        ...

    def collect(self) -> bytes:
        """The reply to the oldest submitted request not yet collected."""
        ...

    def request(self, *parts: Buffer) -> bytes:
        """``submit(*parts)`` then ``collect()``, with no other request outstanding."""
        ...

    def close(self) -> None:
        """Stop the enclave (idempotent)."""
        ...


class InProcessTransport:
    """The enclave service in the host's own process: same bytes, no isolation (a submitted request is
    answered at once, its reply kept for :meth:`collect`)."""

    def __init__(self) -> None:
        self._service = EnclaveService()
        self._replies: deque[bytes] = deque()

    def submit(self, *parts: Buffer) -> None:
        """Hand the frame to the service; keep its reply."""
        self._replies.append(self._service.handle(parts[0] if len(parts) == 1 else b"".join(parts)))

    def collect(self) -> bytes:
        """The oldest reply not yet collected."""
        if not self._replies:
            raise EnclaveProcessError("collect() with no request outstanding")
        return self._replies.popleft()

    def request(self, *parts: Buffer) -> bytes:
        """Hand the frame to the service and return its reply."""
        self.submit(*parts)
        return self.collect()

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
        self._expected: deque[str] = deque()  # what the enclave still owes on stdout, oldest first
        self._replies: deque[bytes] = deque()

    @property
    def pid(self) -> int:
        """The enclave process's id."""
        return self._proc.pid

    def _lost(self, what: str) -> EnclaveProcessError:
        code = self._proc.poll()
        state = "is still running" if code is None else f"exited with status {code}"
        return EnclaveProcessError(f"enclave process {self._proc.pid} {what}; it {state}")

    def submit(self, *parts: Buffer) -> None:
        """Write one length-prefixed request, its parts straight into the shared region (once the
        enclave has copied the previous request out of it) or into the pipe (once every earlier reply
        is read, so that neither side can block on a full pipe)."""
        stdin = self._proc.stdin
        if stdin is None or stdin.closed:
            raise EnclaveProcessError("the enclave process transport is closed")
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(v.nbytes for v in views)
        region = self._shared
        if region is None or not SHARED_MIN_BYTES <= n <= len(region):
            region = None
        # the region is free once its last request's COPIED mark is read; the pipe once all replies are
        while self._expected and (region is None or "copied" in self._expected):
            self._read_next()
        try:
            if region is not None:
                at = 0
                for v in views:
                    region[at : at + v.nbytes] = v
                    at += v.nbytes
                stdin.write(_LENGTH.pack(n | SHARED_FLAG))
                self._expected.append("copied")
            else:
                stdin.write(_LENGTH.pack(n))
                for v in views:
                    stdin.write(v)
            self._expected.append("reply")
            stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._lost(f"stopped reading requests ({exc})") from exc

    def collect(self) -> bytes:
        """Read up to the reply of the oldest outstanding request and return it."""
        while not self._replies:
            if not self._expected:
                raise EnclaveProcessError("collect() with no request outstanding")
            self._read_next()
        return self._replies.popleft()

    def request(self, *parts: Buffer) -> bytes:
        """Write one request and read its reply."""
        if self._expected or self._replies:
            raise EnclaveProcessError("request() while submitted requests are outstanding: collect them")
        self.submit(*parts)
        return self.collect()

    def _read_next(self) -> None:
        """Read the next thing the enclave owes: a request's COPIED mark, or a reply (kept)."""
        stdout = self._proc.stdout
        if stdout is None:
            raise EnclaveProcessError("the enclave process transport is closed")
        head = stdout.read(_LENGTH.size)
        if len(head) != _LENGTH.size:
            raise self._lost("closed its reply stream")
        (n,) = _LENGTH.unpack(head)
        want = self._expected.popleft()
        if (n == COPIED) != (want == "copied"):
            raise self._lost(f"sent {'a COPIED mark' if n == COPIED else 'a reply'} where a {want} was due")
        if n == COPIED:
            return
        reply = stdout.read(n)
        if len(reply) != n:
            raise self._lost(f"sent {len(reply)} of a {n}-byte reply")
        self._replies.append(reply)

    def close(self) -> None:
        """Ask the enclave to shut down, then make sure the process is gone."""
        if self._proc.poll() is None and self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                while self._expected:  # replies nobody collected (a caller's error cut it short)
                    self._read_next()
                self._replies.clear()
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
    ``peak_bytes`` for the call; the ``active_fraction`` of valid triplets and the ``valid_loss`` over
    all valid triplets (``None`` if no client was accepted; see :mod:`fedveil.enclave.service` for what
    they reveal)."""

    derivatives: dict[str, bytes]
    loss: float | None
    num_active: int
    rejected: dict[str, str]
    peak_bytes: int
    active_fraction: float = 0.0
    valid_loss: float | None = None


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


class _BatchPlan:
    """Where a stream of sealed records is cut into requests: at most ``request_bytes`` of records each,
    and no more than the enclave can hold: request and plaintexts (about twice the sealed bytes), Eq. 2's
    float64 work and the running sum, and the sessions, within the memory limit, for records of at most
    ``largest`` bytes (the enclave's own check has the last word). Greedy: a record starts a new request
    when it would not fit the current one; every request holds at least one."""

    def __init__(self, host: EnclaveHost, largest: int, request_bytes: int) -> None:
        resident = 2 * largest + SESSION_BYTES * len(host._sessions)
        room = host.config.memory_limit_bytes - 8 * largest - resident - 4 * FRAME_SLACK_BYTES
        self.room = min(room, 2 * request_bytes)
        self.used = 0

    def starts_new_batch(self, record_bytes: int) -> bool:
        """Count a record of ``record_bytes`` in; whether it opens a new request."""
        cost = 2 * (record_bytes + RECORD_OVERHEAD)
        new = self.used > 0 and self.used + cost > self.room
        self.used = cost if new else self.used + cost
        return new


class AggregateStream:
    """FDML step 9 fed one gradient record at a time (:meth:`EnclaveHost.aggregate_stream`).

    Records are cut into requests of at most ``request_bytes`` (:data:`STEP9_REQUEST_BYTES`) that the
    enclave can hold; the result does not depend on the cut. Every request states the gradients' ``size``
    (the network's parameter count) and ``max_norm`` (the bound on one upload's L2 norm): the enclave
    rejects a client whose gradient breaks either. A full request is submitted at once and not
    waited for: the enclave opens and sums it while the host receives the next devices' replies (the
    shared region is written again as soon as the enclave has copied the previous request in).
    :meth:`finish` sends the last request as the final one and gathers every reply; :meth:`abort`
    gathers them and releases nothing (the enclave drops the partial sum when the next aggregation
    starts). ``clients`` lists the records added, in order.
    """

    def __init__(
        self,
        host: EnclaveHost,
        rnd: int,
        attempt: int,
        largest: int,
        request_bytes: int = STEP9_REQUEST_BYTES,
        *,
        size: int,
        max_norm: float = DEFAULT_MAX_UPLOAD_NORM,
    ) -> None:
        if request_bytes < 1:
            raise ConfigError(f"step-9 request_bytes {request_bytes} must be >= 1")
        self.host, self.rnd, self.attempt, self.largest = host, rnd, attempt, largest
        self.size, self.max_norm = size, check_max_upload_norm(max_norm)
        self._plan = _BatchPlan(host, largest, request_bytes)
        self.clients: list[str] = []
        self._batch: list[tuple[str, Buffer, int]] = []
        self._submitted = 0
        self._done = False

    def add(self, cid: str, record: Buffer, num_samples: int) -> None:
        """Take ``cid``'s sealed gradient record (at most ``largest`` bytes) weighted by ``num_samples``."""
        if self._done:
            raise ValidationError("this step-9 stream is finished; start another")
        size = memoryview(record).nbytes
        if size > self.largest:
            raise ValidationError(f"gradient record of {size} bytes exceeds the stream's {self.largest}")
        if self._plan.starts_new_batch(size) and self._batch:
            self._send(final=False)
        self._batch.append((cid, record, int(num_samples)))
        self.clients.append(cid)

    def _send(self, *, final: bool) -> None:
        batch, self._batch = self._batch, []
        self.host._submit(
            {
                "op": "aggregate",
                "round": self.rnd,
                "attempt": self.attempt,
                "clients": [c for c, _, _ in batch],
                "num_samples": [n for _, _, n in batch],
                "size": self.size,
                "max_norm": self.max_norm,
                "final": final,
            },
            [r for _, r, _ in batch],
        )
        self._submitted += 1

    def _gather(self) -> list[tuple[dict[str, Any], list[memoryview]]]:
        replies, error = [], None
        while self._submitted:
            self._submitted -= 1
            try:
                replies.append(self.host._collect("aggregate"))
            except FedveilError as exc:  # keep reading: every submitted request's reply is owed
                error = error or exc
        if error is not None:
            raise error
        return replies

    def finish(self) -> AggregateResult:
        """Send the last request as the final one; the released aggregate and what each request said."""
        if self._done:
            raise ValidationError("this step-9 stream is finished already")
        if not self._batch:
            raise ValidationError(f"round {self.rnd}: aggregate needs at least one sealed gradient")
        self._done = True
        self._send(final=True)
        replies = self._gather()
        rejected: dict[str, str] = {}
        accepted: list[str] = []
        for head, _ in replies:
            rejected.update(head["rejected"])
            accepted.extend(head["clients"])
        head, out = replies[-1]
        gradient = np.array(decode_array(out[0], dtype=head["dtype"], ndim=1)) if out else None
        peak = max(h["peak_bytes"] for h, _ in replies)
        return AggregateResult(gradient, accepted, rejected, len(replies), peak)

    def abort(self) -> None:
        """Release nothing: read the replies of what was submitted and drop the rest."""
        self._done = True
        self._batch = []
        self._gather()


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
        self._broadcast_sizes: dict[tuple[int, bool], int] = {}  # clients per layer_broadcast that fit
        self._outstanding = 0  # requests submitted whose replies are not collected yet

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
        if self._outstanding:
            raise EnclaveProcessError(
                f"{header['op']}: {self._outstanding} submitted request(s) still owe a reply (a step-9 "
                "stream left open): finish or abort it first"
            )
        self._submit(header, blobs)
        return self._collect(str(header["op"]))

    def _submit(self, header: Mapping[str, Any], blobs: Sequence[Buffer]) -> None:
        parts = frame_parts(header, list(blobs))
        if self._tap is not None:
            self._tap("to_enclave", b"".join(parts))
        self._transport.submit(*parts)
        self._outstanding += 1

    def _collect(self, op: str) -> tuple[dict[str, Any], list[memoryview]]:
        self._outstanding -= 1
        reply = self._transport.collect()
        if self._tap is not None:
            self._tap("from_enclave", reply)
        head, out = unpack_frame(reply)
        if head.get("ok") is not True:
            kind = _ERRORS.get(str(head.get("error")), EnclaveError)
            raise kind(f"enclave refused {op}: {head.get('error')}: {head.get('message')}")
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

    def loss_and_derivatives(
        self, rnd: int, sealed: Mapping[str, bytes], *, shape: tuple[int, int], attempt: int = 0
    ) -> LossResult:
        """FDML step 5 (Alg. 1) inside the enclave over each client's sealed embeddings record, each of
        which must hold ``shape`` ``(n, d)`` float32 embeddings (the round's samples per client, the
        network's embedding width): a client whose record holds another shape is rejected."""
        clients = [check_client_id(c) for c in sealed]
        header = {"op": "loss", "round": rnd, "attempt": attempt, "clients": clients, "shape": list(shape)}
        head, out = self._call(header, [sealed[c] for c in clients])
        accepted = head["clients"]
        return LossResult(
            derivatives={c: bytes(b) for c, b in zip(accepted, out, strict=True)},
            loss=head["loss"],
            num_active=head["num_active"],
            rejected=dict(head["rejected"]),
            peak_bytes=head["peak_bytes"],
            active_fraction=head["active_fraction"],
            valid_loss=head["valid_loss"],
        )

    def _batches(self, sealed: Mapping[str, Buffer]) -> Iterator[list[str]]:
        """Split clients into requests the enclave can hold (:class:`_BatchPlan`, without a size cap)."""
        plan = _BatchPlan(self, max(len(b) for b in sealed.values()), self.config.memory_limit_bytes)
        batch: list[str] = []
        for cid, record in sealed.items():
            if plan.starts_new_batch(len(record)) and batch:
                yield batch
                batch = []
            batch.append(cid)
        yield batch

    def aggregate(
        self,
        rnd: int,
        sealed: Mapping[str, bytes],
        num_samples: Mapping[str, int],
        *,
        size: int,
        max_norm: float = DEFAULT_MAX_UPLOAD_NORM,
        attempt: int = 0,
        request_bytes: int = STEP9_REQUEST_BYTES,
    ) -> AggregateResult:
        """FDML step 9 (Eq. 2) inside the enclave over each client's sealed gradient record, weighted
        by ``num_samples`` (|d_i|); the aggregate is released for the host's optimizer step. A gradient
        that is not ``size`` values, not finite, or of L2 norm above ``max_norm`` rejects its client.
        Clients are sent in requests of at most ``request_bytes`` that the enclave's memory limit allows
        (the result is the same for any cut)."""
        if not sealed:
            raise ValidationError(f"round {rnd}: aggregate needs at least one sealed gradient")
        if set(sealed) != set(num_samples):
            raise ValidationError("aggregate: sealed gradients and num_samples name different clients")
        largest = max(len(b) for b in sealed.values())
        stream = self.aggregate_stream(
            rnd, largest, size=size, max_norm=max_norm, attempt=attempt, request_bytes=request_bytes
        )
        for cid, record in sealed.items():
            stream.add(cid, record, num_samples[cid])
        return stream.finish()

    def aggregate_stream(
        self,
        rnd: int,
        largest: int,
        *,
        size: int,
        max_norm: float = DEFAULT_MAX_UPLOAD_NORM,
        attempt: int = 0,
        request_bytes: int = STEP9_REQUEST_BYTES,
    ) -> AggregateStream:
        """Step 9 fed client by client as the gradients arrive (:class:`AggregateStream`); ``largest``
        bounds the records' length, ``size`` and ``max_norm`` the gradients as in :meth:`aggregate`. Fed
        the same records in the same order, it releases what :meth:`aggregate` releases, bit for bit,
        whatever either's ``request_bytes``."""
        return AggregateStream(self, rnd, attempt, largest, request_bytes, size=size, max_norm=max_norm)

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
        ``clients`` for round ``rnd``: one opaque ``model`` record per client.

        The enclave holds every record of a request at once, so a large layer goes to many clients in
        several requests: when the enclave refuses a request for memory (before it seals anything),
        the request is halved, and later broadcasts of the same layer start from the size that fit.
        Each client's record is the same either way (sealed under its own session)."""
        names = [check_client_id(c) for c in clients]

        def call(batch: list[str]) -> tuple[dict[str, Any], list[memoryview]]:
            header = {"op": "layer_broadcast", "round": rnd, "stage": stage, "clients": batch, "kept": kept}
            return self._call(header, [])

        if not names:
            call([])  # the enclave still checks the stage
            return {}
        key = (stage, kept)
        size = min(self._broadcast_sizes.get(key, len(names)), len(names))
        records: dict[str, bytes] = {}
        at = 0
        while at < len(names):
            try:
                head, out = call(names[at : at + size])
            except EnclaveMemoryError:
                if size == 1:
                    raise
                size = self._broadcast_sizes[key] = size // 2
                continue
            records.update((c, bytes(b)) for c, b in zip(head["clients"], out, strict=True))
            at += size
        return records

    def layer_aggregate(
        self,
        rnd: int,
        stage: int,
        sealed: Mapping[str, bytes],
        num_samples: Mapping[str, int],
        *,
        weighted: bool = False,
        max_norm: float = DEFAULT_MAX_UPLOAD_NORM,
    ) -> LayerAggregateResult:
        """Open the clients' sealed updates and average them inside (Alg. 1), in as many requests as the
        enclave's memory limit needs; only the mean training loss comes out. An update whose change to
        the layer has an L2 norm above ``max_norm`` rejects its client, as in the FedAvg engine."""
        max_norm = check_max_upload_norm(max_norm)
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
                    "max_norm": max_norm,
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

    def layer_seal(self, stage: int, rnd: int, secret: bytes) -> bytes:
        """The state of layer stage ``stage`` after round ``rnd`` sealed by the enclave to its own
        measurement (:meth:`fedveil.enclave.layerwise.LayerwiseState.seal`), under the host's sealing
        ``secret``: opaque bytes the host may store."""
        _, out = self._call({"op": "layer_seal", "stage": stage, "round": rnd}, [secret])
        return bytes(out[0])

    def layer_unseal(self, stage: int, rnd: int, secret: bytes, sealed: bytes) -> int:
        """Continue layer stage ``stage`` in this enclave from what :meth:`layer_seal` returned after round
        ``rnd``; returns its number of values."""
        head, _ = self._call({"op": "layer_unseal", "stage": stage, "round": rnd}, [secret, sealed])
        return int(head["size"])
