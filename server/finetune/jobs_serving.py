"""Fine-tuning jobs on the shared job system: a request becomes a trainer Job (the record /tasks makes), its
files are validated after the response (status `validating_files`), and a Job reads back as OpenAI's
`fine_tuning.job`. Statuses are JobStatus's, spelled as OpenAI spells them."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from skillpool.adapters_store.names import InvalidSkillName, validate_skill_name
from skillpool.trainer.config import DEFAULT_METHOD, TrainConfig
from skillpool.trainer.datasets import DatasetError, parse_jsonl
from skillpool.trainer.service import TERMINAL, Example, Job, JobStatus, describe, new_job_id

from ..auth import Principal
from ..errors import APIError, parse_json
from ..intake import (
    FINE_TUNING,
    JobRequest,
    check_force,
    check_method,
    config_values,
    hold_name,
    room,
    train_config,
)
from .protocol import (
    CheckpointMetrics,
    FineTuningJob,
    FineTuningJobCheckpoint,
    FineTuningJobCreate,
    FineTuningJobEvent,
    Hyperparameters,
    JobError,
    JobHyperparameters,
)

if TYPE_CHECKING:
    from ..components import Components

log = logging.getLogger(__name__)

OPENAI_STATUS = {JobStatus.VALIDATING: "validating_files"}  # every other JobStatus value is OpenAI's already
_SUFFIX = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,38}[a-z0-9])?$")  # + "-<8 hex>" stays a valid skill name
_HYPER = {"n_epochs": "epochs", "batch_size": "batch_size"}  # OpenAI name -> TrainConfig field
_OURS = ("method", "force", "config")  # metadata keys that carry our own settings


def _hyperparameters(req: FineTuningJobCreate) -> tuple[Hyperparameters, str]:
    """The hyperparameters and the request field they came from (top level, or method.supervised)."""
    nested = req.method.supervised.hyperparameters if req.method and req.method.supervised else None
    if req.hyperparameters is not None and nested is not None:
        raise APIError(
            400,
            "give hyperparameters either at the top level or in method.supervised",
            "hyperparameters",
            "invalid_value",
        )
    if nested is not None:
        return nested, "method.supervised.hyperparameters"
    return req.hyperparameters or Hyperparameters(), "hyperparameters"


def openai_config(req: FineTuningJobCreate, extra: dict[str, Any], caller: Principal) -> TrainConfig:
    """TrainConfig from OpenAI's hyperparameters ("auto" or absent: our default) over metadata's config."""
    hp, where = _hyperparameters(req)
    values = dict(extra)
    for name, field in _HYPER.items():
        v = getattr(hp, name)
        if v is not None and v != "auto":
            values[field] = v
    mult = hp.learning_rate_multiplier
    if mult is not None and mult != "auto":
        if mult <= 0:
            raise APIError(
                400, "learning_rate_multiplier must be > 0", f"{where}.learning_rate_multiplier", "invalid_value"
            )
        values["learning_rate"] = float(values.get("learning_rate", TrainConfig.learning_rate)) * mult
    if req.seed is not None:
        values["seed"] = req.seed
    ours = {v: k for k, v in _HYPER.items()} | {"learning_rate": "learning_rate_multiplier"}

    def param(key: str) -> str:  # the request field the value came from
        if key in ours and getattr(hp, ours[key]) not in (None, "auto"):
            return f"{where}.{ours[key]}"
        return "seed" if key == "seed" and req.seed is not None else f"{FINE_TUNING.config}.{key}"

    return train_config(values, FINE_TUNING, caller, param)


def _settings(c: Components, metadata: dict[str, str], caller: Principal) -> tuple[str, bool, dict[str, Any]]:
    """(method, force, config overrides) from metadata."""
    method = check_method(c, metadata.get("method", DEFAULT_METHOD), FINE_TUNING)
    force_raw = metadata.get("force", "false").lower()
    if force_raw not in ("true", "false", "1", "0"):
        raise APIError(
            400, f"metadata.force must be true or false, got {force_raw!r}", "metadata.force", "invalid_value"
        )
    force = force_raw in ("true", "1")
    check_force(caller, force, FINE_TUNING)
    extra = parse_json(
        metadata.get("config") or "{}", "metadata.config", "metadata.config", "invalid_value", constants=True
    )
    return method, force, config_values(extra, FINE_TUNING)


def create_job(c: Components, req: FineTuningJobCreate, caller: Principal) -> tuple[Job, TrainConfig]:
    """Check the request, record the job as `validating_files`; `validate_and_queue` runs next."""
    if req.model not in (c.base.model_id, "base"):
        raise APIError(
            400,
            f"model {req.model!r} cannot be fine-tuned here: the base model is {c.base.model_id!r}",
            "model",
            "model_not_available",
        )
    for param, file_id in (("training_file", req.training_file), ("validation_file", req.validation_file)):
        if file_id is None:
            continue
        f = c.files.get(file_id)
        if f is None:
            raise APIError(400, f"invalid {param}: no such File object: {file_id}", param, "invalid_file")
        if f.purpose != "fine-tune":
            raise APIError(400, f"{param} {file_id} has purpose {f.purpose!r}, not 'fine-tune'", param, "invalid_file")
    if req.suffix is not None and not _SUFFIX.match(req.suffix):
        raise APIError(
            400,
            "suffix: 1-40 lowercase letters, digits, '.', '_' or '-', starting and ending with a letter or digit",
            "suffix",
            "invalid_value",
        )
    metadata = dict(req.metadata or {})
    method, force, extra = _settings(c, metadata, caller)
    cfg = openai_config(req, extra, caller)
    job_id = new_job_id()
    short = job_id[-8:]
    skill = f"{req.suffix or 'ft'}-{short}"
    try:
        validate_skill_name(skill)
    except InvalidSkillName as e:  # the suffix pattern keeps this from happening; say so if it ever does
        raise APIError(400, str(e), "suffix", "invalid_value") from None
    fine_tuning = {
        "model": c.base.model_id,
        "training_file": req.training_file,
        "validation_file": req.validation_file,
        "suffix": req.suffix,
        "metadata": {k: v for k, v in metadata.items()},
        "method": {"type": "supervised"},
        "fine_tuned_model": f"ft:{c.base.model_id}:{req.suffix or ''}:{short}",
    }
    job = JobRequest(skill, method, force, cfg, caller.name, fine_tuning=fine_tuning, id=job_id).job()
    job.log(f"Created fine-tuning job: {job.id}")
    job.log(f"Validating training file: {req.training_file}")
    # the name carries the job's id: held only if that id came twice; a disk that cannot take it is a 507. The job
    # takes its place in the queue now: validating, it counts as pending until it ends
    hold_name(c, job, FINE_TUNING, False, lambda: c.jobs.add(job, room(c)))
    return job, cfg


def _read(c: Components, file_id: str, param: str) -> list[Example]:
    data = c.files.content(file_id)
    if data is None:
        raise DatasetError([])  # deleted since the job was created: reported below
    return parse_jsonl(
        data, c.cfg.training.min_upload_examples if param == "training_file" else 1, c.cfg.training.max_upload_examples
    )


def validate_and_queue(c: Components, job_id: str, cfg: TrainConfig) -> None:
    """Validate the job's files line by line; queue it, or fail it naming the first bad line and field. Runs
    after the response: whatever goes wrong here must end the job, never leave it validating."""
    try:
        _validate_and_queue(c, job_id, cfg)
    except Exception as e:
        log.exception("validating fine-tuning job %s failed", job_id)
        job = c.jobs.get(job_id)
        if job is not None and job.status not in TERMINAL:
            code, message = describe(e, "queueing the job")  # no internal paths in what the user reads
            code = code if code == "insufficient_storage" else "validation_error"
            job.finish(JobStatus.FAILED, f"validation failed: {message}", code)
            c.jobs.update(job)


def _validate_and_queue(c: Components, job_id: str, cfg: TrainConfig) -> None:
    job = c.jobs.get(job_id)
    if job is None or job.status in TERMINAL or job.fine_tuning is None:  # cancelled meanwhile
        return
    examples: list[Example] = []
    held: list[Example] = []
    for param in ("training_file", "validation_file"):
        file_id = job.fine_tuning.get(param)
        if file_id is None:
            continue
        try:
            rows = _read(c, file_id, param)
        except DatasetError as e:
            first = e.errors[0] if e.errors else None
            what = f"{first}" if first else f"file {file_id} was deleted"
            more = f" ({e.total_errors} bad lines in all)" if e.total_errors > 1 else ""
            job.finish(
                JobStatus.FAILED,
                f"The {param.replace('_', ' ')} {file_id} is invalid: {what}{more}",
                f"invalid_{param}",
                param,
            )
            c.jobs.update(job)
            c.metrics.training.job_ended(job)  # as the queues count the jobs they end
            return
        if param == "training_file":
            examples = rows
        else:  # the held-out split the quality gate scores (trainer.skill_trainer.split_examples)
            held = [{**r, "held_out": True} for r in rows]  # type: ignore[typeddict-item]
    job.examples = len(examples)
    examples = examples + held
    current = c.jobs.get(job_id)
    if current is None or current.status in TERMINAL:  # cancelled while we validated
        return
    c.jobs.submit(job, examples, cfg)


def to_openai(job: Job, base_id: str) -> FineTuningJob:
    ft = job.fine_tuning or {}
    cfg = job.config
    epochs = float(cfg.get("epochs", TrainConfig.epochs))
    error = None
    if job.status == JobStatus.FAILED:
        error = JobError(code=job.error_code or "training_failed", message=job.error or "failed", param=job.error_param)
    succeeded = job.status == JobStatus.SUCCEEDED
    eta = (job.progress or {}).get("eta_s")
    return FineTuningJob(
        id=job.id,
        created_at=int(job.created_at),
        error=error,
        fine_tuned_model=(ft.get("fine_tuned_model") or job.skill) if succeeded else None,
        finished_at=int(job.finished_at) if job.finished_at and job.status in TERMINAL else None,
        hyperparameters=JobHyperparameters(
            n_epochs=int(epochs) if epochs.is_integer() else epochs,
            batch_size=int(cfg.get("batch_size", TrainConfig.batch_size)),
            learning_rate_multiplier=float(cfg.get("learning_rate", TrainConfig.learning_rate))
            / TrainConfig.learning_rate,
        ),
        model=ft.get("model") or base_id,
        seed=int(cfg.get("seed", 0)),
        status=OPENAI_STATUS.get(job.status, job.status.value),  # type: ignore[arg-type]  # JobStatus values are OpenAI's
        trained_tokens=int((job.progress or {}).get("tokens") or 0) if succeeded else None,
        training_file=ft.get("training_file") or "",
        validation_file=ft.get("validation_file"),
        estimated_finish=int(job.started_at + eta)
        if job.status == JobStatus.RUNNING and eta and job.started_at
        else None,
        metadata=ft.get("metadata") or None,
        method={"type": "supervised"},
        skill=job.skill,
    )


def events(job: Job) -> list[FineTuningJobEvent]:
    """Newest first, as OpenAI lists them."""
    return [FineTuningJobEvent(**e) for e in reversed(job.events)]


def checkpoints(job: Job) -> list[FineTuningJobCheckpoint]:
    """The stored skill version is the job's one checkpoint (we keep no intermediate ones)."""
    if job.status != JobStatus.SUCCEEDED or job.skill_version is None:
        return []
    p = job.progress or {}
    step = int(p.get("step") or 0)
    model = (job.fine_tuning or {}).get("fine_tuned_model") or job.skill
    return [
        FineTuningJobCheckpoint(
            id=f"ftckpt-{job.id.removeprefix('job-')}-v{job.skill_version}",
            created_at=int(job.finished_at or job.created_at),
            fine_tuned_model_checkpoint=model,
            fine_tuning_job_id=job.id,
            metrics=CheckpointMetrics(step=step, train_loss=p.get("loss")),
            step_number=step,
        )
    ]
