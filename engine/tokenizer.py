"""Tokenizers: one interface over sentencepiece models, Hugging Face `tokenizers`, and GGUF vocabularies.

    tok = load_tokenizer("path/to/checkpoint")      # or a .gguf file
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    stream = tok.stream()
    for token_id in generated: print(stream.push(token_id), end="")
    print(stream.flush())

Where the tokenizer comes from (`load_tokenizer`):
  * a `.gguf` file (or a directory holding a single one and no tokenizer files): the vocabulary in its metadata.
    `tokenizer.ggml.model == "gpt2"` is rebuilt as a `tokenizers` byte-level BPE (vocab + merges, the
    pre-tokenizer `tokenizer.ggml.pre` names, control tokens as special tokens, user-defined ones as added
    tokens); `"llama"` is rebuilt as a sentencepiece model from its pieces, scores and types.
  * `tokenizer.json` (preferred when present, as transformers does): loaded with Hugging Face `tokenizers` and
    used as written -- its normalizer / pre-tokenizer decide the spaces after special tokens.
  * `tokenizer.model` only: sentencepiece itself, so plain text encodes exactly like `EncodeAsIds`.
BOS/EOS/PAD and add_bos come from `tokenizer_config.json` / `special_tokens_map.json`, then
`generation_config.json` (its `eos_token_id` may be a list: all of them end generation), then `config.json`.

Behaviour matched (transformers 5.x is the reference, checked in tests/engine/test_tokenizer.py):
  * encode(text) == tok.encode(text); special-token strings in the text (`<|im_end|>`, `<s>`) become single
    ids; encode_chat == apply_chat_template(tokenize=True), i.e. the rendered text with no BOS added on top.
  * decode(ids, skip_special_tokens) == tok.decode(ids, skip_special_tokens=...) (our default skips them,
    transformers' does not); clean_up_tokenization_spaces is not applied (Llama-2 and SmolLM2 ship it off).
  * sentencepiece: the `legacy` flag of tokenizer_config.json (default False, as LlamaTokenizer) decides
    whether text right after a special token gets sentencepiece's dummy-prefix space (legacy) or not;
    GGUF "llama" vocabularies use legacy=False like transformers' GGUF loader (llama.cpp adds the space).
    Where a text starts with whitespace we follow sentencepiece (" x" -> "▁▁x"); transformers' conversion of
    a bare tokenizer.model drops that extra "▁". Invalid byte-fallback runs decode to one U+FFFD per bad
    byte; transformers turns a whole run into U+FFFDs when any byte in it is bad (only differs on broken UTF-8).
  * GGUF "smollm" (and llama.cpp's other digit-splitting types: starcoder, refact, ...) splits digits
    one by one before the GPT-2 byte-level regex, like the model's own tokenizer.json and llama.cpp.
    transformers 5.x does not know "smollm" and uses the GPT-2 regex alone, so the two differ on
    whitespace right before a digit ("x  1": ["x", "ĠĠ", "1"] here, ["x", "Ġ", "Ġ", "1"] there).
  * GGUF files carry no generation_config: eos_ids is the EOS/EOT/EOM ids plus the well-known
    end-of-turn control tokens the vocabulary has (`<|endoftext|>`, `<|im_end|>`, `<|eot_id|>`, ...).

Chat templates are rendered by engine.chat_template (see its docstring for the fallback used when a
checkpoint has none).
"""
from __future__ import annotations

import codecs
import json
import os
import re
import warnings
from pathlib import Path

import sentencepiece as spm
import tokenizers
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers

from laneplay.engine.chat_template import FALLBACK_TEMPLATE, render_chat
from laneplay.engine.gguf_file import GGUFFile

# Undecodable bytes become one U+FFFD each (like the ByteFallback decoder), and decoding stays
# prefix-stable: bytes that decode cleanly never change meaning when more bytes follow.
codecs.register_error("laneplay.per_byte", lambda e: ("\ufffd" * (e.end - e.start), e.end))


