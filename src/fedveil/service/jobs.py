"""Jobs of the PoliFL service (Sec. 4.2): a third-party application's request
(a global program, a local program, a model from the allow-list with its hyper-parameters, the groups it
asks for) checked against the groups' policies before anything runs, then run through Policile.

**Validation** (:func:`validate`): the request's fields are bounded (:class:`JobRequest`); every group
must exist, have devices and have a policy for the requesting application; both programs must compile
under RestrictedPython; then the job runs *dry* (:func:`fedveil.experiments.polifl.runner.run_strategy` with
``dry=True``): the global program runs in the sandbox, every ``run_fl`` runs the local program on a
stand-in of the devices' data (its structure, no rows) under each group's policy and the ``runFL``
checks, and charges the per-group ledger the epsilon its rounds will cost, so the budget commands and
``return`` meet exactly the refusals the real run would. A job whose program the policies refuse is
stored as ``refused`` with the policy's reason and never trains.

**Time.** A job has one wall-clock budget (the service's ``job_seconds``) that covers everything it
causes: its check and its run, the global program in the sandbox and every call it makes into the
server (each host function checks the deadline before and after its work, each ``run_fl`` round after
the round, and the sandbox stops the program at it, :class:`~fedveil.privacy.sandbox.DeadlineExceeded`).
The check may use at most ``check_seconds`` of it, so that a submission is answered within that; the run
gets what the check left. A job past its budget ends ``failed``, with the reason and an audit event.

**Running** (:class:`JobRunner`): one job at a time on a worker thread, through the same
``run_strategy`` without ``dry``: the devices (simulated here: the service's population, each device
holding its data pair and enforcing its group's policy, :class:`~fedveil.protocols.polifl.PolicyDevices`)
run the local program in the sandbox with time and memory limits, the server's side runs in the
global program's host functions. Progress (round, per-group epsilon) is written after every round; a
cancel request stops the job at the next round. Every finished ``run_fl`` call is on disk in the job's
folder, so a job the service was killed in the middle of is marked ``interrupted`` at the next start and
``resume`` continues it from its last finished stage. A released model is written as safetensors; a
model whose release the policies refuse never leaves the service, and the refusal names the policy.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine

from fedveil.errors import ConfigError, FedveilError
from fedveil.privacy.pairs import PolicyViolation
from fedveil.privacy.policy import budget_of, parse
from fedveil.privacy.sandbox import DeadlineExceeded, SandboxError, compile_program
from fedveil.service import db

__all__ = [
    "KINDS",
    "MODELS",
    "GroupRequest",
    "Hyper",
    "JobRequest",
    "JobRunner",
    "JobState",
    "Population",
    "Refused",
    "ensure_population",
    "population_values",
    "validate",
]

log = logging.getLogger(__name__)

KINDS = ("mpu", "images", "text")
MODELS: dict[str, tuple[str, ...]] = {  # every name here is also in JobRequest.model's Literal
    "mpu": ("engagement",),
    "images": ("lenet", "lenet-sigmoid"),
    "text": ("nextword",),
}
"""The allow-listed models per population: EngagementNet (LSTM) for MPU, the zoo's LeNets for 28 x 28
images, the 2-layer next-word LSTM for text."""

JobState = Literal["queued", "running", "finished", "refused", "failed", "cancelled", "interrupted"]
"""A job's status: waiting, training, done (released or not), refused by the policies before it ran, its
program failed, cancelled by its application, or cut by a service stop (resumable)."""
PROGRAM_CHARS = 64_000
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}$"


class GroupRequest(BaseModel):
    """A group the job asks for, and the DP noise ``sigma`` it will add to each round's sum of clipped
    updates for it (``null``: no DP; the group's policy decides whether that can be released)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(pattern=NAME_PATTERN)
    noise: float | None = Field(default=None, gt=0, le=1e6)


class Hyper(BaseModel):
    """The training's hyper-parameters (PoliFL's FedAvg with DP, Eq. 1 and Alg. 3)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    rounds: int = Field(default=5, ge=1, le=5000, description="rounds per run_fl stage the program asks for")
    clients_per_round: int = Field(default=10, ge=1, le=10_000)
    local_epochs: int = Field(default=1, ge=1, le=50)
    batch_size: int = Field(default=32, ge=1, le=4096)
    lr: float = Field(default=0.1, gt=0, le=100)
    server_lr: float = Field(default=1.0, gt=0, le=100)
    clip_norm: float = Field(default=15.0, gt=0, le=1e6)
    dp_mode: Literal["central", "local"] = "central"
    stop_at_budget: bool = False
    hidden: int = Field(default=32, ge=1, le=1024, description="LSTM width (mpu, text)")


class JobRequest(BaseModel):
    """A third-party application's request (Sec. 4.2): the global program (RestrictedPython source
    defining ``main(model, groups, rounds)``, calling ``run_fl``, ``release``, the budget commands and
    ``epsilon``), the local program (source defining ``prepare(data)``, calling ``get_data``, ``filter``,
    ``in_geofence_cond``; empty: ``get_data`` only), the model and the groups."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(pattern=NAME_PATTERN)
    global_program: str = Field(min_length=1, max_length=PROGRAM_CHARS)
    local_program: str = Field(default="", max_length=PROGRAM_CHARS)
    model: Literal["engagement", "lenet", "lenet-sigmoid", "nextword"] = Field(
        description="allow-listed model; which ones a service accepts depends on its devices' data (MODELS)"
    )
    hyper: Hyper = Field(default_factory=Hyper)
    groups: list[GroupRequest] = Field(min_length=1, max_length=16)


