"""Sandboxed third-party programs (PoliFL Sec. 4: Policile runs a job's global and local programs).

A program is Python source compiled with RestrictedPython (:func:`compile_program`) and run
(:func:`run_program`) with nothing in scope but the trusted library functions it is given, the pairs it
is handed (:class:`~fedveil.privacy.pairs.DataPolicyPair`) and a small builtin set (:data:`BUILTINS`:
numbers, strings, containers, ``range``, ``len``, ``min``, ``max``, ``sum``, ``sorted``, ``enumerate``,
``zip``, ``abs``, ``round``, ``isinstance`` and the common exceptions).

**What the sandbox stops.** At compile time RestrictedPython refuses ``import``, any name or attribute
that starts with ``_`` (``__class__``, ``__subclasses__``, ``__globals__``, ``__builtins__``,
``__traceback__``, a pair's private slot), ``exec`` / ``eval`` statements and names it reserves. At run
time every attribute read goes through :func:`_guarded_getattr`, which also refuses the introspection
attributes that do not start with ``_`` (a generator's ``gi_frame``, a frame's ``f_globals`` /
``f_back``, a traceback's ``tb_frame``, a function's ``func_globals``, code objects' ``co_*``) and
``str.format`` / ``format_map`` (whose ``{0.__class__}`` fields walk attributes unguarded; RestrictedPython
already refuses most of these names at compile time, the guard is the second line), and every
write goes through RestrictedPython's write guard (no attribute writes on objects the program did not
create). ``getattr``, ``setattr``, ``exec``, ``eval``, ``compile``, ``open``, ``__import__``, ``type``,
``vars``, ``dir`` and ``globals`` are simply not there. A pair's value has no public attribute. The
program runs in a **child process** under ``RLIMIT_AS`` (memory) and ``RLIMIT_CPU`` plus a wall-clock
limit, so a huge allocation or an endless loop ends that child, not the service; its result comes back
as tagged JSON (numbers, strings, lists, dicts, numeric arrays as base64 bytes, and pairs as their policy
text and value; a value a program builds can never be read back as a pair), never pickle. The child is
forked from multiprocessing's fork server, a clean process started once, never from the caller: a caller
that runs gRPC's threads (the service, a device agent) cannot be forked safely. What goes *to* the child
(the program's source, its arguments, the library functions by name) is pickled by our own process for
our own child; nothing the program produces is unpickled. :func:`preload` names library modules the fork
server imports once.

**Limits, each a :class:`SandboxError` naming it.** A source over :data:`MAX_SOURCE_CHARS` characters or
with a syntax tree deeper than :data:`MAX_AST_DEPTH` levels is refused before RestrictedPython walks it
(its checks recurse on the tree). A result or host call over :data:`MAX_MESSAGE_BYTES` bytes (JSON) is
refused by the child before it is sent, and the caller never reads more; lists and dicts nested deeper
than :data:`MAX_VALUE_DEPTH` do not travel either way. The attributes of :data:`DENIED_ATTRIBUTES`
(an array's ``ctypes``, ``data``, ``base``, ``tofile``, ``dump``, ...) are refused on every object by
the attribute guard: they expose process memory or write files.

**Host functions.** A job's global program runs on the server but must not hold the server's pairs:
with ``host=`` the named functions run in the caller's process, the program calls them through the pipe,
and every pair stays with the caller; the program holds a :class:`Handle` (an opaque reference and the
policy) and passes it back. A handle the program was never given is refused.

**What it cannot stop.** Timing and resource side channels (how long a trusted call takes, how much
memory it uses), covert channels through the result's shape or through which commands it calls, and
bugs in the trusted library or in RestrictedPython itself: the library functions are the trusted base.
"""

from __future__ import annotations

import ast
import base64
import builtins
import json
import multiprocessing
import os
import resource
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from RestrictedPython import compile_restricted_exec
from RestrictedPython.Eval import default_guarded_getitem
from RestrictedPython.Guards import full_write_guard, guarded_iter_unpack_sequence, guarded_unpack_sequence

from fedveil.errors import FedveilError
from fedveil.privacy.pairs import DataPolicyPair
from fedveil.privacy.policy import Policy, parse, show

