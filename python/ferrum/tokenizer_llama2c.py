"""Read llama2.c's tokenizer.bin and turn it into an SPM-equivalent HF tokenizer.

Format: int32 max_token_length, then per token: float32 score, int32 byte length, the bytes.
There is no count: tokens run to the end of the file. llama2.c's encode (dummy-prefix space,
one symbol per UTF-8 character, `<0xNN>` byte fallback, repeatedly merge the adjacent pair whose
concatenation has the best score) is SentencePiece BPE, so the SPM builder reproduces it.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from .tokenizer_gguf import (SPM_SPACE, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN,
                             build_spm_tokenizer)

_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2  # llama2.c's fixed ids


def read_llama2c_vocab(path) -> tuple[list[str], list[float]]:
    data = Path(path).read_bytes()
    if len(data) < 4:
        raise ValueError(f"{path}: too short for a llama2.c tokenizer")
    pieces, scores, offset = [], [], 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise ValueError(f"{path}: truncated token header at byte {offset}")
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if length < 0 or offset + length > len(data):
            raise ValueError(f"{path}: token {len(pieces)} runs past the end of the file")
        raw = data[offset:offset + length]
        offset += length
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:
            if length != 1:
                raise ValueError(f"{path}: token {len(pieces)} is not UTF-8") from None
            piece = f"<0x{raw[0]:02X}>"  # older exports stored byte tokens raw
        pieces.append(piece)
        scores.append(score)
    return pieces, scores


def llama2c_token_texts_and_types(pieces: list[str]) -> tuple[list[str], list[int]]:
    """llama2.c writes spaces where SentencePiece has '▁', and the specials as '\\n<s>\\n'."""
    texts, types = [], []
    for i, piece in enumerate(pieces):
        if i in (UNK_ID, BOS_ID, EOS_ID):
            texts.append(piece.strip())
            types.append(TOKEN_UNKNOWN if i == UNK_ID else TOKEN_CONTROL)
        elif _BYTE_PIECE.fullmatch(piece):
            texts.append(piece)
            types.append(TOKEN_BYTE)
        else:
            texts.append(piece.replace(" ", SPM_SPACE))
            types.append(TOKEN_NORMAL)
    return texts, types


def build_llama2c_tokenizer(path):
    pieces, scores = read_llama2c_vocab(path)
    texts, types = llama2c_token_texts_and_types(pieces)
    return build_spm_tokenizer(texts, scores, types, unk_id=UNK_ID)
