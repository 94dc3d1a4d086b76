"""What every route needs: the backend, the operator's settings and metrics."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .backend import Backend, Sampling
from .errors import APIError
from .metrics import ServerMetrics
from .schemas import SamplingFields
from .settings import ServerSettings


@dataclass
class ServerState:
    backend: Backend
    settings: ServerSettings
    metrics: ServerMetrics
    started: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.model_id:
            raise APIError(404, f"the model {model!r} does not exist (this server serves {self.backend.model_id!r})",
                           param="model", code="model_not_found")

    def sampling(self, body: SamplingFields, max_tokens: int | None, param: str = "max_tokens") -> Sampling:
        """The backend's sampling settings, with the server's token limit applied; ``param`` names the
        option ``max_tokens`` came from, so a refusal points at the option the client sent."""
        limit = self.settings.max_tokens
        if max_tokens is not None and max_tokens > limit:
            raise APIError(400, f"{param} must be at most {limit} on this server, got {max_tokens}", param=param)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        return Sampling(max_tokens=max_tokens, limit=limit, temperature=body.temperature, top_p=body.top_p,
                        seed=body.seed, stop=stop, param=param)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
