"""Every request field is honoured or refused, never dropped: the README's table against the `openai`
package's field lists and against the server's request parser."""
import re
import typing
from pathlib import Path

import pytest
from openai.types import completion_create_params as completion_types
from openai.types.chat import completion_create_params as chat_types

from laneplay.engine.server import APIError, parse_request

README = Path(__file__).resolve().parents[2] / "README.md"
CHAT = {"messages": [{"role": "user", "content": "x"}]}
PROMPT = {"prompt": "x"}


def table() -> dict[str, tuple[str, str, str]]:
    """field -> (endpoint, what the server does, the test that shows it)."""
    text = README.read_text()
    block = text[text.index("<!-- api-fields -->"):text.index("<!-- /api-fields -->")]
    rows = {}
    for line in block.splitlines()[3:]:
        if line.startswith("| `"):
            field, endpoint, does, test = (c.strip() for c in line.strip("|").split("|"))
            rows[field.strip("`")] = (endpoint, does, test)
    return rows


def openai_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


def verdict(body: dict, chat: bool) -> str | None:
    """None when the parser takes the request, else the field its 400 names."""
    try:
        parse_request(body, chat)
    except APIError as e:
        assert e.status == 400
        return e.param
    return None


def test_the_table_lists_every_field_of_the_openai_reference_and_nothing_the_server_does_not_know():
    rows = table()
    chat = {f for f, (ep, _, _) in rows.items() if ep in ("both", "chat")}
    completions = {f for f, (ep, _, _) in rows.items() if ep in ("both", "completions")}
    assert openai_fields(chat_types) <= chat, openai_fields(chat_types) - chat
    assert openai_fields(completion_types) <= completions, openai_fields(completion_types) - completions
    from laneplay.engine.server import CHAT_FIELDS, COMPLETION_FIELDS

    assert chat == CHAT_FIELDS and completions == COMPLETION_FIELDS
    for field, (_, does, test) in rows.items():
        assert does.split(" ")[0].rstrip(":,") in ("honoured", "accepted", "refused"), field
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (README.parent / "tests" / "engine" / path).read_text(), re.M), test


# A value that asks for what the server does not do, per refused field.
REFUSED = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
           "functions": [{"name": "f"}], "function_call": {"name": "f"}, "response_format": {"type": "json_object"},
           "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
           "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "reasoning_effort": "low",
           "verbosity": "low", "moderation": {"input": {"mode": "block"}}, "suffix": "\n", "best_of": 3}
# ... and one that asks for nothing.
HARMLESS = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "auto",
            "response_format": {"type": "text"}, "modalities": ["text"], "suffix": "", "best_of": 1}


@pytest.mark.parametrize("field", [f for f, (_, does, _) in table().items() if does.startswith("refused")])
def test_refused_fields_are_a_400_naming_them(field):
    chat = table()[field][0] != "completions"
    base = CHAT if chat else PROMPT
    assert verdict({**base, field: REFUSED[field]}, chat) == field
    if field in HARMLESS:
        assert verdict({**base, field: HARMLESS[field]}, chat) is None


ACCEPTED = {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "safety_identifier": "h",
            "prompt_cache_key": "k", "prompt_cache_options": {"ttl": "24h"}, "prompt_cache_retention": "24h",
            "parallel_tool_calls": False}


@pytest.mark.parametrize("field", [f for f, (_, does, _) in table().items() if does.startswith("accepted")])
def test_accepted_fields_change_nothing(field):
    chat = table()[field][0] != "completions"
    base = {**(CHAT if chat else PROMPT), "temperature": 0.5, "seed": 3}
    plain, given = parse_request(base, chat), parse_request({**base, field: ACCEPTED[field]}, chat)
    assert given.params == plain.params and given.prompt == plain.prompt


def test_an_unknown_field_is_a_400_naming_it_and_a_field_of_the_other_endpoint_says_so():
    assert verdict({**PROMPT, "guided_json": {}}, chat=False) == "guided_json"
    try:
        parse_request({**PROMPT, "messages": []}, chat=False)
    except APIError as e:
        assert e.param == "messages" and "chat completions" in e.message
    else:
        raise AssertionError("a chat field on completions was taken")
