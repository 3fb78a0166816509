"""The serving process's parts, built once by bootstrap and shared by every HTTP resource.

A module of its own so that resources import it without importing the app that imports them (no circle).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from fastapi import Request

from skillpool.adapters_store.store import SkillStore
from skillpool.router import Router
from skillpool.runtime.base_model import BaseModel
from skillpool.trainer.service import JobQueue, SkillEventBus

from .config import ServerConfig
from .engines import Engine
from .files import FileStore
from .metrics import Metrics
from .routing import RoutingStage
from .routing_log import RoutingLog
from .skills import SkillPool
from .tokens import Vocabulary


@dataclass
class Components:
    cfg: ServerConfig
    base: BaseModel
    store: SkillStore
    engine: Engine
    router: Router
    pool: SkillPool
    jobs: JobQueue
    bus: SkillEventBus  # skill lifecycle events: what this server publishes and every server follows
    routing: RoutingStage
    metrics: Metrics
    started: float

    @cached_property
    def files(self) -> FileStore:
        """Uploaded training files, in the data dir that servers and workers share."""
        return FileStore(self.cfg.storage.data_dir)

    @cached_property
    def routing_log(self) -> RoutingLog:
        """The `auto` requests routed over the last day, for the console (server.console_api)."""
        return RoutingLog()

    @cached_property
    def vocab(self) -> Vocabulary:
        """The base model's tokenizer as the API shows it: completions' prompts, logprobs' tokens, /tokenize."""
        return Vocabulary(self.base.path)

    def close(self) -> None:
        self.routing.close()
        self.jobs.close()  # a job still training ends (server/stopping.py stopped it already on a signal)
        self.bus.close()
        self.engine.close()


def components(request: Request) -> Components:
    """The app's components, for a handler that is given only its request (an APIRouter's)."""
    c: Components = request.app.state.components
    return c
