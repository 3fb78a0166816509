"""One intake for training jobs: `/tasks` and the fine-tuning API each map their wire fields onto a
`JobRequest`, and the checks, the job record and the skill name's reservation are made here, once. Errors name
the caller's own fields (`Fields`): `method` on /tasks is `metadata.method` on /v1/fine_tuning/jobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from skillpool.adapters_store.names import InvalidSkillName, validate_skill_name
from skillpool.trainer.config import ConfigError, TrainConfig
from skillpool.trainer.service import TERMINAL, Job, JobStatus, QueueFull, Room, method_error, new_job_id

from .auth import Principal, denial
from .errors import APIError

if TYPE_CHECKING:
    from .components import Components


@dataclass(frozen=True)
class Fields:
    """The request fields an endpoint's errors point at."""

    method: str
    force: str
    name: str
    config: str  # a hyperparameter's param is this, a dot and its name
    method_code: str = "invalid_value"  # the error codes of a bad method and a bad config
    config_code: str = "invalid_value"


TASKS = Fields("method", "force", "name", "config", "invalid_method", "invalid_config")
FINE_TUNING = Fields("metadata.method", "metadata.force", "suffix", "metadata.config")
IMPORT = Fields("method", "force", "name", "config")  # an import takes no method nor config: it trains nothing
LOAD_LORA = Fields("method", "force", "lora_name", "config")  # vLLM's /v1/load_lora_adapter


@dataclass
class JobRequest:
    """What either endpoint asks for, checked: a job for `skill` trained by `method` with `config`."""

    skill: str
    method: str
    force: bool
    config: TrainConfig
    owner: str | None
    new_version: bool = False
    examples: int = 0
    fine_tuning: dict[str, Any] | None = None
    id: str = field(default_factory=new_job_id)

    def job(self) -> Job:
        return Job(
            id=self.id,
            skill=self.skill,
            method=self.method,
            config=self.config.to_dict(),
            status=JobStatus.VALIDATING,
            examples=self.examples,
            force=self.force,
            owner=self.owner,
            fine_tuning=self.fine_tuning,
        )


def check_name(c: Components, raw: object, f: Fields) -> str:
    """The skill name a request gives in field f.name: present, a valid name, not the base model's id."""
    if not isinstance(raw, str):
        raise APIError(400, f"missing field '{f.name}' (the skill name)", f.name, "missing_name")
    try:
        name = validate_skill_name(raw)
    except InvalidSkillName as e:
        raise APIError(400, str(e), f.name, "invalid_name") from None
    if name == c.base.model_id:
        raise APIError(400, f"skill name {name!r} is the base model's id", f.name, "invalid_name")
    return name


def check_method(c: Components, method: object, f: Fields) -> str:
    if not isinstance(method, str) or (problem := method_error(method, c.router.settings.mode)):
        raise APIError(400, problem or "method must be a string", f.method, f.method_code)
    return method


def check_force(caller: Principal, force: bool, f: Fields) -> None:
    if force and (why := denial(caller, "admin")) is not None:
        status, _, code = why
        raise APIError(status, f"{f.force} (register past the quality gate) needs a key with role admin", f.force, code)


def flag(raw: object, field: str) -> bool:
    """A multipart boolean: true/false/1/0, absent is false."""
    value = raw or "false"
    if not isinstance(value, str) or value.lower() not in ("true", "false", "1", "0"):
        raise APIError(400, f"{field} must be true or false, got {value!r}", field, f"invalid_{field}")
    return value.lower() in ("true", "1")


def exists_error(name: str, version: int, f: Fields, what: str = "train") -> APIError:
    """409 skill_exists: a name that exists gets a new version only when asked (never overwrite a skill by accident)."""
    return APIError(
        409,
        f"skill {name!r} exists (version {version}); send new_version=true to {what} version {version + 1}, or "
        "choose another name",
        f.name,
        "skill_exists",
    )


