"""The two tokenization engines behind ferrum.Tokenizer, with one small common interface.

encode(text) -> ids (no BOS/EOS: Tokenizer adds those), decode(ids, skip_special_tokens) -> str,
id_to_token / token_to_id, vocab_size, special_ids, and piece_bytes(id) -> the bytes a token adds.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

from .tokenizer_gguf import SPM_SPACE

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to U+0100 onwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


class HFBackend:
    """A `tokenizers.Tokenizer`; `kind` says how token texts map to bytes ("byte_level" or "spm")."""

    def __init__(self, hf, kind: str):
        self.hf = hf
        self.kind = kind
        added = hf.get_added_tokens_decoder()
        self.special_ids = {i for i, tok in added.items() if tok.special}
        self._added_ids = set(added)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def piece_bytes(self, token_id: int) -> bytes:
        text = self.hf.id_to_token(token_id)
        if text is None:
            raise IndexError(f"token id {token_id} out of range")
        if token_id in self._added_ids:
            return text.encode("utf-8")
        if self.kind == "byte_level":
            alphabet = byte_level_alphabet()
            return bytes(alphabet[c] for c in text)
        return spm_piece_bytes(text)


def spm_piece_bytes(text: str) -> bytes:
    byte = _BYTE_PIECE.fullmatch(text)
    if byte:
        return bytes([int(byte.group(1), 16)])
    return text.replace(SPM_SPACE, " ").encode("utf-8")


def _check_pieces(sp, path) -> None:
    """SentencePiece loads a model whose pieces are not UTF-8 or whose scores are not finite, and
    fails (or scores oddly) only when such a piece is met: refused at load instead."""
    for i in range(sp.get_piece_size()):
        try:
            sp.id_to_piece(i)
        except UnicodeDecodeError:
            raise ValueError(f"{path}: piece {i} is not valid UTF-8") from None
        if not math.isfinite(sp.get_score(i)):
            raise ValueError(f"{path}: piece {i} has the score {sp.get_score(i)}, not a finite number")


class SentencePieceBackend:
    """A SentencePiece `tokenizer.model`. SentencePiece never matches control tokens in text, so
    they are split out here first (as HF and llama.cpp do), each text segment encoded on its own."""

    def __init__(self, path):
        import sentencepiece

        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except RuntimeError as e:  # how sentencepiece reports a file it cannot parse
            raise ValueError(f"{path}: not a SentencePiece model ({e})") from e
        n = self.sp.get_piece_size()
        _check_pieces(self.sp, path)
        self.special_ids = {i for i in range(n) if self.sp.is_control(i)}
        self._special_by_text = {self.sp.id_to_piece(i): i for i in self.special_ids}
        texts = sorted(self._special_by_text, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        if self._special_re is None:
            return self.sp.encode(text)
        ids = []
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:  # odd parts are the captured special tokens
                ids.append(self._special_by_text[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids, skip_special_tokens: bool) -> str:
        ids = list(ids)
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in self.special_ids])
        out, run = [], []
        for i in ids + [None]:
            if i is not None and i not in self.special_ids:
                run.append(i)
                continue
            if run:
                text = self.sp.decode(run)
                # SentencePiece drops a leading space as the dummy prefix; only the first run had one.
                if out and self.sp.id_to_piece(run[0]).startswith(SPM_SPACE):
                    text = " " + text
                out.append(text)
                run = []
            if i is not None:
                out.append(self.sp.id_to_piece(i))
        return "".join(out)

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < self.vocab_size:
            return None
        return self.sp.id_to_piece(token_id)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    def piece_bytes(self, token_id: int) -> bytes:
        text = self.id_to_token(token_id)
        if text is None:
            raise IndexError(f"token id {token_id} out of range")
        return spm_piece_bytes(text)
