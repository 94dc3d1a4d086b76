"""Errors the engine raises for bad input; callers turn them into one clear line, never a traceback."""


class RagfuseError(Exception):
    """Base of every error ragfuse reports to a user as a clear message."""


class ModelError(RagfuseError):
    """An unknown, missing or unsupported model."""


class RequestError(RagfuseError):
    """A request the engine cannot serve (empty prompt, too long, bad sampling parameters)."""
