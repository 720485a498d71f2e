"""What every tab shares: the engine, its client, the store, who the browser is (its signed owner
cookie) and what it may do (the quota), validation."""
from __future__ import annotations

from dataclasses import dataclass, field

from laneplay.api_client import EngineClient
from laneplay.app.jobs import JobManager
from laneplay.app.owners import OwnerKeys
from laneplay.app.params import InputError, parse_stops, sampling  # noqa: F401 (the tabs import them from here)
from laneplay.app.quota import Quota, address_of
from laneplay.app.supervisor import Engine
from laneplay.storage import Store

# Text bounds of the UI (storage checks again); the sampling bounds are the engine's (app.params).
MAX_CODE_CHARS = 64 * 1024
MAX_INSTRUCTION_CHARS = 16 * 1024


@dataclass
class AppContext:
    engine: Engine
    store: Store
    jobs: JobManager | None = None  # pass@N runs; made from the engine and store when not given
    owners: OwnerKeys = field(default_factory=OwnerKeys)  # signs and reads owner cookies
    quota: Quota = field(default_factory=Quota)

    def __post_init__(self):
        if self.jobs is None:
            self.jobs = JobManager(self.store, self.engine)

    def owner_of(self, request) -> str | None:
        """The browser's owner id from its signed cookie; None for no cookie or one this server did not sign."""
        return self.owners.owner_of(request)

    @staticmethod
    def address_of(request) -> str:
        return address_of(request)

    def client(self) -> EngineClient:
        return EngineClient(self.engine.url, api_key=self.engine.api_key)


def check_texts(code: str | None, instruction: str | None, mode: str) -> tuple[str, str]:
    code, instruction = code or "", instruction or ""
    if len(code) > MAX_CODE_CHARS:
        raise InputError(f"The code is {len(code)} characters long; the limit is {MAX_CODE_CHARS}.")
    if len(instruction) > MAX_INSTRUCTION_CHARS:
        raise InputError(f"The instruction is {len(instruction)} characters long; the limit is {MAX_INSTRUCTION_CHARS}.")
    for name, text in (("code", code), ("instruction", instruction)):
        if "\x00" in text:
            raise InputError(f"The {name} contains a NUL character.")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"The {name} is not valid Unicode.") from None
    if mode == "complete" and not code.strip():
        raise InputError("Complete mode continues the code in the editor, and the editor is empty.")
    if mode == "chat" and not (instruction.strip() or code.strip()):
        raise InputError("Type an instruction (and optionally code for context) first.")
    return code, instruction


def request_body(mode: str, code: str, instruction: str, params: dict, model: str | None) -> tuple[dict, bool]:
    """The engine request for the Playground's two modes: (body, chat?)."""
    body = dict(params)
    if model:
        body["model"] = model
    if mode == "complete":
        return {**body, "prompt": code}, False
    content = instruction.strip()
    if code.strip():
        content = (content + "\n\n" if content else "") + "```python\n" + code.rstrip() + "\n```"
    return {**body, "messages": [{"role": "user", "content": content}]}, True