__all__ = [
    "BUILTINS",
    "DENIED_ATTRIBUTES",
    "MAX_AST_DEPTH",
    "MAX_MESSAGE_BYTES",
    "MAX_SOURCE_CHARS",
    "MAX_VALUE_DEPTH",
    "DeadlineExceeded",
    "Handle",
    "HostError",
    "Program",
    "SandboxError",
    "check_deadline",
    "compile_program",
    "preload",
    "run_program",
]


class SandboxError(FedveilError):
    """A program the sandbox refused to compile or stopped while it ran."""


class HostError(FedveilError):
    """A host function refused a program's call (its message says why)."""


class SandboxStartError(FedveilError):
    """The sandbox's child process failed before the program ran: a fault of the host, not of the
    program, so it is never a :class:`SandboxError` (which a caller may treat as the program's stop)."""


class DeadlineExceeded(SandboxError):
    """A program ran past its ``deadline`` (:func:`run_program`), its host calls counted. A host
    function raises it to stop the program: it never reaches the program as a :class:`HostError`."""


def check_deadline(deadline: float | None, what: str) -> None:
    """Raise :class:`DeadlineExceeded` naming ``what`` if ``deadline`` (``time.monotonic()``) has
    passed."""
    if deadline is not None and time.monotonic() >= deadline:
        raise _late(what)


def _late(what: str) -> DeadlineExceeded:
    return DeadlineExceeded(f"{what} ran past its deadline (its host calls counted)")


_SAFE_NAMES = (
    "abs", "all", "any", "bool", "dict", "divmod", "enumerate", "float", "frozenset", "int", "isinstance",
    "len", "list", "max", "min", "pow", "range", "repr", "reversed", "round", "set", "sorted", "str", "sum",
    "tuple", "zip",
    "ArithmeticError", "AssertionError", "Exception", "IndexError", "KeyError", "LookupError",
    "RuntimeError", "StopIteration", "TypeError", "ValueError", "ZeroDivisionError",
)  # fmt: skip
BUILTINS: dict[str, Any] = {
    **{n: getattr(builtins, n) for n in _SAFE_NAMES},
    "None": None,
    "True": True,
    "False": False,
}
"""The builtins a program sees (module docstring)."""

_INTROSPECTION = {
    "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "ag_frame", "ag_code",
    "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "tb_frame", "tb_next",
    "func_globals", "func_code", "im_func", "im_self", "mro", "format", "format_map",
}  # fmt: skip

DENIED_ATTRIBUTES = frozenset({
    "ctypes", "data", "base", "tofile", "dump", "dumps", "setflags",
    "__array_interface__", "__array_struct__", "__array__", "__dlpack__",
    "data_ptr", "storage", "untyped_storage", "share_memory_",
})  # fmt: skip
"""Attributes refused on every object because, on arrays and tensors, they expose process memory (an
address: ``ctypes``, ``data_ptr``, ``__array_interface__``; the buffer or the object it views: ``data``,
``base``, ``storage``), write files (``tofile``, ``dump``, ``share_memory_``), pickle (``dumps``) or
unlock read-only memory for writing (``setflags``)."""

MAX_SOURCE_CHARS = 100_000
"""The longest program source :func:`compile_program` accepts, in characters."""

