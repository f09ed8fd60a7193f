"""The enclave process: ``python -m fedveil.enclave.process``, the program Gramine runs under SGX.

The untrusted host (:mod:`fedveil.runtime.enclave_host`) starts it as a fresh interpreter (spawned,
not forked: it inherits none of the host's memory, and it imports only the enclave package, numpy,
the standard library and ``cryptography``) and talks to it over its standard input and output, which
carry nothing but length-prefixed byte strings::

    u64 little-endian length | request frame        (host -> enclave, on stdin)
    u64 little-endian length | reply frame          (enclave -> host, on stdout)

A length with its top bit set (:data:`SHARED_FLAG`) says the request is not in the pipe but at the
start of the shared memory region whose file descriptor the host passed in ``FEDVEIL_ENCLAVE_SHARED_FD``
(a ``memfd``). That region is untrusted memory, like an SGX enclave's view of the host's: the request is
copied into the process's own memory before anything reads it, so the host cannot change it while it
is parsed. Once it is copied, the enclave writes the length :data:`COPIED` (with no frame) before it
starts on the request, so that the host may write its next request into the region while this one is
computed (the host pipelines a round's gradient batches this way). Each request is handed to
:meth:`fedveil.enclave.service.EnclaveService.handle`. A request longer than the enclave's memory
limit is refused before it is read into memory (its bytes are skipped and an ``EnclaveMemoryError``
reply is sent). ``FEDVEIL_ENCLAVE_CONFIG`` (canonical config JSON), when set, pins the launch
configuration. Anything the process would print goes to standard error, so nothing but replies and
COPIED marks ever reaches the host on stdout. The loop ends on ``shutdown`` or when the host closes
stdin.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from typing import BinaryIO

from fedveil.enclave.channel import pack_frame
from fedveil.enclave.measure import EnclaveConfig
from fedveil.enclave.service import PINNED_CONFIG_ENV, EnclaveService

LENGTH = struct.Struct("<Q")
_SKIP_CHUNK = 2**20
SHARED_ENV = "FEDVEIL_ENCLAVE_SHARED_FD"
"""Environment variable naming the inherited file descriptor of the shared request region."""
SHARED_FLAG = 1 << 63
"""Set in a request's length: the request is in the shared region, not in the pipe."""
COPIED = SHARED_FLAG
"""Written on stdout in place of a reply length, with no frame: the request in the shared region is copied
in, and the region is the host's again (a reply's length never has the top bit set)."""


def _read_exact(reader: BinaryIO, n: int) -> bytearray | None:
    """``n`` bytes from ``reader``, or ``None`` at a clean end of stream before the first byte."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = reader.readinto(view[got:])
        if not k:
            if got == 0:
                return None
            raise EOFError(f"stream ended after {got} of {n} bytes")
        got += k
    return buf


def _skip(reader: BinaryIO, n: int) -> None:
    while n:
        chunk = reader.read(min(n, _SKIP_CHUNK))
        if not chunk:
            raise EOFError(f"stream ended with {n} bytes of an oversized request unread")
        n -= len(chunk)


def _write(writer: BinaryIO, frame: bytes) -> None:
    writer.write(LENGTH.pack(len(frame)))
    writer.write(frame)
    writer.flush()


def _refusal(error: str, message: str) -> bytes:
    return pack_frame({"ok": False, "error": error, "message": message})


def serve(
    reader: BinaryIO,
    writer: BinaryIO,
    *,
    pinned_config: EnclaveConfig | None = None,
    shared: mmap.mmap | None = None,
) -> int:
    """Answer requests from ``reader`` on ``writer`` until ``shutdown`` or end of input; exit status.
    ``shared`` is the shared request region, if the host passed one."""
    service = EnclaveService(pinned_config=pinned_config)
    while not service.closed:
        head = _read_exact(reader, LENGTH.size)
        if head is None:
            return 0
        (n,) = LENGTH.unpack(head)
        in_shared = bool(n & SHARED_FLAG)
        n &= ~SHARED_FLAG
        limit = service.memory_limit_bytes
        if n > limit:
            if not in_shared:
                _skip(reader, n)
            message = f"request of {n} bytes exceeds the enclave memory limit of {limit} bytes"
            _write(writer, _refusal("EnclaveMemoryError", message))
            continue
        if in_shared:
            if shared is None or n > len(shared):
                room = "no shared region" if shared is None else f"a shared region of {len(shared)} bytes"
                _write(writer, _refusal("CodecError", f"a {n}-byte request said to be in {room}"))
                continue
            # copied in (one pass, no zero-fill first): the host cannot change it now
            request: bytes | bytearray = bytes(memoryview(shared)[:n])
            writer.write(LENGTH.pack(COPIED))
            writer.flush()
        else:
            got = _read_exact(reader, n) if n else bytearray()
            if got is None:
                raise EOFError(f"stream ended before a {n}-byte request")
            request = got
        _write(writer, service.handle(request))
    return 0


def main() -> int:
    """Entry point: serve on the process's stdin/stdout, with ``print`` redirected to stderr; the
    config is pinned when ``FEDVEIL_ENCLAVE_CONFIG`` holds one (the Gramine manifest sets it)."""
    reader, writer = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr
    pinned = os.environ.get(PINNED_CONFIG_ENV)
    shared = None
    fd = os.environ.get(SHARED_ENV)
    if fd:
        shared = mmap.mmap(int(fd), 0)
        os.close(int(fd))
    try:
        return serve(
            reader,
            writer,
            pinned_config=EnclaveConfig.from_json(pinned) if pinned else None,
            shared=shared,
        )
    except (EOFError, BrokenPipeError) as exc:
        print(f"fedveil enclave: host connection lost: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