def creator(c: Components, name: str) -> tuple[bool, str | None]:
    """(whether skill `name` exists or is being made, the name of the key that created it). The creator is the
    owner of its first stored version, or before one is stored, of its oldest unfinished job."""
    versions = c.store.versions(name)
    if versions:
        return True, versions[0].meta.get("owner")
    pending = [j for j in c.jobs.list() if j.skill == name and j.status not in TERMINAL]
    return (True, min(pending, key=lambda j: j.created_at).owner) if pending else (False, None)


def check_owner(c: Components, caller: Principal, name: str, f: Fields, what: str = "a new version") -> None:
    """A train key extends (or exports) only the skills it created; the admin any (runs the store and queue reads:
    call it off the event loop)."""
    if caller.can("admin"):
        return
    found, made_by = creator(c, name)
    if found and made_by != caller.name:
        raise APIError(
            403,
            f"skill {name!r} was created by another key: {what} needs that key or the admin",
            f.name,
            "permission_denied",
        )


def config_values(values: object, f: Fields) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise APIError(400, f"{f.config} must be a JSON object of hyperparameters", f.config, f.config_code)
    return values


def train_config(
    values: object, f: Fields, caller: Principal, param: Callable[[str], str] | None = None
) -> TrainConfig:
    """TrainConfig from the request's values; a bad one names `param(name)`, by default f.config + its name. A
    value that loosens the quality gate needs the role that `force` needs (403 naming it, as `force` is)."""
    where = param or (lambda name: f"{f.config}.{name}")
    try:
        cfg = TrainConfig.from_dict(config_values(values, f))
    except ConfigError as e:  # a check across fields names the config itself, not a field of it
        field = f.config if e.param == "config" else where(e.param.removeprefix("config."))
        raise APIError(400, str(e), field, f.config_code) from None
    loosened = cfg.gate_loosened()
    if loosened and (why := denial(caller, "admin")) is not None:
        status, _, code = why
        field, default = where(loosened[0]), getattr(TrainConfig(), loosened[0])
        raise APIError(
            status,
            f"{field} looser than the quality gate's default ({default}) needs a key with role admin, as {f.force} does",
            field,
            code,
        )
    return cfg


RETRY_JOBS_S = 30  # a full job queue's Retry-After: jobs take minutes, a place frees when one ends


def room(c: Components) -> Room:
    """The places the queue has for jobs that have not ended: --max-pending-jobs, of one key --max-pending-jobs-per-key."""
    return Room(c.cfg.training.max_pending_jobs, c.cfg.training.max_pending_jobs_per_key)


def too_many_jobs(e: QueueFull) -> APIError:
    whose = "this key's share of the queue is full" if e.per_key else "the training queue is full"
    return APIError(
        429, f"{e}: {whose}; retry once a job has ended", None, "too_many_jobs", {"Retry-After": str(RETRY_JOBS_S)}
    )


def hold_name(c: Components, job: Job, f: Fields, new_version: bool, record: Callable[[], None]) -> None:
    """Run `record` (queue or store the job, admitted to `room(c)`) holding the job's skill name
    (trainer.jobs.reservations); a queue with no room for it is a 429 too_many_jobs. Of two jobs
    for one new name, one gets it and the other a 409 skill_exists; a new version while another job for that
    skill is queued or running is a 409 skill_busy. A job that cannot be recorded (a 507) frees the name."""
    if c.jobs.reserve(job) is not None:
        if new_version:
            raise APIError(
                409,
                f"skill {job.skill!r} is being trained by another job (queued or running): send the new version "
                "again once that job has ended",
                f.name,
                "skill_busy",
            )
        raise APIError(
            409, f"skill {job.skill!r} is being created by another job: choose another name", f.name, "skill_exists"
        )
    try:
        record()
    except QueueFull as e:  # the queue admits the job, or not, in the step that records it
        c.jobs.release(job)
        raise too_many_jobs(e) from None
    except BaseException:
        c.jobs.release(job)
        raise