MAX_AST_DEPTH = 100
"""The deepest syntax tree :func:`compile_program` accepts (``return 1+1+...+1`` with 95 terms is about
100 levels deep; RestrictedPython's checks recurse on the tree)."""

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message between a program and its caller (its result, a host call, JSON-encoded)."""

MAX_VALUE_DEPTH = 100
"""The deepest nesting of lists and dicts in a value passed to or from a program."""


class Handle:
    """What a program holds of a pair that stays with its host (:func:`run_program`'s ``host``): an
    opaque reference and the pair's policy, never its value."""

    __slots__ = ("policy", "ref")

    def __init__(self, ref: int, policy: Policy) -> None:
        self.ref = ref
        self.policy = policy

    def __repr__(self) -> str:
        return f"Handle(<held by the host>, policy={show(self.policy)!r})"


def _guarded_getattr(obj: Any, name: str, default: Any = None) -> Any:
    if name in DENIED_ATTRIBUTES:
        raise SandboxError(f"attribute {name!r} is not available to programs (it exposes memory or files)")
    if name.startswith("_") or name in _INTROSPECTION or name.startswith("co_"):
        raise SandboxError(f"attribute {name!r} is not available to programs")
    if isinstance(obj, (DataPolicyPair, Handle)) and name != "policy":
        raise SandboxError(f"a data-policy pair has no attribute {name!r} for programs")
    return getattr(obj, name)


@dataclass(frozen=True)
class Program:
    """A compiled program: its ``name``, code object and ``source`` (a program travels to the sandbox's
    process as its source and is compiled again there: code objects do not pickle)."""

    name: str
    code: Any
    source: str = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (compile_program, (self.source, self.name))


_PRELOAD = {__name__}


def preload(module: str) -> None:
    """Have sandboxed programs start with ``module`` imported (a library's module, so that its functions
    arrive in the program's process without importing it each time). Takes effect if called before the
    first program runs."""
    _PRELOAD.add(module)


def _tree_depth(tree: ast.AST) -> int:
    """The depth of a syntax tree (a stack, no recursion)."""
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def compile_program(source: str, name: str = "program") -> Program:
    """Compile ``source`` with RestrictedPython; refusals become one :class:`SandboxError` listing them.
    A source over :data:`MAX_SOURCE_CHARS` characters, or whose syntax tree is deeper than
    :data:`MAX_AST_DEPTH` levels (checked before RestrictedPython walks it), is a :class:`SandboxError`
    naming the limit."""
    if not isinstance(source, str):
        raise SandboxError(f"program {name} must be Python source text")
    if len(source) > MAX_SOURCE_CHARS:
        raise SandboxError(
            f"program {name} is {len(source)} characters, over the sandbox's limit of {MAX_SOURCE_CHARS}"
        )
    too_deep = SandboxError(
        f"program {name} refused: its syntax tree is deeper than the sandbox's limit of {MAX_AST_DEPTH} "
        "levels (split long expressions into statements)"
    )
    try:
        tree = ast.parse(source, filename=f"<{name}>")
    except SyntaxError:
        tree = None  # RestrictedPython reports it in its own words below
    except (RecursionError, MemoryError):  # CPython's parser gives up on very deep nesting
        raise too_deep from None
    if tree is not None and _tree_depth(tree) > MAX_AST_DEPTH:
        raise too_deep
    result = compile_restricted_exec(source if tree is None else tree, filename=f"<{name}>")
    if result.errors or result.code is None:
        raise SandboxError(f"program {name} refused: " + "; ".join(result.errors or ("no code",)))
    return Program(name, result.code, source)


def _encode(value: Any, table: dict[int, DataPolicyPair] | None = None, depth: int = 0) -> Any:
    """A value as tagged JSON-safe data: every value is a ``[tag, ...]`` list, so no value a program
    builds (a dict with a key ``"pair"``, say) can be read back as a pair or an array. With ``table``
    (the host's side) a pair is registered there and travels as a handle, without its value. Lists and
    dicts nested deeper than :data:`MAX_VALUE_DEPTH` are a :class:`SandboxError`."""
    if depth > MAX_VALUE_DEPTH:
        raise SandboxError(
            f"a value nests lists or dicts deeper than the sandbox's limit of {MAX_VALUE_DEPTH}"
        )
    if isinstance(value, Handle):
        return ["handle", value.ref, show(value.policy)]
    if isinstance(value, DataPolicyPair) and table is not None:
        ref = len(table)
        table[ref] = value
        return ["handle", ref, show(value.policy)]
    if isinstance(value, DataPolicyPair):
        return ["pair", show(value.policy), _encode(value._value(), None, depth + 1)]
    if isinstance(value, Policy):
        return ["policy", show(value)]
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"a program may return numeric arrays only, not dtype {value.dtype}")
        data = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<"), copy=False)
        return [
            "array",
            value.dtype.newbyteorder("<").str,
            list(value.shape),
            base64.b64encode(data.tobytes()).decode(),
        ]
    if isinstance(value, (list, tuple)):
        return ["list", [_encode(v, table, depth + 1) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[str(k), _encode(v, table, depth + 1)] for k, v in value.items()]]
    if value is None or isinstance(value, (bool, int, float, str)):
        return ["value", value]
    raise TypeError(
        f"a program may return numbers, strings, lists, dicts, arrays and pairs, not {type(value).__name__}"
    )


