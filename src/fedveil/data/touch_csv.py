"""Real touch logs from CSV, as a TouchAuth population (FDML, Sec. VII-B).

Schema: a UTF-8 CSV file with a header row and one row per touch event. These columns are required (in
any order; other columns are ignored):

=================  ==========================================================================
column             meaning
=================  ==========================================================================
user_id            the device owner (non-empty text); one user = one device
phone_model        the phone model (non-empty text); constant for a user
timestamp_ms       when the touch began, integer milliseconds (any epoch)
x_start_px         start x in pixels, ``0 <= x <= screen_width_px``
y_start_px         start y in pixels, ``0 <= y <= screen_height_px`` (y grows downwards)
x_end_px           end x in pixels, same range
y_end_px           end y in pixels, same range
screen_width_px    screen width in pixels at the time of the touch (> 0)
screen_height_px   screen height in pixels (> 0)
duration_ms        touch duration in milliseconds (>= 0; no upper bound, values over 1,600 are clipped)
pressure           reported touch pressure in [0, 1]
size               reported contact size in [0, 1]
type               ``swipe`` or ``tap`` (case-insensitive)
=================  ==========================================================================

Rows may come in any order: each user's events are sorted by ``timestamp_ms`` (stably). They are
encoded with :func:`fedveil.data.touchauth.encode_touch_events` into FDML's 10-dim vectors (coordinates
over the screen size, direction bits, duration clipped at 1,600 ms over 1,600, pressure, size, type)
and cut into samples by the 30-minute rule. A bad row raises
:class:`~fedveil.errors.ValidationError` naming the file, line number, column and value.

:func:`write_touch_fixture` generates the small fixture shipped in ``fedveil/data/fixtures``
(:data:`FIXTURE_PATH`) from the synthetic generator.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from fedveil.data.federated import FederatedDataset, UserData, choose_test_users
from fedveil.data.touchauth import (
    RawTouchEvents,
    TouchAuthConfig,
    TouchAuthPopulation,
    disjoint_window_starts,
    encode_touch_events,
    simulate_user,
    valid_window_starts,
)
from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "FIXTURE_PATH",
    "SCHEMA_COLUMNS",
    "load_touch_population",
    "read_touch_csv",
    "write_touch_csv",
    "write_touch_fixture",
]

SCHEMA_COLUMNS: tuple[str, ...] = (
    "user_id",
    "phone_model",
    "timestamp_ms",
    "x_start_px",
    "y_start_px",
    "x_end_px",
    "y_end_px",
    "screen_width_px",
    "screen_height_px",
    "duration_ms",
    "pressure",
    "size",
    "type",
)
FIXTURE_PATH = Path(__file__).parent / "fixtures" / "touch_logs_small.csv"
_TYPES = {"swipe": False, "tap": True}
_NUMERIC = SCHEMA_COLUMNS[3:12]


class _Row:
    """Parses one CSV row, raising errors that name the source, line, column and value."""

    def __init__(self, source: str, line: int, row: dict[str, str]) -> None:
        self.source, self.line, self.row = source, line, row

    def error(self, column: str, expected: str) -> ValidationError:
        return ValidationError(
            f"{self.source}, line {self.line}: column {column!r} has value {self.row[column]!r}; "
            f"expected {expected}"
        )

    def text(self, column: str) -> str:
        value = (self.row[column] or "").strip()
        if not value:
            raise self.error(column, "non-empty text")
        return value

    def integer(self, column: str) -> int:
        try:
            return int((self.row[column] or "").strip())
        except ValueError:
            raise self.error(column, "an integer number of milliseconds") from None

    def number(self, column: str, low: float, high: float, expected: str, *, open_low: bool = False) -> float:
        try:
            value = float((self.row[column] or "").strip())
        except ValueError:
            raise self.error(column, expected) from None
        if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
            raise self.error(column, expected)
        return value


def _parse_row(parsed: _Row) -> tuple[int, tuple[float, ...], bool]:
    """``(timestamp_ms, (x_s, y_s, x_e, y_e, width, height, duration, pressure, size), is_tap)``."""
    timestamp = parsed.integer("timestamp_ms")
    width = parsed.number("screen_width_px", 0.0, math.inf, "a positive number of pixels", open_low=True)
    height = parsed.number("screen_height_px", 0.0, math.inf, "a positive number of pixels", open_low=True)
    coords = []
    for column, bound, name in (
        ("x_start_px", width, "screen_width_px"),
        ("y_start_px", height, "screen_height_px"),
        ("x_end_px", width, "screen_width_px"),
        ("y_end_px", height, "screen_height_px"),
    ):
        coords.append(parsed.number(column, 0.0, bound, f"a number of pixels in [0, {name} = {bound:g}]"))
    duration = parsed.number("duration_ms", 0.0, math.inf, "a non-negative number of milliseconds")
    pressure = parsed.number("pressure", 0.0, 1.0, "a number in [0, 1]")
    size = parsed.number("size", 0.0, 1.0, "a number in [0, 1]")
    kind = parsed.text("type").lower()
    if kind not in _TYPES:
        raise parsed.error("type", "'swipe' or 'tap'")
    return timestamp, (*coords, width, height, duration, pressure, size), _TYPES[kind]


def read_touch_csv(path: str | Path) -> FederatedDataset:
    """Read a touch log in the module's schema into a :class:`FederatedDataset`.

    One record per user (in order of first appearance) with attribute ``phone_model`` and arrays
    ``events`` ``(n, 10)`` float32 (FDML Appendix encoding) and ``timestamps_ms`` ``(n,)`` int64, sorted by
    time. Raises :class:`ValidationError` for a missing column, a bad value (file, line, column, value),
    a user with two phone models, or a file without events.
    """
    source = str(path)
    times: dict[str, list[int]] = {}
    values: dict[str, list[tuple[float, ...]]] = {}
    taps: dict[str, list[bool]] = {}
    models: dict[str, str] = {}
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        duplicated = sorted({c for c in header if header.count(c) > 1})
        if duplicated:
            raise ValidationError(f"{source}: header names columns {duplicated} more than once")
        missing = [c for c in SCHEMA_COLUMNS if c not in header]
        if missing:
            raise ValidationError(
                f"{source}: missing columns {missing}; the header must name all of {list(SCHEMA_COLUMNS)}"
            )
        for row in reader:
            parsed = _Row(source, reader.line_num, row)
            if None in row or any(row[c] is None for c in SCHEMA_COLUMNS):
                raise ValidationError(
                    f"{source}, line {reader.line_num}: expected {len(header)} fields like the header"
                )
            user_id, model = parsed.text("user_id"), parsed.text("phone_model")
            if models.setdefault(user_id, model) != model:
                raise parsed.error(
                    "phone_model", f"{models[user_id]!r}, the phone model of user {user_id!r} on earlier rows"
                )
            timestamp, numbers, is_tap = _parse_row(parsed)
            times.setdefault(user_id, []).append(timestamp)
            values.setdefault(user_id, []).append(numbers)
            taps.setdefault(user_id, []).append(is_tap)
    if not models:
        raise ValidationError(f"{source}: no touch events after the header")
    users = []
    for user_id, model in models.items():
        timestamps = np.asarray(times[user_id], dtype=np.int64)
        order = np.argsort(timestamps, kind="stable")
        columns = np.asarray(values[user_id], dtype=np.float64)[order].T
        raw = RawTouchEvents(
            timestamp_ms=timestamps[order],
            x_start_px=columns[0],
            y_start_px=columns[1],
            x_end_px=columns[2],
            y_end_px=columns[3],
            screen_width_px=columns[4],
            screen_height_px=columns[5],
            duration_ms=columns[6],
            pressure=columns[7],
            size=columns[8],
            is_tap=np.asarray(taps[user_id], dtype=bool)[order],
        )
        users.append(
            UserData(
                user_id=user_id,
                attributes={"phone_model": model},
                arrays={"events": encode_touch_events(raw), "timestamps_ms": raw.timestamp_ms},
            )
        )
    return FederatedDataset(users)


def load_touch_population(
    path: str | Path,
    *,
    test_users: Iterable[str] | None = None,
    test_users_per_model: int = 30,
    seed: int = 0,
    events_per_sample: int = 30,
    window_minutes: float = 30.0,
    min_train_samples: int = 1,
    test_samples: int = 40,
) -> TouchAuthPopulation:
    """A :class:`TouchAuthPopulation` from a touch-log CSV (FDML Sec. VII-B protocol on real logs).

    Test users are ``test_users`` when given; otherwise, for each phone model, ``test_users_per_model``
    users drawn by ``numpy.random.default_rng(seed)`` among the users whose streams hold at least
    ``test_samples`` non-overlapping samples (FDML: 30 per model). All other users train and need at least
    ``min_train_samples`` non-overlapping samples of ``events_per_sample`` events within
    ``window_minutes``; a user short of that is a :class:`ValidationError` naming the user.
    """
    dataset = read_touch_csv(path)
    window_ms = window_minutes * 60_000.0
    if test_users is None:
        eligible = [
            user.user_id
            for user in dataset
            if disjoint_window_starts(
                valid_window_starts(user.arrays["timestamps_ms"], events_per_sample, window_ms),
                events_per_sample,
            ).shape[0]
            >= test_samples
        ]
        test_users = choose_test_users(
            dataset,
            per_value=test_users_per_model,
            attribute="phone_model",
            rng=np.random.default_rng(seed),
            eligible=eligible,
        )
    else:
        test_users = list(test_users)
        unknown = [u for u in test_users if u not in dataset]
        if unknown:
            raise ConfigError(f"test_users {unknown} are not users of {path}")
    train, test = dataset.split_by_user(test_users)
    return TouchAuthPopulation(
        train,
        test,
        events_per_sample=events_per_sample,
        window_minutes=window_minutes,
        min_train_samples=min_train_samples,
        test_samples=test_samples,
    )


def _number(value: float) -> str:
    return np.format_float_positional(value, trim="-")


def write_touch_csv(path: str | Path, users: Iterable[tuple[str, str, RawTouchEvents]]) -> int:
    """Write ``(user_id, phone_model, raw events)`` triples in the module's schema; returns the row count.

    Rows are ordered by timestamp across users (as a device log export would be), ties by user order.
    Floats are written in their shortest round-tripping form.
    """
    rows: list[tuple[int, int, list[str]]] = []
    for order, (user_id, model, raw) in enumerate(users):
        columns = [getattr(raw, name) for name in _NUMERIC]
        for i in range(len(raw)):
            kind = "tap" if raw.is_tap[i] else "swipe"
            timestamp = int(raw.timestamp_ms[i])
            fields = [_number(column[i]) for column in columns]
            rows.append((timestamp, order, [user_id, model, str(timestamp), *fields, kind]))
    rows.sort(key=lambda r: (r[0], r[1]))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(SCHEMA_COLUMNS)
        writer.writerows(r[2] for r in rows)
    return len(rows)


def write_touch_fixture(path: str | Path = FIXTURE_PATH, *, seed: int = 0) -> int:
    """Write the small fixture log: 3 users on each of phone models A and B, 3 samples' worth each.

    The users are synthetic test-split users of :func:`fedveil.data.touchauth.simulate_user` with
    ``test_samples=3``: each stream ends right after its third non-overlapping 30-event sample, and holds
    session gaps (windows that break the 30-minute rule) and long presses (durations over 1,600 ms).
    Returns the number of rows written.
    """
    cfg = TouchAuthConfig(
        seed=seed, train_users_per_model=(3, 3), test_users_per_model=(0, 0), test_samples=3
    )
    users = [
        (f"user-{phone.name}{i}", phone.name, simulate_user(cfg, "test", m, i))
        for m, phone in enumerate(cfg.phone_models)
        for i in range(3)
    ]
    return write_touch_csv(path, users)
