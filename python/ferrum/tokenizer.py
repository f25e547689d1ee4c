"""ferrum.Tokenizer: text <-> token ids for every vocabulary format ferrum loads.

Formats: HF tokenizer.json (+ tokenizer_config.json, generation_config.json), SentencePiece
tokenizer.model, a vocabulary embedded in GGUF metadata, and llama2.c's tokenizer.bin.
The tokenization itself is done by HF `tokenizers` or `sentencepiece`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .chat_template import apply_chat_template as _render_chat_template
from .tokenizer_backends import HFBackend, SentencePieceBackend
from .tokenizer_gguf import END_OF_TURN_TEXTS, built, vocab_from_gguf_metadata


class Tokenizer:
    def __init__(self, backend, *, bos_token_id: int | None, eos_token_id: int | None,
                 eos_token_ids=(), add_bos: bool = False, add_eos: bool = False, chat_template: str | None = None):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        # Every id that ends generation: the eos id, end-of-turn ids (<|im_end|>, <|eot_id|>, ...).
        self.eos_token_ids = {i for i in (eos_token_id, *eos_token_ids) if i is not None}
        self.add_bos = bool(add_bos) and bos_token_id is not None
        self.add_eos = bool(add_eos) and eos_token_id is not None
        self.chat_template = chat_template

    # ---- basic properties -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    @property
    def special_token_ids(self) -> set[int]:
        return set(self._backend.special_ids)

    @property
    def hf_tokenizer(self):
        """The Hugging Face ``tokenizers.Tokenizer`` doing the work, or None (SentencePiece)."""
        return getattr(self._backend, "hf", None)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry as stored (e.g. 'Ġthe', '▁the', '<0x0A>', '<|im_end|>')."""
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_to_piece(self, token_id: int) -> bytes:
        """The raw bytes this token contributes to the text (may be part of a UTF-8 character)."""
        return self._backend.piece_bytes(int(token_id))

    # ---- encode / decode --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special-token strings in `text` (e.g. '<|im_start|>') become their ids. With
        add_special_tokens, BOS/EOS are added per the tokenizer's rules, but never a second BOS
        when the text already starts with it (chat templates emit it)."""
        ids = self._backend.encode(text)
        if add_special_tokens:
            if self.add_bos and (not ids or ids[0] != self.bos_token_id):
                ids.insert(0, self.bos_token_id)
            if self.add_eos and (not ids or ids[-1] != self.eos_token_id):
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token ids out of range [0, {n}): {bad[:5]}")
        return self._backend.decode(ids, skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs):
        text = _render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                     **{"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs})
        # As transformers: the template writes any BOS itself, so no special tokens are added.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, directory) -> "Tokenizer":
        """A Hugging Face model directory: tokenizer.json preferred, else SentencePiece tokenizer.model."""
        directory = Path(directory)
        for name in ("tokenizer.json", "tokenizer.model"):
            if (directory / name).is_file():
                return cls.from_file(directory / name)
        raise FileNotFoundError(f"{directory}: no tokenizer.json or tokenizer.model")

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer at '{path}'")
        if path.is_dir():
            return cls.from_dir(path)
        if path.suffix == ".json":
            return cls._from_hf_json(path)
        if path.suffix == ".model":
            return cls._from_sentencepiece(path)
        if path.suffix == ".bin":
            return cls.from_llama2c(path)
        raise ValueError(f"{path}: unknown tokenizer format (expected tokenizer.json, tokenizer.model or "
                         f"a llama2.c tokenizer.bin; for GGUF use Tokenizer.from_gguf_metadata)")

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        v = vocab_from_gguf_metadata(meta)
        return cls(HFBackend(v.hf, v.kind), bos_token_id=v.bos_id, eos_token_id=v.eos_id, eos_token_ids=v.eos_ids,
                   add_bos=v.add_bos, add_eos=v.add_eos, chat_template=v.chat_template)

    @classmethod
    def from_llama2c(cls, path) -> "Tokenizer":
        from .tokenizer_llama2c import BOS_ID, EOS_ID, build_llama2c_tokenizer

        hf = built(lambda: build_llama2c_tokenizer(path), str(path))
        return cls(HFBackend(hf, "spm"), bos_token_id=BOS_ID, eos_token_id=EOS_ID, add_bos=True)

    @classmethod
    def _from_hf_json(cls, path: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        text = _read_text(path)
        spec = _loads_strict(text, path)
        _check_hf_vocab(spec, path)
        hf = built(lambda: HFTokenizer.from_str(text), str(path))
        config = _read_json(path.with_name("tokenizer_config.json"))
        backend = HFBackend(hf, _hf_piece_kind(spec))

        bos_id = _config_token_id(hf, config, "bos_token", path)
        eos_id = _config_token_id(hf, config, "eos_token", path)
        if eos_id is None:  # no tokenizer_config.json: the model config still says what ends a sequence
            eos_id = _model_config_eos_id(path.parent, backend.vocab_size)
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # transformers then relies on the tokenizer.json post-processor
            add_bos = bos_id is not None and bos_id in _post_processor_prefix_ids(spec)
        _check_add_flags(config, bos_id, eos_id, path)
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id,
                   eos_token_ids=_extra_eos_ids(backend, path.parent),
                   add_bos=add_bos, add_eos=bool(config.get("add_eos_token", False)),
                   chat_template=_read_chat_template(path.parent, config))

    @classmethod
    def _from_sentencepiece(cls, path: Path) -> "Tokenizer":
        backend = SentencePieceBackend(path)
        sp = backend.sp
        config = _read_json(path.with_name("tokenizer_config.json"))
        bos_id = _none_if_negative(sp.bos_id())
        eos_id = _none_if_negative(sp.eos_id())
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id,
                   eos_token_ids=_extra_eos_ids(backend, path.parent),
                   # Llama/Mistral SentencePiece models add BOS unless their config says otherwise.
                   add_bos=bool(config.get("add_bos_token", True)), add_eos=bool(config.get("add_eos_token", False)),
                   chat_template=_read_chat_template(path.parent, config))


class IncrementalDecoder:
    """Streams text as tokens arrive: push(id) returns only newly completed text, holding back a
    UTF-8 character whose bytes are split over tokens. The pieces pushed out, plus flush(), join
    to tokenizer.decode(all ids).

    Decodes a short window (the tokens of the previous emission plus the new ones) and emits the
    part past the previous emission, so spacing rules that look at the neighbour token (SPM's
    leading space) come out as in a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_start = 0  # window start: first token of the last emission
        self._read_end = 0  # tokens before this index have been emitted

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self._prefix_start:self._read_end])
        text = self._decode(self.ids[self._prefix_start:])
        # A trailing U+FFFD is an unfinished multi-byte character: wait for its next byte(s).
        if len(text) <= len(prefix) or text.endswith("\ufffd") or not text.startswith(prefix):
            return ""
        self._prefix_start, self._read_end = self._read_end, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is held back (e.g. bytes that never became a valid character, as U+FFFD)."""
        prefix = self._decode(self.ids[self._prefix_start:self._read_end])
        text = self._decode(self.ids[self._prefix_start:])
        self._prefix_start = self._read_end = len(self.ids)
        return text[len(prefix):] if text.startswith(prefix) else ""


# ---- helpers for the HF directory layout ----------------------------------------------------------
def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (byte {e.start})") from None


def _loads_strict(text: str, path: Path):
    """json.loads, refusing a key repeated in one object (the file is damaged: which one counts?)."""
    def unique(pairs):
        repeated = _first_repeated(k for k, _ in pairs)
        if repeated is not None:
            raise ValueError(f"{path}: the key {repeated!r} appears twice in one object")
        return dict(pairs)
    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _read_json(path: Path) -> dict:
    return _loads_strict(_read_text(path), path) if path.is_file() else {}


def _check_hf_vocab(spec: dict, path: Path) -> None:
    """A tokenizer.json model's vocabulary: ids used once each, and a Unigram's scores finite."""
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        repeated = _first_repeated(vocab.values())
        if repeated is not None:
            raise ValueError(f"{path}: the vocabulary gives id {repeated} to two tokens")
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        for i, entry in enumerate(vocab):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], (int, float))
                    and math.isfinite(entry[1])):
                raise ValueError(f"{path}: vocabulary entry {i} is {entry!r}, not a piece and a finite score")


def _first_repeated(items):
    seen = set()
    for x in items:
        if x in seen:
            return x
        seen.add(x)
    return None


def _none_if_negative(i: int) -> int | None:
    return None if i is None or i < 0 else i


def _config_token_id(hf, config: dict, key: str, path: Path) -> int | None:
    """The id of tokenizer_config.json's `key` token; ValueError when it names no token."""
    token = config.get(key)
    if isinstance(token, dict):  # {"content": "<s>", "lstrip": ..., ...}
        token = token.get("content")
    if not token:
        return None
    i = hf.token_to_id(token)
    if i is None:
        raise ValueError(f"{path.with_name('tokenizer_config.json')}: {key} {token!r} is not in the vocabulary")
    return i


