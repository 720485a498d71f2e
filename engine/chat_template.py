"""Chat templates: render a checkpoint's Jinja2 `chat_template` the way transformers' `apply_chat_template` does.

Same environment as transformers: a sandboxed Jinja2 with trim_blocks/lstrip_blocks, the `loopcontrols`
extension, a `tojson` filter that does not HTML-escape, and the `raise_exception` / `strftime_now` globals.
The template sees `messages`, `add_generation_prompt`, `tools=None`, `documents=None` and the special-token
strings (`bos_token`, `eos_token`, `unk_token`, `pad_token`, whichever the tokenizer has).

A checkpoint without a template gets FALLBACK_TEMPLATE: one "System: …" / "User: …" / "Assistant: …" line
per message, then a bare "Assistant:" when a reply is wanted. Its text has no BOS; Tokenizer.encode_chat
puts the BOS id in front for models that add one (as encode() does for plain text).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant")

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def validate_messages(messages) -> None:
    """Raise ValueError unless `messages` is a non-empty list of {"role": system|user|assistant, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {type(messages).__name__} {messages!r:.80}.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}.")
        if message.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {', '.join(ROLES)}, got {message.get('role')!r}.")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(message.get('content')).__name__}.")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes (<, >, &, '); chat templates want plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool, special_tokens: dict[str, str]) -> str:
    """Render `source` for `messages`; `special_tokens` maps names like "bos_token" to their strings."""
    validate_messages(messages)
    try:
        template = compile_template(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"The chat template is not valid Jinja2 (line {e.lineno}): {e.message}") from e
    try:
        return template.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.exceptions.TemplateError as e:  # e.g. raise_exception("roles must alternate ...")
        raise ValueError(f"The chat template rejected these messages: {e}") from e
