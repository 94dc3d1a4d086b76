"""Errors the engine raises for bad input; callers turn them into one clear line, never a traceback."""


class RagfuseError(Exception):
    """Base of every error ragfuse reports to a user as a clear message."""


class ModelError(RagfuseError):
    """An unknown, missing or unsupported model."""


class RequestError(RagfuseError):
    """A request the engine cannot serve (empty prompt, too long, bad sampling parameters)."""


class CacheFullError(RequestError):
    """The KV cache has no room for a request now: a passing state, not a bad request. Blocks come
    back as running requests finish, so a caller with other requests in flight may retry later."""


class EngineStopped(RequestError):
    """The engine's loop was stopped before or while the request ran (a server shutting down): not
    the request's fault, so a server answers 503 (try again, elsewhere or after the restart), not 400."""
