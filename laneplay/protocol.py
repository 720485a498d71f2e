"""The words of our own API beyond OpenAI's, defined once for the engine server and its clients.

Beside the modules of the package, importing nothing (no HTTP library either): `engine/server.py` and
`engine/server_cli.py` write with it, `laneplay.api_client` reads with it.

- SSE comments (which OpenAI clients skip) before and between a stream's chunks:
  `: laneplay queued <position>` while the request waits for the engine, `: laneplay running <queue_ms>`
  when the engine takes it (the ms it waited), `: laneplay sharing <k>` when k other requests share its
  decode steps, `: laneplay speculative <choice> <drafted> <accepted> <steps> <tokens> <paused_steps>
  <paused>` while a choice speculates. Any other `: laneplay <word> <args...>` is read the same way (a word
  a newer server sends reaches the client).
- Stage lines on the engine's stderr while it starts: `laneplay-engine-stage: <stage>` (`laneplay serve`
  shows them).
"""
from __future__ import annotations

COMMENT_PREFIX = "laneplay"  # the first word of every SSE comment of ours
QUEUED = "queued"
RUNNING = "running"
SHARING = "sharing"
# `: laneplay speculative <choice> <draft_tokens> <accepted_tokens> <decode_steps> <completion_tokens>
# <paused_steps> <paused>` whenever a speculating choice's counts change (engine/speculative.py; paused: 1
# while "auto" holds its drafts back beside other requests, paused_steps: the steps it did so)
SPECULATIVE = "speculative"

STAGE_PREFIX = "laneplay-engine-stage:"
# The stages the engine reports, in order (the app shows each as its state until the engine is ready).
STAGE_LOADING, STAGE_COMPILING, STAGE_WARMING_UP = "loading", "compiling", "warming up"
STAGES = (STAGE_LOADING, STAGE_COMPILING, STAGE_WARMING_UP)


def sse_comment(word: str, *args) -> str:
    """One SSE comment event of ours: `sse_comment(QUEUED, 3)` -> ": laneplay queued 3\\n\\n"."""
    return ": " + " ".join([COMMENT_PREFIX, word, *map(str, args)]) + "\n\n"


def parse_comment(text: str) -> tuple[str, list[str]] | None:
    """An SSE comment's text (what follows the ':', stripped) -> (word, args), or None when it is not ours."""
    parts = text.split()
    if len(parts) < 2 or parts[0] != COMMENT_PREFIX:
        return None
    return parts[1], parts[2:]


def stage_line(stage: str) -> str:
    return f"{STAGE_PREFIX} {stage}"


def parse_stage(line: str) -> str | None:
    """The stage a line of the engine's output reports, or None when it is not a stage line."""
    return line[len(STAGE_PREFIX):].strip() if line.startswith(STAGE_PREFIX) else None
