"""A **synthetic** stand-in for the Mobile Phone Use (MPU) data set (Pielot et al. 2017; PoliFL Sec. 6.3):
notifications on users' phones, each described by the 15 sensors the paper lists, labelled with whether
the user engaged with it within 10 minutes.

The real MPU logs are not public here; :func:`synthetic_mpu` draws a population with the same shape
(237 users, 15 sensors, a few dozen to a few hundred notifications per user, about a quarter engaged) so
that PoliFL's user-behaviour use case runs end to end. It is labelled synthetic in every result.

**How it is drawn** (seeded): each sensor reading is a standardised value that follows an AR(1) process
along a user's notifications (the context changes slowly), offset by a per-user habit. A sample is a
window of the last ``window`` notifications' readings (the LSTM's input, as in Katevas et al. 2017) and
the label of the last one: ``P(engage) = sigmoid(b_u + w . x_t + v . mean(x) + c * mic_t * screen_t)``
with a per-user bias ``b_u``. The microphone (ambient noise) and the location carry much of the signal
(the largest weights), so ``filter(sensors=['mic', 'loc'])`` costs AUC, as Table 5's rows do.
"""

from __future__ import annotations

import numpy as np

from fedveil.errors import ConfigError

__all__ = ["SENSORS", "synthetic_mpu"]

SENSORS = (
    "accelerometer", "battery", "network", "light", "mic", "loc", "app", "audio_source", "music",
    "charging", "notification", "notification_center", "ringer", "screen", "orientation",
)  # fmt: skip
"""The 15 sensors of PoliFL Sec. 6.3, in the order of the feature columns (``mic`` is the paper's noise
sensor, ``loc`` its location)."""

_WEIGHTS = np.array([0.3, 0.2, 0.25, 0.2, 1.1, 1.0, 0.5, 0.15, 0.2, 0.25, 0.4, 0.35, 0.3, 0.6, 0.1])


def synthetic_mpu(
    users: int = 237,
    *,
    seed: int = 0,
    window: int = 5,
    notifications: tuple[int, int] = (40, 160),
    test_fraction: float = 0.2,
) -> dict[str, dict[str, np.ndarray]]:
    """Per user: ``x`` ``(n, window, 15)`` float32, ``y`` ``(n,)`` int64 (1 = engaged within 10 minutes),
    ``test_x`` / ``test_y`` (the user's last ``test_fraction`` of notifications, held out in time) and
    ``sensor_columns`` (:data:`SENSORS`). Module docstring: how it is drawn."""
    if users < 2:
        raise ConfigError(f"users {users} must be >= 2")
    if window < 1:
        raise ConfigError(f"window {window} must be >= 1")
    lo, hi = notifications
    if not 2 * window <= lo <= hi:
        raise ConfigError(f"notifications {notifications} must satisfy 2 * window <= low <= high")
    if not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction {test_fraction} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    k = len(SENSORS)
    v = rng.normal(0.0, 0.3, size=k)
    out: dict[str, dict[str, np.ndarray]] = {}
    for u in range(users):
        n = int(rng.integers(lo, hi + 1)) + window - 1
        habit = rng.normal(0.0, 0.5, size=k)
        bias = rng.normal(-1.3, 0.6)
        readings = np.empty((n, k))
        readings[0] = habit + rng.normal(size=k)
        for t in range(1, n):
            readings[t] = habit + 0.6 * (readings[t - 1] - habit) + 0.8 * rng.normal(size=k)
        windows = np.stack([readings[t - window + 1 : t + 1] for t in range(window - 1, n)])
        last = windows[:, -1, :]
        logit = bias + last @ _WEIGHTS + windows.mean(axis=1) @ v + 0.8 * last[:, 4] * last[:, 13]
        y = (rng.random(len(windows)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
        cut = round(len(windows) * (1 - test_fraction))
        x = windows.astype(np.float32)
        out[f"user{u:03d}"] = {
            "x": x[:cut],
            "y": y[:cut],
            "test_x": x[cut:],
            "test_y": y[cut:],
            "sensor_columns": np.array(SENSORS),
        }
    return out