def _check_add_flags(config: dict, bos_id, eos_id, path: Path) -> None:
    for key, token in (("add_bos_token", bos_id), ("add_eos_token", eos_id)):
        if config.get(key) and token is None:
            raise ValueError(f"{path.with_name('tokenizer_config.json')}: {key} is true, but there is no "
                             f"{key[4:7]}_token")


def _checked_id(value, vocab_size: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"{where} is {value!r}, not a token id of the {vocab_size}-token vocabulary")
    return value


def _hf_piece_kind(spec: dict) -> str:
    """byte_level when the decoder (or one of its steps) is ByteLevel, else SentencePiece-style."""
    decoder = spec.get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return "byte_level" if any(s.get("type") == "ByteLevel" for s in steps) else "spm"


def _post_processor_prefix_ids(spec: dict) -> set[int]:
    """Ids a TemplateProcessing post-processor puts before a single sequence."""
    proc = spec.get("post_processor") or {}
    procs = proc.get("processors", [proc]) if proc.get("type") == "Sequence" else [proc]
    ids = set()
    for p in procs:
        if p.get("type") != "TemplateProcessing":
            continue
        for item in p.get("single", []):
            if "Sequence" in item:
                break
            name = item.get("SpecialToken", {}).get("id")
            ids.update(p.get("special_tokens", {}).get(name, {}).get("ids", []))
    return ids


def _model_config_eos_id(directory: Path, vocab_size: int) -> int | None:
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(directory / name).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            return _checked_id(eos, vocab_size, f"{directory / name}: eos_token_id")
    return None


def _extra_eos_ids(backend, directory: Path) -> set[int]:
    """generation_config.json's eos_token_id(s), plus special end-of-turn tokens by their text."""
    ids = set()
    path = directory / "generation_config.json"
    gen = _read_json(path).get("eos_token_id")
    if gen is not None:
        ids.update(_checked_id(i, backend.vocab_size, f"{path}: eos_token_id")
                   for i in (gen if isinstance(gen, list) else [gen]))
    for i in backend.special_ids:
        if backend.id_to_token(i) in END_OF_TURN_TEXTS:
            ids.add(i)
    return ids


def _read_chat_template(directory: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (directory / "chat_template.jinja").is_file():
        template = _read_text(directory / "chat_template.jinja")
    return template