class Refused(FedveilError):
    """A job the service will not run: ``status`` is the HTTP status to answer with (403 for a policy's
    refusal, 422 for a bad request or a program that does not compile or escapes the sandbox, 404/409
    for groups); ``program_failed``: the job's own program failed (the job is then stored as ``failed``,
    not ``refused``)."""

    def __init__(self, message: str, status: int, *, program_failed: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.program_failed = program_failed


@dataclass(frozen=True)
class Population:
    """The devices this service trains on: ``size`` simulated devices of a ``kind`` (``mpu``: the
    SYNTHETIC MPU population; ``images``: Fashion-MNIST when installed, else synthetic; ``text``: Debian's
    license texts), drawn with ``seed``, or (``networked``) device agents holding ``kind`` data that
    connect over the network (:mod:`fedveil.service.network`; ``size`` is then unused). Each device holds
    its own data and enforces its policy on it."""

    kind: str = "mpu"
    size: int = 40
    seed: int = 0
    networked: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"population kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not self.networked and not 4 <= self.size <= 100_000:
            raise ConfigError(f"population size {self.size} must be between 4 and 100000")

    @classmethod
    def parse(cls, text: str) -> Population:
        """``KIND:SIZE`` (e.g. ``mpu:40``)."""
        kind, _, size = text.partition(":")
        if not size.isdigit():
            raise ConfigError(f"population {text!r} is not KIND:SIZE (e.g. mpu:40; kinds {', '.join(KINDS)})")
        return cls(kind, int(size))


def _run_of(
    population: Population,
    request: JobRequest,
    policies: dict[str, str],
    members: dict[str, list[str]] | None,
    program_seconds: float = 10.0,
) -> Any:
    from fedveil.experiments.polifl.runner import GroupSpec, PolifLRun

    h = request.hyper
    specs = tuple(
        GroupSpec(
            g.name,
            policies[g.name],
            fraction=1.0 / len(request.groups),
            noise=g.noise,
            commands=() if request.local_program else ("get_data",),
            program=request.local_program,
        )
        for g in request.groups
    )
    return PolifLRun(
        name=request.name,
        task=population.kind,
        clients=population.size if not population.networked else max(4, 2 * len(request.groups)),
        samples_per_client=100,
        test_samples=500,
        model=request.model if population.kind == "images" else "lenet",
        hidden=h.hidden,
        vocab=500,
        clients_per_round=h.clients_per_round,
        local_epochs=h.local_epochs,
        batch_size=h.batch_size,
        lr=h.lr,
        server_lr=h.server_lr,
        clip_norm=h.clip_norm,
        dp_mode=h.dp_mode,
        groups=specs,
        strategies=("program",),
        rounds=h.rounds,
        stop_at_budget=h.stop_at_budget,
        program=request.global_program,
        program_time_limit=program_seconds,
        eval_every=max(1, h.rounds // 5),
        seed=population.seed,
        threads=1,
    )


def population_values(population: Population) -> dict[str, dict[str, Any]]:
    """Each device's data in the population (deterministic in its seed)."""
    from fedveil.experiments.polifl.runner import build_task

    request = JobRequest(
        name="population",
        global_program="pass",
        model=MODELS[population.kind][0],
        groups=[GroupRequest(name="all")],
    )
    return build_task(_run_of(population, request, {"all": "get_data.runFL.return"}, None)).values


def ensure_population(engine: Engine, population: Population) -> int:
    """Register the population's devices (once; a restart finds them); returns how many were added."""
    with engine.connect() as conn:
        have = {r[0] for r in conn.execute(sa.select(db.devices.c.name))}
    if population.networked:
        return 0
    new = [d for d in sorted(population_values(population)) if d not in have]
    if new:
        with engine.begin() as conn:
            conn.execute(
                db.devices.insert(),
                [{"name": d, "group_id": None, "kind": population.kind, "created_at": db.now()} for d in new],
            )
    return len(new)


def _context(
    engine: Engine, application_id: int, request: JobRequest
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Each requested group's policy for the application and its devices; :class:`Refused` otherwise."""
    names = [g.name for g in request.groups]
    if len(set(names)) != len(names):
        raise Refused(f"groups {names} are named more than once", 422)
    policies: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    with engine.connect() as conn:
        app = conn.execute(
            sa.select(db.applications.c.name).where(db.applications.c.id == application_id)
        ).scalar()
        for name in names:
            gid = conn.execute(sa.select(db.groups.c.id).where(db.groups.c.name == name)).scalar()
            if gid is None:
                raise Refused(f"there is no group {name!r}", 404)
            text = conn.execute(
                sa.select(db.policies.c.text).where(
                    db.policies.c.application_id == application_id, db.policies.c.group_id == gid
                )
            ).scalar()
            if text is None:
                raise Refused(
                    f"application {app!r} has no policy for group {name!r}: its data may not be used", 403
                )
            policies[name] = text
            members[name] = sorted(
                r[0] for r in conn.execute(sa.select(db.devices.c.name).where(db.devices.c.group_id == gid))
            )
            if len(members[name]) < 1:
                raise Refused(f"group {name!r} has no devices", 409)
    return policies, members


def validate(
    engine: Engine,
    population: Population,
    application_id: int,
    request: JobRequest,
    *,
    program_seconds: float = 10.0,
    seconds: float | None = None,
) -> dict[str, Any]:
    """Check ``request`` against the policies without training (module docstring); returns the plan
    (stages, planned rounds, predicted epsilon per group, and the ``seconds`` the check took);
    :class:`Refused` names what refuses it. ``program_seconds``: the global program's own running time
    limit; ``seconds``: the check's wall-clock budget, everything it causes counted (past it, a
    :class:`Refused` that fails the program)."""
    from fedveil.experiments.polifl.runner import build_task, network_task, run_strategy

    started = time.monotonic()
    deadline = None if seconds is None else started + seconds

    if request.model not in MODELS[population.kind]:
        raise Refused(
            f"model {request.model!r} is not allowed on this service's {population.kind} devices; "
            f"allowed: {', '.join(MODELS[population.kind])}",
            422,
        )
    policies, members = _context(engine, application_id, request)
    for text, what in ((request.global_program, "global"), (request.local_program, "local")):
        if text:
            try:
                compile_program(text, f"{request.name}/{what}")
            except SandboxError as exc:
                raise Refused(str(exc), 422, program_failed=True) from None
    run = _run_of(population, request, policies, members, program_seconds)
    try:
        task = network_task(run, members) if population.networked else build_task(run, members)
    except PolicyViolation as exc:
        raise Refused(f"the policies refuse this job before it runs: {exc}", 403) from None
    with tempfile.TemporaryDirectory(prefix="fedveil-dry-") as tmp:
        try:
            summary = run_strategy(
                run, task, "program", Path(tmp), progress=False, dry=True, deadline=deadline
            )
        except DeadlineExceeded as exc:
            raise Refused(
                f"checking the job took longer than its {seconds} s: {exc}; make the global program "
                "finish (a loop around run_fl or release that never ends is stopped here)",
                422,
                program_failed=True,
            ) from None
        except FedveilError:
            raise
        except Exception as exc:  # the server's own failure on this job: the job fails, the service goes on
            log.exception("checking job %r crashed", request.name)
            raise Refused(
                f"checking the job failed on the server's side ({type(exc).__name__}); its programs or "
                "settings ask for more than the server can do",
                422,
                program_failed=True,
            ) from None
    if summary["refusals"]:
        raise Refused(f"the policies refuse this job before it runs: {summary['refusals'][0]}", 403)
    if not summary["released"]:
        reason = summary["stopped"] or "the program released no model"
        raise Refused(f"the job cannot run: {reason}", 422, program_failed=True)
    return {
        "stages": [
            {
                "groups": s["groups"],
                "rounds": s["rounds"],
                "noise_std": s["noise_std"],
                "epsilon": s.get("epsilon"),
            }
            for s in summary["stages"]
        ],
        "rounds": summary["rounds"],
        "epsilon": {g: r["epsilon"] for g, r in summary["privacy"].items()},
        "budgets": {g: budget_of(parse(policies[g])) for g in policies},
        "seconds": round(time.monotonic() - started, 3),
    }


class Cancelled(Exception):
    """Raised from the round hook to stop a job the application cancelled (deliberately not a
    FedveilError: it must stop the run, not reach the program as a refusal)."""


def _set(engine: Engine, job_id: int, **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(db.jobs.update().where(db.jobs.c.id == job_id).values(updated_at=db.now(), **values))


def audit(engine: Engine, actor: str, action: str, detail: str) -> None:
    """Append to the audit log (never a secret)."""
    with engine.begin() as conn:
        conn.execute(
            db.audit.insert().values(at=db.now(), actor=actor[:200], action=action[:80], detail=detail[:4000])
        )


class JobRunner:
    """Runs queued jobs one at a time on a daemon thread (module docstring); ``folder`` holds each job's
    files (``folder/<id>/``); ``program_seconds`` as in :func:`validate`; ``job_seconds``: each job's
    wall-clock budget (module docstring), less what its check and any earlier run of it used;
    ``devices``: the service's :class:`~fedveil.service.network.DeviceNetwork` when its devices are
    networked agents."""

    def __init__(
        self,
        engine: Engine,
        population: Population,
        folder: Path,
        *,
        program_seconds: float = 10.0,
        job_seconds: float = 3600.0,
        devices: Any = None,
    ) -> None:
        self.program_seconds = program_seconds
        self.job_seconds = job_seconds
        self.devices = devices
        self.engine = engine
        self.population = population
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.current: int | None = None

    def recover(self) -> list[int]:
        """At start-up: jobs left ``running`` by a killed service become ``interrupted``."""
        with self.engine.begin() as conn:
            ids = [r[0] for r in conn.execute(sa.select(db.jobs.c.id).where(db.jobs.c.status == "running"))]
            if ids:
                conn.execute(
                    db.jobs.update()
                    .where(db.jobs.c.id.in_(ids))
                    .values(status="interrupted", updated_at=db.now())
                )
        for i in ids:
            log.warning("job %d was running when the service stopped: marked interrupted (resume it)", i)
        return ids

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._loop, name="fedveil-jobs", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to stop after its current round, and wait a little."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wake(self) -> None:
        """A job was queued."""
        self._wake.set()

    def _next(self) -> int | None:
        with self.engine.begin() as conn:
            row = conn.execute(
                sa.select(db.jobs.c.id).where(db.jobs.c.status == "queued").order_by(db.jobs.c.id).limit(1)
            ).first()
            if row is None:
                return None
            conn.execute(
                db.jobs.update().where(db.jobs.c.id == row[0]).values(status="running", updated_at=db.now())
            )
            return int(row[0])

    def _loop(self) -> None:
        import torch

        torch.set_num_threads(1)
        while not self._stop.is_set():
            job = self._next()
            if job is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            self.current = job
            try:
                self.run(job)
            finally:
                self.current = None

    def run(self, job_id: int) -> None:
        """Run (or resume) one job to its end and record the outcome."""
        from fedveil.experiments.plots import summarise_timings_by_phase
        from fedveil.experiments.polifl.runner import build_task, run_strategy

        with self.engine.connect() as conn:
            row = conn.execute(sa.select(db.jobs).where(db.jobs.c.id == job_id)).mappings().one()
        request = JobRequest.model_validate_json(row["request"])
        out = self.folder / str(job_id)
        last = [0.0]
        earlier = json.loads(row["progress"] or row["plan"] or "{}").get("seconds", 0.0)
        started = time.monotonic()
        deadline = started + self.job_seconds - earlier

        def on_round(line: dict[str, Any], epsilon: Any) -> None:
            with self.engine.connect() as conn:
                cancel = conn.execute(sa.select(db.jobs.c.cancel).where(db.jobs.c.id == job_id)).scalar()
            if cancel or self._stop.is_set():
                raise Cancelled("cancelled" if cancel else "service stopping")
            progress = {"round": line["round"], "stage": line["stage"], "loss": line.get("loss")}
            progress["seconds"] = round(earlier + time.monotonic() - started, 3)
            if time.monotonic() - last[0] > 1.0:
                progress["epsilon"] = epsilon()
                last[0] = time.monotonic()
            _set(self.engine, job_id, progress=json.dumps(progress, default=float))

        timings: list[Any] = []
        try:
            policies, members = _context(self.engine, int(row["application_id"]), request)
            run = _run_of(self.population, request, policies, members, self.program_seconds)
            if self.devices is None:
                task = build_task(run, members)
                summary = run_strategy(
                    run, task, "program", out, progress=False, on_round=on_round, deadline=deadline
                )
            else:
                task, summary = self._run_networked(run, members, out, on_round, timings, deadline)
        except Cancelled as exc:
            status = "cancelled" if str(exc) == "cancelled" else "interrupted"
            _set(self.engine, job_id, status=status)
            log.info("job %d %s", job_id, status)
            return
        except DeadlineExceeded as exc:
            reason = f"the job ran past its time budget of {self.job_seconds} s: {exc}"
            _set(self.engine, job_id, status="failed", outcome=json.dumps({"error": reason}))
            audit(self.engine, f"job {job_id}", "job failed", reason)
            log.warning("job %d failed: %s", job_id, reason)
            return
        except FedveilError as exc:
            _set(self.engine, job_id, status="failed", outcome=json.dumps({"error": str(exc)}))
            audit(self.engine, f"job {job_id}", "job failed", str(exc))
            log.warning("job %d failed: %s", job_id, exc)
            return
        except Exception as exc:  # a bug must not kill the worker: the job fails, the service goes on
            log.exception("job %d crashed", job_id)
            _set(
                self.engine,
                job_id,
                status="failed",
                outcome=json.dumps({"error": f"{type(exc).__name__}: {exc}"}),
            )
            audit(self.engine, f"job {job_id}", "job failed", f"the server failed: {type(exc).__name__}")
            return
        outcome: dict[str, Any] = {
            "timings_ms": summarise_timings_by_phase(timings) if timings else None,
            "released": summary["released"],
            "reason": summary["stopped"],
            "rounds": summary["rounds"],
            "metric": task.metric,
            "final": summary["final"],
            "epsilon": {g: r["epsilon"] for g, r in summary["privacy"].items()},
            "stages": summary["stages"],
        }
        if summary["released"]:
            self._export(task.flat, out)
        else:
            audit(self.engine, f"job {job_id}", "model not released", str(summary["stopped"]))
        _set(
            self.engine,
            job_id,
            status="finished",
            outcome=json.dumps(outcome, default=float),
            progress=json.dumps(
                {"round": summary["rounds"], "stage": "", "epsilon": outcome["epsilon"]}, default=float
            ),
        )
        log.info("job %d finished (released: %s)", job_id, summary["released"])

    def _run_networked(
        self,
        run: Any,
        members: dict[str, list[str]],
        out: Path,
        on_round: Any,
        timings: list[Any],
        deadline: float,
    ) -> tuple[Any, dict[str, Any]]:
        """A job's task and its stages' summary over the device port, with each group's connected
        members."""
        from fedveil.experiments.polifl.runner import network_task, run_strategy

        assert self.devices is not None
        connected = set(self.devices.connected())
        present = {g: [d for d in ds if d in connected] for g, ds in members.items()}
        absent = sorted(g for g, ds in present.items() if not ds)
        if absent:
            raise ConfigError(f"no device of group(s) {', '.join(absent)} is connected: start their agents")
        start = len(self.devices.runtime.stats().timings)
        task = network_task(run, present)
        try:
            return task, run_strategy(
                run,
                task,
                "program",
                out,
                progress=False,
                on_round=on_round,
                network=self.devices.network(),
                deadline=deadline,
            )
        finally:
            timings.extend(self.devices.timings_since(start))

    @staticmethod
    def _export(model: Any, out: Path) -> None:
        import numpy as np

        from fedveil.models.weights import save_weights

        with np.load(out / "program" / "weights.npz", allow_pickle=False) as z:
            weights = np.asarray(z["weights"], dtype=np.float32)
        save_weights(model.load_into_module(weights), out / "model.safetensors")

    def model_path(self, job_id: int) -> Path:
        """Where a released job's model is."""
        return self.folder / str(job_id) / "model.safetensors"
