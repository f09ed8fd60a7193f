"""fedveil.commands: one module per ``fedveil`` sub-command (each with its ``register``), and here the
command-line options several of them share.

``--device`` of the commands that are not a system's ``run`` (those take it through
:func:`fedveil.experiments.checkpoint.add_run_arguments`, checked when the config loads): its value is
checked as the option is parsed, so a misspelt device fails before anything loads or trains.
"""

from __future__ import annotations

import argparse
from typing import Any

from fedveil.errors import ConfigError
from fedveil.models.device import check_device_spec

__all__ = ["add_device_argument", "device_spec"]


def device_spec(text: str) -> str:
    """``--device``'s argparse type: ``text`` if it is spelled as a ``device`` setting
    (:func:`~fedveil.models.device.check_device_spec`), else a parse error naming it and the spellings
    allowed. Whether this machine has the device is :func:`~fedveil.models.device.resolve_device`'s
    question, asked when the work starts."""
    try:
        return check_device_spec(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_device_argument(parser: Any, *, where: str, default: str | None = "auto") -> None:
    """Add ``--device`` (:func:`device_spec`) to ``parser``; ``where`` says what runs there (``"where
    the attacks run"``), ``default`` is its value when not given (``auto``: CUDA when torch sees a GPU;
    None: the command's config decides, and ``where`` says so)."""
    said = "" if default is None else f" (default {default})"
    parser.add_argument(
        "--device",
        type=device_spec,
        default=default,
        help=f"{where}: auto (CUDA when available), cpu, cuda or cuda:N{said}",
    )