class Tokenizer:
    """Text <-> token ids for one model. Built by load_tokenizer / tokenizer_from_gguf."""

    vocab_size: int
    bos_id: int | None
    eos_ids: list[int]          # every id that ends generation
    pad_id: int | None
    add_bos: bool               # encode() prepends BOS by default
    add_eos: bool               # encode() appends EOS by default (rare)
    chat_template: str | None   # Jinja2 source; None -> engine.chat_template.FALLBACK_TEMPLATE
    special_tokens: dict[str, str]  # "bos_token"/"eos_token"/"unk_token"/"pad_token" -> string, as templates see them

    def _setup(self, fields: dict) -> "Tokenizer":
        """Set the common fields above (the loaders work them out from the configs, see _resolve_fields)."""
        self.__dict__.update(fields)
        return self

    # --- backend-specific -------------------------------------------------------------------------------
    def _encode_text(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError

    def _token_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    # --- shared -----------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}.")
        ids = self._encode_text(text)
        if add_special_tokens:
            if self.add_bos and self.bos_id is not None:
                ids = [self.bos_id] + ids
            if self.add_eos and self.eos_ids:
                ids = ids + [self.eos_ids[0]]
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        source = self.chat_template if self.chat_template is not None else FALLBACK_TEMPLATE
        return render_chat(source, messages, add_generation_prompt, self.special_tokens)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # Templates write BOS as text when they want it; adding one here would double it (transformers adds none).
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
        if self.chat_template is None and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids  # the fallback has no BOS in its text: start like encode(text) does
        return ids

    def stream(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in the middle of a text (a leading-space marker is a space, a
        byte token its byte, a special token its name); b"" for an id with no token. Cached."""
        cache = self.__dict__.setdefault("_bytes_of", {})
        if token_id not in cache:
            cache[token_id] = self._token_bytes(token_id)
        return cache[token_id]


class StreamDecoder:
    """Incremental detokenization: push ids one by one, get back only text that can no longer change.

    Each push decodes a short window -- the tokens already shown last time (prefix) plus the new ones --
    and emits what the new tokens add, so work per token stays constant. Text is held back while it ends
    in U+FFFD: the last token stopped inside a UTF-8 character (byte-fallback pieces, partial byte-level
    bytes). Decoding the window from its first token keeps sentencepiece's leading spaces right, since
    the first token loses its dummy-prefix space in both decodes. "".join(pushes) + flush() == decode(ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []  # the window: tokens whose text was emitted last time, then the ones not shown yet
        self.read = 0             # how many of self.ids have been emitted

    def _advance(self, final: bool) -> str:
        shown = self.tokenizer.decode(self.ids[:self.read], self.skip_special_tokens)
        text = self.tokenizer.decode(self.ids, self.skip_special_tokens)
        if not final and (len(text) <= len(shown) or text.endswith("\ufffd")):
            return ""  # nothing visible yet, or a character is still incomplete
        del self.ids[:self.read]  # the new tokens become the next window's prefix
        self.read = len(self.ids)
        return text[len(shown):]

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)


# ------------------------------------------------------------------------------------------------------
# sentencepiece


class SentencePieceTokenizer(Tokenizer):
    """Encodes with sentencepiece itself; decodes like transformers' Llama decoder
    ("▁" -> " ", <0xNN> byte runs -> UTF-8, then one leading space stripped when the model adds a dummy prefix)."""

    def __init__(self, model_proto: bytes, added_tokens: dict[int, tuple[str, bool]] | None = None,
                 legacy: bool = False):
        proto = sp_pb2.ModelProto.FromString(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.dummy_prefix = proto.normalizer_spec.add_dummy_prefix
        # Same model without the dummy prefix: non-legacy text after a special token gets no leading "▁".
        proto.normalizer_spec.add_dummy_prefix = False
        self.sp_bare = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.legacy = legacy

        n = self.sp.get_piece_size()
        self.pieces = [self.sp.id_to_piece(i) for i in range(n)]
        self.texts: list[str | None] = [p.replace("\u2581", " ") for p in self.pieces]
        self.byte_of: list[int | None] = [int(p[3:5], 16) if self.sp.is_byte(i) else None  # "<0xE2>" -> 0xE2
                                          for i, p in enumerate(self.pieces)]
        self.special: dict[int, str] = {i: p for i, p in enumerate(self.pieces)
                                        if self.sp.is_control(i) or self.sp.is_unknown(i)}
        # Added tokens (tokenizer_config added_tokens_decoder) may rename pieces or extend the vocabulary.
        for token_id, (content, is_special) in sorted((added_tokens or {}).items()):
            for table in (self.pieces, self.texts, self.byte_of):
                table.extend([None] * (token_id + 1 - len(table)))  # ids past sentencepiece's own pieces
            self.pieces[token_id], self.texts[token_id], self.byte_of[token_id] = content, content, None
            if is_special:
                self.special[token_id] = content
            else:
                self.special.pop(token_id, None)
        # Strings matched whole in the text before sentencepiece sees it (longest first), as transformers does.
        self.whole = {p: i for i, p in self.special.items() if p}
        self.whole.update({c: i for i, (c, _) in (added_tokens or {}).items() if c})
        alternatives = "|".join(map(re.escape, sorted(self.whole, key=len, reverse=True)))
        self.whole_re = re.compile(f"({alternatives})") if self.whole else None
        self.vocab_size = len(self.texts)

    def token_to_id(self, token: str) -> int | None:
        if token in self.whole:
            return self.whole[token]
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.pieces[i] else i

    def id_to_token(self, token_id: int) -> str | None:
        return self.pieces[token_id] if 0 <= token_id < len(self.pieces) else None

    def _token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size or self.texts[token_id] is None:
            return b""
        b = self.byte_of[token_id]
        return bytes([b]) if b is not None else self.texts[token_id].encode()

    def _encode_text(self, text: str) -> list[int]:
        if self.whole_re is None:
            return self.sp.encode(text)
        ids = []
        # re.split with a group alternates text, special token, text, ...; parts[0] starts the string.
        for k, part in enumerate(self.whole_re.split(text)):
            if k % 2:
                ids.append(self.whole[part])
            elif part:
                ids += (self.sp if self.legacy or k == 0 else self.sp_bare).encode(part)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, run = [], bytearray()
        for i in ids:
            if not 0 <= i < self.vocab_size or self.texts[i] is None:
                raise ValueError(f"Token id {i} is outside this tokenizer's vocabulary of {self.vocab_size}.")
            if self.byte_of[i] is not None:
                run.append(self.byte_of[i])
                continue
            if i in self.special and skip_special_tokens:
                continue  # skipped before byte runs are joined, as in transformers
            if run:
                out.append(run.decode("utf-8", "laneplay.per_byte"))
                run.clear()
            out.append(self.texts[i])
        if run:
            out.append(run.decode("utf-8", "laneplay.per_byte"))
        text = "".join(out)
        return text[1:] if self.dummy_prefix and text.startswith(" ") else text


# ------------------------------------------------------------------------------------------------------
# Hugging Face tokenizers (tokenizer.json, GGUF byte-level BPE)


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (tokenizer.json, or rebuilt from a GGUF).

    BOS/EOS come from our add_bos/add_eos flags, not from its post-processor."""

    def __init__(self, tk: tokenizers.Tokenizer):
        self.tk = tk
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tk.id_to_token(token_id)

    def post_processor_adds(self) -> tuple[bool, bool]:
        """(adds BOS, adds EOS) according to tokenizer.json's post-processor."""
        plain, full = self.tk.encode("a", add_special_tokens=False).ids, self.tk.encode("a").ids
        i = full.index(plain[0]) if plain and plain[0] in full else 0
        return i > 0, len(full) - i > len(plain)

    def _encode_text(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids  # BOS/EOS are added by Tokenizer.encode

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.tk.id_to_token(token_id)
        if piece is None:
            return b""
        if "_byte_of_char" not in self.__dict__:  # byte-level vocabularies spell each byte as one character
            decoder = self.tk.decoder
            level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
            self._byte_of_char = {c: b for b, c in _bytes_to_unicode().items()} if level else None
        table = self._byte_of_char
        if table is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # byte fallback (Llama-style tokenizer.json)
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)


# ------------------------------------------------------------------------------------------------------
# Special tokens and flags from the configs


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _content(token) -> str | None:
    """A special token as configs spell it: a string or an AddedToken dict {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token if isinstance(token, str) else None


def _ids(value) -> list[int]:
    """A config's token id field (an int, a list of them, or missing) as a list."""
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _resolve_fields(tok: Tokenizer, *, tokens: dict[str, str | None], ids: dict[str, list[int]],
                    add_bos: bool, add_eos: bool, chat_template: str | None, extra_eos=()) -> dict:
    """The common Tokenizer fields: special tokens named by string (tokenizer config) win over ids
    (generation_config / config.json / GGUF); every EOS id found ends generation."""
    def first_id(name):
        token_id = tok.token_to_id(tokens[name]) if tokens.get(name) else None
        return token_id if token_id is not None else next(iter(ids.get(name, [])), None)

    bos_id, eos_id, pad_id, unk_id = (first_id(n) for n in ("bos", "eos", "pad", "unk"))
    eos_ids = list(dict.fromkeys([*([eos_id] if eos_id is not None else []), *ids.get("eos", []), *extra_eos]))
    special_tokens = {f"{n}_token": tok.id_to_token(i) for n, i in
                      (("bos", bos_id), ("eos", eos_id), ("unk", unk_id), ("pad", pad_id)) if i is not None}
    return dict(bos_id=bos_id, eos_ids=eos_ids, pad_id=pad_id, add_bos=bool(add_bos), add_eos=bool(add_eos),
                chat_template=chat_template, special_tokens=special_tokens)


def _chat_template(directory: Path, tokenizer_config: dict) -> str | None:
    if (directory / "chat_template.jinja").is_file():  # newer checkpoints keep it in its own file
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory, or of a .gguf file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return tokenizer_from_gguf(path)
    if not path.is_dir():
        raise FileNotFoundError(f"No tokenizer at {path}: give a checkpoint directory or a .gguf file.")

    tokenizer_config = _read_json(path / "tokenizer_config.json")
    special_map = _read_json(path / "special_tokens_map.json")
    generation_config = _read_json(path / "generation_config.json")
    model_config = _read_json(path / "config.json")
    tokens = {n: _content(tokenizer_config.get(f"{n}_token", special_map.get(f"{n}_token")))
              for n in ("bos", "eos", "pad", "unk")}
    ids = {n: _ids(generation_config.get(f"{n}_token_id")) or _ids(model_config.get(f"{n}_token_id"))
           for n in ("bos", "eos", "pad")}
    template = _chat_template(path, tokenizer_config)

    if (path / "tokenizer.json").is_file():
        tok = HFTokenizer(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")))
        adds_bos, adds_eos = tok.post_processor_adds()
        return tok._setup(_resolve_fields(tok, tokens=tokens, ids=ids, chat_template=template,
                                          add_bos=tokenizer_config.get("add_bos_token", adds_bos),
                                          add_eos=tokenizer_config.get("add_eos_token", adds_eos)))

    if (path / "tokenizer.model").is_file():
        added = {int(i): (_content(t), t.get("special", True) if isinstance(t, dict) else True)
                 for i, t in tokenizer_config.get("added_tokens_decoder", {}).items()}
        tok = SentencePieceTokenizer((path / "tokenizer.model").read_bytes(), added,
                                     legacy=bool(tokenizer_config.get("legacy", False)))  # transformers' default
        sp = tok.sp
        sp_tokens = {"bos": sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None,
                     "eos": sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None,
                     "unk": sp.id_to_piece(sp.unk_id())}
        return tok._setup(_resolve_fields(tok, tokens={n: tokens[n] or sp_tokens.get(n) for n in tokens}, ids=ids,
                                          chat_template=template, add_bos=tokenizer_config.get("add_bos_token", True),
                                          add_eos=tokenizer_config.get("add_eos_token", False)))

    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return tokenizer_from_gguf(ggufs[0])
    raise FileNotFoundError(f"No tokenizer in {path}: looked for tokenizer.json, tokenizer.model "
                            "or a single .gguf file.")


# ------------------------------------------------------------------------------------------------------
# GGUF

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> how the model's own tokenizer.json splits text.
# Digits one by one (\p{N}), then the GPT-2 regex:
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_LIKE = {None, "default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# GGUF has no generation_config; these control tokens end a turn in the chat formats that use them.
_END_OF_TURN = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
                "<end_of_turn>")
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (same numbering as sentencepiece)


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in _DIGITS_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _GPT2_LIKE:
        warnings.warn(f"Unknown GGUF pre-tokenizer {pre!r}: splitting text like GPT-2, which may not match the model.")
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _byte_level_bpe(meta: dict) -> tokenizers.Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = _bytes_to_unicode()
    # Byte-level vocabularies spell every byte as a printable char; respell the odd token written in raw UTF-8.
    vocab = {t if set(t) <= set(alphabet) else "".join(byte_char[b] for b in t.encode()): i
             for i, t in enumerate(meta["ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("ggml.merges", [])]
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("ggml.pre"))
    tk.decoder = decoders.ByteLevel()
    types = meta.get("ggml.token_type") or []
    alphabet = set(alphabet)
    # A control token outside the byte alphabet is a llama.cpp mislabel; adding it would grow the vocabulary.
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(meta["ggml.tokens"], types)
                           if ty == _CONTROL and set(t) <= alphabet])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(meta["ggml.tokens"], types)
                   if ty == _USER_DEFINED and t in vocab])
    return tk


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)  # the rest (controls, space, ...) move past Latin-1, in byte order
    return table


def _sentencepiece_proto(meta: dict) -> bytes:
    """A sentencepiece BPE model from a GGUF "llama" vocabulary (pieces, scores, types), as llama.cpp reads it."""
    proto = sp_pb2.ModelProto()
    tokens, types = meta["ggml.tokens"], meta.get("ggml.token_type") or [1] * len(meta["ggml.tokens"])
    for piece, score, kind in zip(tokens, meta.get("ggml.scores") or [0.0] * len(tokens), types):
        proto.pieces.add(piece=piece, score=score, type=kind)
    proto.trainer_spec.model_type = sp_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = 6 in types
    proto.trainer_spec.unk_id = meta.get("ggml.unknown_token_id", types.index(2) if 2 in types else 0)
    proto.trainer_spec.bos_id = meta.get("ggml.bos_token_id", -1)
    proto.trainer_spec.eos_id = meta.get("ggml.eos_token_id", -1)
    proto.trainer_spec.pad_id = -1
    spec = proto.normalizer_spec
    spec.name, spec.add_dummy_prefix, spec.remove_extra_whitespaces, spec.escape_whitespaces = \
        "identity", meta.get("ggml.add_space_prefix", True), False, True
    return proto.SerializeToString()


def tokenizer_from_gguf(reader_or_path) -> Tokenizer:
    """The tokenizer described by a GGUF file's metadata; takes a path or an open `engine.gguf_file.GGUFFile`."""
    reader = reader_or_path if isinstance(reader_or_path, GGUFFile) else GGUFFile(reader_or_path)
    meta = {k[len("tokenizer."):]: v for k, v in reader.fields.items() if k.startswith("tokenizer.")}
    if "ggml.tokens" not in meta:
        raise ValueError(f"GGUF file {reader.path.name} has no vocabulary "
                         "(tokenizer.ggml.tokens); convert the model with its tokenizer included.")
    kind, tokens, types = meta.get("ggml.model"), meta["ggml.tokens"], meta.get("ggml.token_type") or []
    if kind == "gpt2":
        tok = HFTokenizer(_byte_level_bpe(meta))
    elif kind == "llama":
        tok = SentencePieceTokenizer(_sentencepiece_proto(meta))  # legacy=False, like transformers' GGUF loader
    else:
        raise ValueError(f"GGUF tokenizer type {kind!r} is not supported; use one with 'gpt2' (byte-level BPE) "
                         "or 'llama' (sentencepiece).")
    ids = {n: _ids(meta.get(f"ggml.{key}_token_id"))
           for n, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    extra_eos = [*_ids(meta.get("ggml.eot_token_id")), *_ids(meta.get("ggml.eom_token_id")),
                 *(i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _END_OF_TURN)]
    return tok._setup(_resolve_fields(tok, tokens={}, ids=ids, extra_eos=extra_eos,
                                      chat_template=meta.get("chat_template"),
                                      add_bos=meta.get("ggml.add_bos_token", kind == "llama"),
                                      add_eos=meta.get("ggml.add_eos_token", False)))