def _decode(value: Any, table: dict[int, DataPolicyPair] | None = None) -> Any:
    """The inverse of :func:`_encode`; a handle becomes the host's pair (with ``table``) or a
    :class:`Handle` (in the child)."""
    tag = value[0]
    if tag == "handle":
        if table is None:
            return Handle(int(value[1]), parse(value[2]))
        if value[1] not in table:
            raise SandboxError(f"a program returned a handle the host never gave it ({value[1]!r})")
        return table[value[1]]
    if tag == "pair":
        return DataPolicyPair(_decode(value[2]), parse(value[1]))
    if tag == "policy":
        return parse(value[1])
    if tag == "array":
        dtype, shape = np.dtype(value[1]), tuple(int(n) for n in value[2])
        return (
            np.frombuffer(base64.b64decode(value[3]), dtype=dtype)
            .reshape(shape)
            .astype(dtype.newbyteorder("="))
        )
    if tag == "list":
        return [_decode(v, table) for v in value[1]]
    if tag == "dict":
        return {k: _decode(v, table) for k, v in value[1]}
    return value[1]


def _message(payload: dict[str, Any], what: str) -> bytes:
    """``payload`` as one message, or a :class:`SandboxError` naming :data:`MAX_MESSAGE_BYTES` when
    ``what`` is larger."""
    data = json.dumps(payload).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise SandboxError(
            f"{what} is {len(data)} bytes encoded, over the sandbox's limit of {MAX_MESSAGE_BYTES} bytes"
        )
    return data


def _receive(conn: Any, name: str) -> dict[str, Any]:
    """The next message from program ``name``'s child; one over :data:`MAX_MESSAGE_BYTES` (which the
    child refuses to send) or one that does not decode is a :class:`SandboxError`."""
    try:
        return json.loads(conn.recv_bytes(MAX_MESSAGE_BYTES).decode())
    except OSError:  # multiprocessing's "bad message length"
        raise SandboxError(
            f"program {name} sent a message over the sandbox's limit of {MAX_MESSAGE_BYTES} bytes"
        ) from None
    except (ValueError, RecursionError):
        raise SandboxError(f"program {name} sent a message that does not decode") from None


