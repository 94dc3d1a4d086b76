"""Rendering a chat with the checkpoint's own template, never a traceback: a template that refuses a
system message gets it folded into the first user message. Its own module (no torch) so the vLLM
connector and the prompt builders use the same rendering as the engine."""

from __future__ import annotations

from typing import Any

from .errors import RequestError

SYSTEM_FOLD_SEPARATOR = "\n\n"  # between a folded system message and the user's text


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template(messages, ...)`` (``kwargs`` passed on), with what it refuses
    reported as a RequestError, never a traceback.

    Some templates refuse a system message (Mistral v0.1/v0.2, Gemma: "only user and assistant roles
    are supported"); those models' own docs advise putting the system text at the start of the first
    user message, which is what a refused chat that opens with one gets (``fold_system_message``). The
    system text is then no longer a template prefix of its own: callers that serve it apart (relay)
    check that its rendering is a token prefix of the chat's, as they must anyway.

    ``continue_final_message``: the last message is left open (no end-of-turn tokens after its text)
    for the model to continue ("assistant prefill"). transformers does the cutting, from where the
    template put the message's text, so no template's end-of-turn markup has to be known here; it
    refuses (ValueError) a template that rewrites the message's text, and a generation prompt asked
    for too.
    """
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template: send the whole prompt as plain text (--raw)")
    options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
               **kwargs}
    try:
        return _apply(tokenizer, messages, options)
    except TemplateError as exc:
        folded = fold_system_message(messages)
        if folded is None:
            raise RequestError(f"the model's chat template refused the chat: {exc}") from exc
    try:
        return _apply(tokenizer, folded, options)
    except TemplateError as exc:
        raise RequestError(f"the model's chat template refused the chat: {exc}") from exc


def _apply(tokenizer: Any, messages: list[dict[str, str]], options: dict[str, Any]) -> Any:
    """One ``apply_chat_template`` call; a final message it cannot leave open is the request's fault.
    transformers' refusal goes on after its first line with the whole rendered chat, which the
    client sent and a one-line error need not echo back."""
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except ValueError as exc:
        if not options["continue_final_message"]:
            raise
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RequestError(f"the model's chat template cannot continue the final message: {why}") from exc


def fold_system_message(messages: list[dict[str, str]]) -> list[dict[str, str]] | None:
    """The chat with its leading system message put at the start of the first user message (a user
    message of its own where none follows it); None if the chat opens with no system message."""
    if not messages or messages[0]["role"] != "system":
        return None
    system, rest = messages[0]["content"], messages[1:]
    if rest and rest[0]["role"] == "user":
        return [{**rest[0], "content": f"{system}{SYSTEM_FOLD_SEPARATOR}{rest[0]['content']}"}, *rest[1:]]
    return [{"role": "user", "content": system}, *rest]
