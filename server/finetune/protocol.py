"""Request and response shapes of /v1/files and /v1/fine_tuning/jobs, as the `openai` package types them
(openai.types.FileObject, fine_tuning.FineTuningJob, FineTuningJobEvent, jobs.FineTuningJobCheckpoint)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Auto = Literal["auto"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class Hyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n_epochs: Auto | int | None = Field(default=None, description="epochs; 'auto' is TrainConfig's default")
    batch_size: Auto | int | None = None
    learning_rate_multiplier: Auto | float | None = Field(default=None, description="× TrainConfig's learning_rate")


class Supervised(BaseModel):
    hyperparameters: Hyperparameters | None = None


class Method(BaseModel):
    type: Literal["supervised"]  # dpo and reinforcement need other trainers than ours
    supervised: Supervised | None = None


class FineTuningJobCreate(BaseModel):
    """POST /v1/fine_tuning/jobs. Our own settings ride in `metadata`: method (isolated|kif|sapt), force
    (true|false, admin only) and config (a JSON object of any other TrainConfig field)."""

    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = Field(default=None, max_length=64)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    metadata: dict[str, str] | None = None
    integrations: list[Any] | None = None  # accepted, unused (no W&B here)


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobHyperparameters(BaseModel):
    n_epochs: int | float
    batch_size: int
    learning_rate_multiplier: float


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: JobHyperparameters
    model: str
    organization_id: str = "skillpool"
    result_files: list[str] = Field(default_factory=list)
    seed: int
    status: Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list[Any] | None = None
    metadata: dict[str, str] | None = None
    method: dict[str, Any] | None = None
    skill: str  # ours: the skill this job trains (as /tasks and /v1/models name it)


class FineTuningJobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"] | None = "message"
    data: dict[str, Any] | None = None


class CheckpointMetrics(BaseModel):
    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class FineTuningJobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


def page(items: list[Any], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor pagination over models with an `id`, already in order: the `limit` items after `after`."""
    if after is not None:
        ids = [x.id for x in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "object": "list",
        "data": [x.model_dump() for x in data],
        "has_more": len(items) > limit,
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
    }