def _child(
    program: Program,
    entry: str,
    encoded: str,
    library: Mapping[str, Callable[..., Any]],
    host: tuple[str, ...],
    memory: int,
    cpu: int,
    conn: Any,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the caller's to act on

    def proxy(name: str) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            conn.send_bytes(
                _message({"call": name, "args": _encode(list(a)), "kwargs": _encode(kw)}, f"a call of {name}")
            )
            reply = json.loads(conn.recv_bytes().decode())
            if "error" in reply:
                raise HostError(f"{name}: {reply['message']}" if reply["message"] else f"{name} failed")
            return _decode(reply["ok"])

        return call

    try:
        with open("/proc/self/statm", encoding="ascii") as statm:  # the forked image's address space
            used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (used + memory, used + memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        scope: dict[str, Any] = {
            "__builtins__": BUILTINS,
            "_getattr_": _guarded_getattr,
            "_getitem_": default_guarded_getitem,
            "_getiter_": iter,
            "_write_": full_write_guard,
            "_iter_unpack_sequence_": guarded_iter_unpack_sequence,
            "_unpack_sequence_": guarded_unpack_sequence,
            "__name__": program.name,
            **library,
            **{name: proxy(name) for name in host},
        }
        exec(program.code, scope)
        fn = scope.get(entry)
        if not callable(fn):
            raise SandboxError(f"program {program.name} defines no function {entry}()")
        result = _encode(fn(*_decode(json.loads(encoded))))
        conn.send_bytes(_message({"ok": result}, "its result"))
    except MemoryError:
        conn.send_bytes(
            json.dumps(
                {"error": "MemoryError", "message": f"over the memory limit of {memory} bytes"}
            ).encode()
        )
    except BaseException as exc:
        message = str(exc) if isinstance(exc, FedveilError) else ""
        conn.send_bytes(json.dumps({"error": type(exc).__name__, "message": message[:500]}).encode())
    finally:
        conn.close()
        os._exit(0)


def run_program(
    program: Program,
    entry: str,
    *args: Any,
    library: Mapping[str, Callable[..., Any]] | None = None,
    host: Mapping[str, Callable[..., Any]] | None = None,
    time_limit: float = 10.0,
    memory_limit: int = 1 << 30,
    deadline: float | None = None,
) -> Any:
    """Call ``entry(*args)`` of ``program`` in a child process under the limits (module docstring:
    ``memory_limit`` bytes of address space beyond what the child's image already maps, ``time_limit``
    seconds of the program's own running) and return its result; a refused operation, an exception of
    the program's own or an exceeded limit is a :class:`SandboxError` naming it (an exception's message
    is passed on only when fedveil wrote it).

    ``library`` functions run in the child (module-level functions: they reach it by name, their module
    imported there or preloaded, :func:`preload`). ``host`` functions run here, in the caller's process: the
    program calls them through the pipe, and every pair among ``args`` and among a host function's
    results stays here, the program holding a :class:`Handle` (its policy, never its value). Time spent
    in host functions does not count against ``time_limit``. A host function's
    :class:`~fedveil.errors.FedveilError` reaches the program as a :class:`HostError` with its message;
    any other exception is the host's own failure: the child is stopped and the exception raised here.

    ``deadline`` (a ``time.monotonic()`` instant) bounds everything the call causes, host calls
    included: the program is stopped when it passes, no host call starts after it, and a host function
    that notices it (:func:`check_deadline`) stops the program too; each is a :class:`DeadlineExceeded`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(sorted(_PRELOAD))
    parent, child = context.Pipe(duplex=True)
    # RLIMIT_CPU is the backstop; one second above the wall-clock limit, so that a busy loop is reported
    # by the wall clock ("ran past its time limit") rather than by SIGXCPU, whichever process starts faster
    cpu = max(1, int(time_limit + 0.999)) + 1
    table: dict[int, DataPolicyPair] | None = {} if host else None
    try:
        encoded = json.dumps(_encode(list(args), table))
    except TypeError as exc:
        raise SandboxError(
            f"program {program.name}: an argument cannot be given to a program: {exc}"
        ) from None
    names = tuple(host or ())
    proc = context.Process(
        target=_child,
        args=(program, entry, encoded, dict(library or {}), names, memory_limit, cpu, child),
        daemon=True,
    )
    proc.start()
    child.close()
    waited = 0.0
    try:
        while True:
            start = time.monotonic()
            own = time_limit - waited
            left = own if deadline is None else min(own, deadline - start)
            ready = parent.poll(max(0.0, left))
            waited += time.monotonic() - start
            if not ready:
                if left < own:
                    raise _late(f"program {program.name}")
                raise SandboxError(f"program {program.name} ran past its time limit of {time_limit} s")
            reply = _receive(parent, program.name)
            if "call" not in reply:
                break
            check_deadline(deadline, f"program {program.name}")
            parent.send_bytes(json.dumps(_serve(host or {}, reply, table)).encode())
    except EOFError:
        proc.join(timeout=5.0)
        if proc.exitcode is not None and proc.exitcode > 0:
            # the child ends with os._exit(0) once it has started the program; a positive code means it
            # died starting (a signal gives a negative one: the program's limits)
            raise SandboxStartError(
                f"the sandbox process for program {program.name} exited with code {proc.exitcode} before "
                "the program ran (its error is on stderr); if this was called from a script, put the call "
                'under `if __name__ == "__main__":`, since the sandbox\'s forkserver re-imports the main '
                "module"
            ) from None
        raise SandboxError(
            f"program {program.name} was stopped (exit code {proc.exitcode}): a limit was exceeded"
        ) from None
    finally:
        if proc.is_alive():
            proc.kill()  # SIGKILL; a child that exited in between is not an error
        proc.join()
        parent.close()
    if "error" in reply:
        detail = f": {reply['message']}" if reply.get("message") else ""
        raise SandboxError(f"program {program.name} failed with {reply['error']}{detail}")
    return _decode(reply["ok"], table)


def _serve(host: Mapping[str, Callable[..., Any]], request: dict[str, Any], table: Any) -> dict[str, Any]:
    """Run one host call for the program (:func:`run_program`)."""
    name = request.get("call")
    if name not in host:
        return {"error": "NameError", "message": f"no host function {name!r}"}
    try:
        args = _decode(request["args"], table)
        kwargs = _decode(request["kwargs"], table)
        return {"ok": _encode(host[name](*args, **kwargs), table)}
    except DeadlineExceeded:
        raise
    except FedveilError as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:500]}
