"""Federated data sets: users with attributes and per-user arrays, split by user.

A :class:`FederatedDataset` is the data of a population of devices: each user (one device, one owner)
has string attributes (``{"phone_model": "A"}``) and named numpy arrays (``{"events": (n, 10),
"timestamps_ms": (n,)}``) that never mix with another user's. Splits are by user, so train and test
users are always disjoint, as in FDML Sec. VII-B.

Arrays are stored as read-only views: a dataset never changes after it is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from fedveil.errors import ConfigError, ValidationError

__all__ = ["FederatedDataset", "UserData", "choose_test_users"]


def _read_only(array: np.ndarray) -> np.ndarray:
    view = np.asarray(array).view()
    view.setflags(write=False)
    return view


@dataclass(frozen=True)
class UserData:
    """One user's record: a non-empty ``user_id``, string ``attributes`` and named numpy ``arrays``."""

    user_id: str
    attributes: Mapping[str, str]
    arrays: Mapping[str, np.ndarray]

    def __post_init__(self) -> None:
        if not isinstance(self.user_id, str) or not self.user_id:
            raise ValidationError(f"user_id must be a non-empty string, got {self.user_id!r}")
        for key, value in self.attributes.items():
            if not isinstance(value, str):
                raise ValidationError(
                    f"user {self.user_id!r}: attribute {key!r} must be a string, got {value!r}"
                )
        object.__setattr__(self, "attributes", MappingProxyType(dict(self.attributes)))
        arrays = {name: _read_only(a) for name, a in self.arrays.items()}
        object.__setattr__(self, "arrays", MappingProxyType(arrays))


class FederatedDataset:
    """Users (in insertion order) with attributes and per-user arrays; lookups and splits by user."""

    def __init__(self, users: Iterable[UserData]) -> None:
        self._users: dict[str, UserData] = {}
        for user in users:
            if user.user_id in self._users:
                raise ValidationError(f"user id {user.user_id!r} appears twice; user ids must be unique")
            self._users[user.user_id] = user

    @property
    def user_ids(self) -> tuple[str, ...]:
        """All user ids in insertion order."""
        return tuple(self._users)

    def __len__(self) -> int:
        return len(self._users)

    def __contains__(self, user_id: object) -> bool:
        return user_id in self._users

    def __iter__(self) -> Iterator[UserData]:
        return iter(self._users.values())

    def user(self, user_id: str) -> UserData:
        """The record of ``user_id``; an unknown id is a :class:`ValidationError`."""
        try:
            return self._users[user_id]
        except KeyError:
            raise ValidationError(
                f"unknown user id {user_id!r}; this dataset has {len(self)} users"
                + (f", e.g. {next(iter(self._users))!r}" if self._users else "")
            ) from None

    def array(self, user_id: str, name: str) -> np.ndarray:
        """The read-only array ``name`` of ``user_id``."""
        arrays = self.user(user_id).arrays
        if name not in arrays:
            raise ValidationError(f"user {user_id!r} has no array {name!r}; it has {sorted(arrays)}")
        return arrays[name]

    def attribute_values(self, name: str) -> tuple[str, ...]:
        """The distinct values of attribute ``name`` over users that have it, sorted."""
        return tuple(sorted({u.attributes[name] for u in self if name in u.attributes}))

    def users_where(self, **attributes: str) -> list[str]:
        """Ids of the users whose attributes equal all the given values: ``users_where(phone_model="A")``."""
        return [u.user_id for u in self if all(u.attributes.get(k) == v for k, v in attributes.items())]

    def subset(self, user_ids: Iterable[str]) -> FederatedDataset:
        """A dataset of the given users (in the given order), sharing their arrays."""
        return FederatedDataset(self.user(uid) for uid in user_ids)

    def split_by_user(self, test_user_ids: Iterable[str]) -> tuple[FederatedDataset, FederatedDataset]:
        """``(train, test)``: the listed users form ``test`` and all others ``train`` (disjoint)."""
        test_ids = list(dict.fromkeys(test_user_ids))
        for uid in test_ids:
            self.user(uid)
        chosen = set(test_ids)
        return self.subset(u for u in self.user_ids if u not in chosen), self.subset(test_ids)


def choose_test_users(
    dataset: FederatedDataset,
    *,
    per_value: int,
    attribute: str,
    rng: np.random.Generator,
    eligible: Iterable[str] | None = None,
) -> list[str]:
    """A seeded stratified choice of test users: ``per_value`` users for each value of ``attribute``.

    For each value (sorted), ``per_value`` users are drawn without replacement, by ``rng``, from the
    ``eligible`` users (default: all) with that value, taken in insertion order. FDML Sec. VII-B uses 30
    test users per phone model. A value with too few eligible users is a :class:`ConfigError`.
    """
    if isinstance(per_value, bool) or not isinstance(per_value, int) or per_value < 0:
        raise ConfigError(f"per_value must be a non-negative integer, got {per_value!r}")
    allowed = set(dataset.user_ids if eligible is None else eligible)
    chosen: list[str] = []
    for value in dataset.attribute_values(attribute):
        pool = [uid for uid in dataset.users_where(**{attribute: value}) if uid in allowed]
        if len(pool) < per_value:
            raise ConfigError(
                f"{attribute}={value!r} has {len(pool)} eligible users, fewer than the {per_value} "
                "test users asked for; lower the number of test users per value"
            )
        picks = rng.choice(len(pool), size=per_value, replace=False)
        chosen.extend(pool[i] for i in sorted(picks.tolist()))
    return chosen
