"""What every tab shares: the engine, its client, the store, who the browser is (its signed owner
cookie) and what it may do (the quota), validation."""
from __future__ import annotations

from dataclasses import dataclass, field

from laneplay.app.client import EngineClient
from laneplay.app.jobs import JobManager
from laneplay.app.owners import OwnerKeys
from laneplay.app.quota import Quota, address_of
from laneplay.app.supervisor import Engine
from laneplay.storage import Store

# Input bounds of the UI (the engine and storage check again).
MAX_CODE_CHARS = 64 * 1024
MAX_INSTRUCTION_CHARS = 16 * 1024
MAX_TOKENS = 4096
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_SEED = 2**63 - 1
MAX_TOP_K = 1000


@dataclass
class AppContext:
    engine: Engine
    store: Store
    jobs: JobManager | None = None  # pass@N runs; made from the engine and store when not given
    single_ms_per_token: float | None = None  # the engine's decode step at batch 1, as the app last measured it
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


class InputError(ValueError):
    """Bad input from the page: shown in #error; nothing is stored or sent."""


def parse_stops(text: str | None) -> list[str]:
    """Stop strings, one per line (escapes \\n and \\t allowed)."""
    if not text:
        return []
    stops = []
    for line in str(text).splitlines():
        if not line:
            continue
        s = line.replace("\\n", "\n").replace("\\t", "\t")
        if len(s) > MAX_STOP_CHARS:
            raise InputError(f"A stop string is {len(s)} characters long; the limit is {MAX_STOP_CHARS}.")
        stops.append(s)
    if len(stops) > MAX_STOP_STRINGS:
        raise InputError(f"{len(stops)} stop strings given; at most {MAX_STOP_STRINGS} are allowed.")
    return stops


def sampling(temperature, top_p, top_k, max_tokens, seed, stop_text) -> dict:
    """Checked sampling parameters as the engine API takes them."""
    def number(name, v, lo, hi, integer=False):
        if v is None or v == "":
            raise InputError(f"{name} is empty.")
        try:
            x = float(v)
        except (TypeError, ValueError, OverflowError):
            raise InputError(f"{name} must be a number.") from None
        if x != x or not lo <= x <= hi:
            raise InputError(f"{name} must be between {lo} and {hi} (got {v}).")
        if integer:
            if x != int(x):
                raise InputError(f"{name} must be a whole number (got {v}).")
            return int(x)
        return x

    out = {"temperature": number("Temperature", temperature, 0.0, 2.0),
           "top_p": number("Top-p", top_p, 0.0, 1.0),
           "top_k": number("Top-k", top_k if top_k not in (None, "") else 0, 0, MAX_TOP_K, integer=True),
           "max_tokens": number("Max tokens", max_tokens, 1, MAX_TOKENS, integer=True)}
    if out["top_p"] <= 0:
        raise InputError("Top-p must be greater than 0.")
    if seed not in (None, ""):
        out["seed"] = number("Seed", seed, 0, MAX_SEED, integer=True)
    out["stop"] = parse_stops(stop_text)
    return out


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
