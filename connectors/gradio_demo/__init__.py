"""``ragfuse demo``: a Gradio page over a ragfuse store (see ``app`` for the page, ``backend`` for
what it does)."""

from .backend import DemoBackend, Turn

__all__ = ["DemoBackend", "Turn"]
