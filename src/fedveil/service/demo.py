"""A ready-to-try service: the MPU groups of PoliFL's Table 3 and example programs (``fedveil serve
--demo``, the operator's guide and the tests use them).

- ``gr1`` may be used for ``get_data(data_type="MPU") . runFL . enforce_dp_budget(eps=50) . return``: every
  sensor, DP with a whole-training budget of epsilon 50 (delta 1e-5);
- ``gr2`` only with the microphone and location filtered out first:
  ``get_data(data_type="MPU") . filter(sensors=['mic', 'loc']) . runFL . return``.

:data:`CASCADED` is the cascaded strategy as a global program (most restrictive group first, each stage's
model released before the next fine-tunes it) and :data:`LOCAL` a local program that filters whatever the
device's policy asks it to filter.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fedveil.service import auth, db

__all__ = ["CASCADED", "DEMO_POLICIES", "LOCAL", "seed_demo"]

DEMO_POLICIES = {
    "gr1": 'get_data(data_type="MPU").runFL.enforce_dp_budget(eps=50).return',
    "gr2": "get_data(data_type=\"MPU\").filter(sensors=['mic', 'loc']).runFL.return",
}

CASCADED = """
def main(model, groups, rounds):
    def strictness(g):
        budget = g["budget"] if g["budget"] is not None else 1e300
        return [budget, g["index"]]

    for g in sorted(groups, key=strictness):
        model = release(run_fl(model, [g["name"]], rounds))
    return model
"""

LOCAL = """
def prepare(data):
    data = get_data(data, data_type="MPU")
    if "filter" in str(data.policy):
        data = filter(data, sensors=["mic", "loc"])
    return data
"""


def seed_demo(engine: Engine, application: str = "demo-app") -> str:
    """Create the application (returns its token, shown once), groups ``gr1``/``gr2`` with
    :data:`DEMO_POLICIES`, and split the unassigned devices between them in turn."""
    app_id = auth.create_application(engine, application)
    with engine.begin() as conn:
        gids = []
        for name, text in DEMO_POLICIES.items():
            gid = conn.execute(sa.select(db.groups.c.id).where(db.groups.c.name == name)).scalar()
            if gid is None:
                gid = conn.execute(
                    db.groups.insert().values(name=name, created_at=db.now())
                ).inserted_primary_key[0]
            gids.append(gid)
            conn.execute(
                db.policies.insert().values(
                    application_id=app_id, group_id=gid, text=text, version=1, updated_at=db.now()
                )
            )
        free = [
            r[0]
            for r in conn.execute(
                sa.select(db.devices.c.id).where(db.devices.c.group_id.is_(None)).order_by(db.devices.c.name)
            )
        ]
        for i, dev in enumerate(free):
            conn.execute(
                db.devices.update().where(db.devices.c.id == dev).values(group_id=gids[i % len(gids)])
            )
    return auth.issue_token(engine, app_id)
