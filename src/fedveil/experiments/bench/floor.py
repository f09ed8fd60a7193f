"""The arithmetic floor of a training benchmark, in CPU time, so that it does not move with the load.

- :func:`tree_cpu_seconds`: CPU seconds (user + system) used so far by a process and all its
  descendants: its own threads, its live descendants (read from ``/proc``: Ray's raylet, GCS and
  workers, ...) and every descendant already reaped.
- :func:`peak_gemm_flops_per_second`: FLOPs per second of a large float32 ``torch.matmul`` on a given
  number of threads, by the wall clock or by this process's CPU clock; or on a GPU, by the wall clock
  after the device has finished.
- :func:`host_device_bytes_per_second`: bytes per second copied between host memory and a GPU, each way:
  what a round on a GPU pays to move its messages across.
- :func:`training_flops`: FLOPs of one forward and backward pass of a model over a batch, counted
  analytically from its convolutions and linear layers as torch's ``FlopCounterMode`` counts them.

This module imports only the standard library at load time (torch inside the functions that need it),
so the peer frameworks' scripts of ``fedveil bench peers`` load it by path from their own virtual
environments, where fedveil is not installed: one measurement for every framework.
"""

from __future__ import annotations

import copy
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["host_device_bytes_per_second", "peak_gemm_flops_per_second", "training_flops", "tree_cpu_seconds"]

_PROC = Path("/proc")


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process (all threads), its live descendants and its reaped ones.

    Descendants are found by their parent ids in ``/proc/<pid>/stat``; each live one adds its own user
    and system time and that of its own reaped children (``cutime``, ``cstime``), so nothing is counted
    twice. Ticks of ``/proc`` are 10 ms on Linux; a descendant that exits between two reads is counted
    once, when it is reaped. Without ``/proc`` (not Linux) only this process and its reaped children
    are counted."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    if not _PROC.is_dir():
        return total
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited while we listed
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        times[pid] = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    pending = list(children.get(os.getpid(), []))
    while pending:
        pid = pending.pop()
        total += times[pid] / ticks
        pending.extend(children.get(pid, []))
    return total


def peak_gemm_flops_per_second(
    threads: int,
    *,
    size: int | None = None,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    device: str = "cpu",
) -> float:
    """``2 * size**3`` FLOPs of a ``size`` x ``size`` float32 ``torch.matmul`` on ``threads`` torch
    threads over the median ``clock`` seconds of ``repeats`` products after one warm-up: the machine's
    best case. ``clock=time.process_time`` gives FLOPs per CPU second (every thread's time summed), a
    rate the load of the machine barely moves. Restores the thread count.

    ``device`` (a torch device name: ``cpu``, ``cuda``, ``cuda:N``) is where the product runs; on a GPU
    each product is timed by the wall clock up to the device's finishing it (kernels run asynchronously),
    the operands live there, and ``size`` defaults to 8192 (a GPU needs a larger product than the CPU's
    2048 to reach its peak). float32 products run at torch's default precision for them, the one
    training uses (no TF32 unless the caller allowed it)."""
    import torch

    where = torch.device(device)

    def finish() -> None:
        if where.type == "cuda":
            torch.cuda.synchronize(where)

    side = size if size is not None else (8192 if where.type == "cuda" else 2048)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(side, side, generator=gen).to(where)
        b = torch.randn(side, side, generator=gen).to(where)
        torch.matmul(a, b)
        finish()
        seconds = []
        for _ in range(repeats):
            start = clock()
            torch.matmul(a, b)
            finish()
            seconds.append(clock() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * side**3 / statistics.median(seconds)


def host_device_bytes_per_second(
    device: str, *, nbytes: int = 2**26, repeats: int = 5, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Bytes per second of copying a float32 tensor of ``nbytes`` from (pageable) host memory to
    ``device`` (``host_to_device``) and back (``device_to_host``), each the median of ``repeats`` copies
    after one warm-up, timed up to the device's finishing them: the rates at which a round's messages
    cross between the host, where the codec and the enclave work, and a GPU. ``device`` must be a GPU
    (``cuda`` or ``cuda:N``): on the CPU nothing crosses."""
    import torch

    where = torch.device(device)
    if where.type != "cuda":
        raise ValueError(f"device {device!r}: host-device copies are measured for a GPU (cuda, cuda:N)")
    host = torch.ones(nbytes // 4, dtype=torch.float32)
    on_device = host.to(where)
    torch.cuda.synchronize(where)

    def rate(copy: Callable[[], Any]) -> float:
        copy()
        torch.cuda.synchronize(where)
        seconds = []
        for _ in range(repeats):
            start = clock()
            copy()
            torch.cuda.synchronize(where)
            seconds.append(clock() - start)
        return host.numel() * 4 / statistics.median(seconds)

    return {
        "host_to_device": rate(lambda: host.to(where)),
        "device_to_host": rate(lambda: on_device.to("cpu")),
    }


def training_flops(model: Any, x: Any) -> int:
    """FLOPs of one forward and backward pass of ``model`` over the batch ``x``, counted from its layers.

    Each call of a convolution or linear layer costs ``2 * out_elements * fan_in`` FLOPs forward
    (``fan_in``: input channels per group x kernel size, or input features), as much again for its
    weight gradient, and as much again for its input gradient when its input needs one (not for the
    first layer over the data). As torch's ``FlopCounterMode``: one multiply and one add per
    multiply-accumulate; biases, normalisation, activations, pooling and the loss are not counted.
    The shapes come from one forward pass of a copy of the model over ``x``; the model is left as it
    was. Matrix products written outside these layers are not seen; recurrent, attention, bilinear and
    transposed-convolution layers are refused by name."""
    import torch
    from torch import nn

    counted = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
    refused = (nn.RNNBase, nn.MultiheadAttention, nn.Bilinear, nn.modules.conv._ConvTransposeNd)
    unknown = [name for name, m in model.named_modules() if isinstance(m, refused)]
    if unknown:
        raise ValueError(
            f"training_flops counts convolutions and linear layers only; {unknown} are neither: count "
            "this model with torch.utils.flop_counter.FlopCounterMode instead"
        )
    total = [0]

    def count(module: Any, inputs: tuple[Any, ...], output: Any) -> None:
        fan_in = module.weight[0].numel()  # in_features, or in_channels / groups x kernel size
        forward = 2 * output.numel() * fan_in
        total[0] += forward * (3 if inputs[0].requires_grad else 2)

    probe = copy.deepcopy(model)  # a training-mode forward may update buffers (BatchNorm's statistics)
    for module in probe.modules():
        if isinstance(module, counted):
            module.register_forward_hook(count)
    with torch.enable_grad():
        probe(x)
    return total[0]
