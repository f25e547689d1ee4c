"""Rung 6: tokenizers. llama.cpp's test vectors, parity with transformers / sentencepiece, round trips,
streaming decode, BOS/EOS rules."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from ferrum.tokenizer import IncrementalDecoder, Tokenizer
from gguf_meta import metadata_from_tokenizer_json, read_gguf_metadata
from text_samples import TORTURE, varied_strings

MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
if not MODELS.is_dir():
    MODELS = Path("/work/shared/models")
TOK = MODELS / "tokenizers"
VECTORS = TOK / "llama.cpp-vocab"

SAMPLES = varied_strings(3000)


# ---- tokenizers under test (module scope: loading is the slow part) ---------------------------------
@pytest.fixture(scope="module")
def spm_gguf():
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(VECTORS / "ggml-vocab-llama-spm.gguf"))


@pytest.fixture(scope="module")
def spm_model():
    return Tokenizer.from_file(TOK / "llama2" / "tokenizer.model")


@pytest.fixture(scope="module")
def spm_llama2c():
    return Tokenizer.from_llama2c(TOK / "llama2" / "tokenizer.bin")


@pytest.fixture(scope="module")
def gpt2_gguf():
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(VECTORS / "ggml-vocab-gpt-2.gguf"))


@pytest.fixture(scope="module")
def llama3_json():
    return Tokenizer.from_dir(TOK / "llama3")


@pytest.fixture(scope="module")
def qwen3_json():
    return Tokenizer.from_dir(TOK / "qwen3-0.6b")


@pytest.fixture(scope="module")
def smollm2_json():
    return Tokenizer.from_dir(TOK / "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def llama3_gguf():
    return Tokenizer.from_gguf_metadata(metadata_from_tokenizer_json(TOK / "llama3", "llama-bpe"))


@pytest.fixture(scope="module")
def qwen2_gguf():
    return Tokenizer.from_gguf_metadata(metadata_from_tokenizer_json(TOK / "qwen3-0.6b", "qwen2"))


@pytest.fixture(scope="module")
def smollm_gguf_from_json():
    return Tokenizer.from_gguf_metadata(metadata_from_tokenizer_json(TOK / "smollm2-135m-instruct", "smollm"))


@pytest.fixture(scope="module")
def smollm2_real_gguf(smollm2_path):
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(smollm2_path))


@pytest.fixture(scope="module")
def sentencepiece_llama2():
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(TOK / "llama2" / "tokenizer.model"))


@pytest.fixture(scope="module")
def hf_reference():
    """transformers.AutoTokenizer per tokenizer directory, loaded once."""
    from transformers import AutoTokenizer

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = AutoTokenizer.from_pretrained(str(TOK / name))
        return cache[name]

    return get


def _fixture(request, name):
    return request.getfixturevalue(name)


# ---- llama.cpp test vectors: 47 cases per vocabulary ------------------------------------------------
def _vector_cases(vocab: str) -> list[tuple[str, list[int]]]:
    inputs = (VECTORS / f"ggml-vocab-{vocab}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = (VECTORS / f"ggml-vocab-{vocab}.gguf.out").read_text(encoding="utf-8").split("\n")
    cases = [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, outputs)]
    assert len(cases) == 47
    return cases


@pytest.mark.parametrize("vocab, tokenizer", [
    ("llama-spm", "spm_gguf"),
    ("llama-spm", "spm_model"),
    ("llama-spm", "spm_llama2c"),
    ("gpt-2", "gpt2_gguf"),
    ("llama-bpe", "llama3_json"),
    ("llama-bpe", "llama3_gguf"),
    ("qwen2", "qwen3_json"),
    ("qwen2", "qwen2_gguf"),
])
def test_llama_cpp_vectors(request, vocab, tokenizer):
    tok = _fixture(request, tokenizer)
    failures = [(text, want, got) for text, want in _vector_cases(vocab)
                if (got := tok.encode(text, add_special_tokens=False)) != want]
    assert not failures, f"{len(failures)}/47 cases differ, first: {failures[0]!r}"


# ---- parity on a few thousand varied strings --------------------------------------------------------
@pytest.mark.parametrize("tokenizer, reference", [
    ("llama3_gguf", "llama3"),
    ("qwen2_gguf", "qwen3-0.6b"),
    ("smollm_gguf_from_json", "smollm2-135m-instruct"),
    ("smollm2_real_gguf", "smollm2-135m-instruct"),
    ("llama3_json", "llama3"),
    ("qwen3_json", "qwen3-0.6b"),
    ("smollm2_json", "smollm2-135m-instruct"),
])
def test_matches_transformers(request, hf_reference, tokenizer, reference):
    tok = _fixture(request, tokenizer)
    ref = hf_reference(reference)
    texts = SAMPLES + TORTURE + ["<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x", "<|begin_of_text|>Hi"]
    want = ref(texts, add_special_tokens=False)["input_ids"]
    failures = [(t, w, g) for t, w in zip(texts, want) if (g := tok.encode(t, add_special_tokens=False)) != w]
    assert not failures, f"{len(failures)}/{len(texts)} differ, first: {failures[0]!r}"


@pytest.mark.parametrize("tokenizer", ["spm_gguf", "spm_llama2c", "spm_model"])
def test_spm_matches_sentencepiece(request, sentencepiece_llama2, tokenizer):
    tok = _fixture(request, tokenizer)
    texts = SAMPLES + TORTURE
    failures = [(t, w, g) for t in texts
                if (g := tok.encode(t, add_special_tokens=False)) != (w := sentencepiece_llama2.encode(t))]
    assert not failures, f"{len(failures)}/{len(texts)} differ, first: {failures[0]!r}"


def test_stories260k_prompt_encoding():
    reference = json.loads((MODELS / "stories260K" / "reference.json").read_text())["prompt_encoding"]
    text, want = reference["prompt"], reference["ids_with_bos"]
    from_bin = Tokenizer.from_llama2c(MODELS / "stories260K" / "tok512.bin")
    from_gguf = Tokenizer.from_gguf_metadata(read_gguf_metadata(MODELS / "stories260K" / "stories260K.gguf"))
    for tok in (from_bin, from_gguf):
        assert tok.encode(text) == want
        assert tok.decode(want) == text


# ---- decode ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokenizer", [
    "gpt2_gguf", "llama3_json", "llama3_gguf", "qwen3_json", "qwen2_gguf", "smollm2_json", "smollm2_real_gguf"])
def test_byte_level_round_trip_is_exact(request, tokenizer):
    tok = _fixture(request, tokenizer)
    # Qwen's tokenizer normalizes to NFC before anything else, so NFC text is what comes back.
    nfc = tokenizer in ("qwen3_json", "qwen2_gguf")
    for text in TORTURE + SAMPLES[:500]:
        want = unicodedata.normalize("NFC", text) if nfc else text
        assert tok.decode(tok.encode(text)) == want


@pytest.mark.parametrize("tokenizer", ["spm_gguf", "spm_llama2c", "spm_model"])
def test_spm_round_trip_as_sentencepiece(request, sentencepiece_llama2, tokenizer):
    tok = _fixture(request, tokenizer)
    for text in TORTURE + SAMPLES[:500]:
        assert tok.decode(tok.encode(text)) == sentencepiece_llama2.decode(sentencepiece_llama2.encode(text))


@pytest.mark.parametrize("tokenizer", ["gpt2_gguf", "qwen3_json", "smollm2_real_gguf", "spm_gguf", "spm_model"])
def test_token_pieces_concatenate_to_the_text_bytes(request, tokenizer):
    tok = _fixture(request, tokenizer)
    spm = tokenizer.startswith("spm")
    for text in TORTURE[1:] + ["🎉 你好"]:
        ids = tok.encode(text, add_special_tokens=False)
        want = unicodedata.normalize("NFC", text) if tokenizer == "qwen3_json" else text
        assert b"".join(tok.token_to_piece(i) for i in ids) == ((" " if spm else "") + want).encode()


def test_decode_rejects_out_of_range_ids(qwen3_json):
    with pytest.raises(ValueError):
        qwen3_json.decode([1, qwen3_json.vocab_size])
    with pytest.raises(ValueError):
        qwen3_json.decode([-1])


@pytest.mark.parametrize("tokenizer", ["gpt2_gguf", "qwen3_json", "llama3_gguf", "smollm2_real_gguf",
                                       "spm_gguf", "spm_model", "spm_llama2c"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_decoder_streams_valid_text(request, tokenizer, skip_special_tokens):
    tok = _fixture(request, tokenizer)
    texts = ["🎉🎉 家族 👨‍👩‍👧‍👦 done", "日本語のテキスト、韓国語 한국어", "a😀b😃c", "𝄞𝔸ℂ", "plain ascii text"]
    texts += TORTURE[1:] + SAMPLES[:200]
    for text in texts:
        ids = tok.encode(text)
        stream = IncrementalDecoder(tok, skip_special_tokens=skip_special_tokens)
        pieces = [stream.push(i) for i in ids] + [stream.flush()]
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == full
        if "\ufffd" not in full:  # every piece is whole characters, nothing half-decoded
            assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_holds_split_characters(gpt2_gguf):
    ids = gpt2_gguf.encode("🎉")
    assert len(ids) > 1  # GPT-2 spells this emoji with several byte tokens
    stream = IncrementalDecoder(gpt2_gguf)
    pieces = [stream.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉"


def test_incremental_decoder_flushes_an_unfinished_character(gpt2_gguf):
    ids = gpt2_gguf.encode("a🎉")[:-1]  # the emoji's last byte never arrives
    stream = IncrementalDecoder(gpt2_gguf)
    assert "".join(stream.push(i) for i in ids) == "a"
    rest = stream.flush()
    assert "\ufffd" in rest and "a" + rest == gpt2_gguf.decode(ids)


# ---- special tokens, BOS / EOS ----------------------------------------------------------------------
def test_spm_bos_rules(spm_gguf, spm_model, spm_llama2c):
    for tok in (spm_gguf, spm_model, spm_llama2c):
        assert tok.add_bos and tok.bos_token_id == 1 and tok.bos_token == "<s>"
        assert tok.eos_token_id == 2 and tok.eos_token == "</s>" and 2 in tok.eos_token_ids
        hello = tok.encode("Hello", add_special_tokens=False)
        assert tok.encode("Hello") == [1] + hello
        assert tok.encode("<s>Hello")[:2] == [1, hello[0]] and tok.encode("<s>Hello").count(1) == 1
        assert tok.encode("") == [1] and tok.encode("", add_special_tokens=False) == []
        assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_llama3_gguf_adds_begin_of_text_once(llama3_gguf):
    assert llama3_gguf.add_bos and llama3_gguf.bos_token == "<|begin_of_text|>"
    assert llama3_gguf.encode("Hello world") == [128000, 9906, 1917]
    assert llama3_gguf.encode("<|begin_of_text|>Hello world") == [128000, 9906, 1917]
    assert {128001, 128009} <= llama3_gguf.eos_token_ids  # <|end_of_text|>, <|eot_id|>


@pytest.mark.parametrize("tokenizer, reference", [
    ("llama3_json", "llama3"), ("qwen3_json", "qwen3-0.6b"), ("smollm2_json", "smollm2-135m-instruct")])
def test_hf_special_token_rules_match_transformers(request, hf_reference, tokenizer, reference):
    tok, ref = _fixture(request, tokenizer), hf_reference(reference)
    for text in ["Hello world", "<|im_start|>user\nHi<|im_end|>\n", "<|begin_of_text|>Hi", ""]:
        assert tok.encode(text) == ref(text)["input_ids"]
    assert tok.bos_token == ref.bos_token
    # Without a tokenizer_config.json (SmolLM2 here) the eos id comes from the model's config.json.
    assert tok.eos_token == (ref.eos_token or "<|im_end|>")


def test_qwen3_ids(qwen3_json, qwen2_gguf):
    for tok in (qwen3_json, qwen2_gguf):
        assert not tok.add_bos
        assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [151644, 872, 198, 13048, 151645]
        assert tok.decode([151644, 872, 198, 13048, 151645]) == "user\nHi"
        assert tok.decode([151644, 872], skip_special_tokens=False) == "<|im_start|>user"
    assert qwen3_json.eos_token_id == 151645 and qwen3_json.eos_token_ids == {151643, 151645}


def test_smollm2_gguf_rules(smollm2_real_gguf):
    tok = smollm2_real_gguf
    assert not tok.add_bos and tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.vocab_size == 49152 and tok.eos_token_id == 2 and 2 in tok.eos_token_ids
    assert tok.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 2
