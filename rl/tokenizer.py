"""A small word-level tokenizer (Hugging Face `tokenizers`), stored as a standard tokenizer.json.

Ids 0, 1, 2 are the special tokens <pad>, <bos>, <eos>; the task's words follow in the order given.
Encoding splits on whitespace and adds no special tokens (callers prepend <bos> themselves).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)


def build_word_tokenizer(words: Iterable[str]) -> Tokenizer:
    """Word-level tokenizer over SPECIAL_TOKENS + `words` (duplicates ignored, order kept)."""
    vocab: dict[str, int] = {}
    for w in (*SPECIAL_TOKENS, *words):
        if w not in vocab:
            vocab[w] = len(vocab)
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """{"pad": id, "bos": id, "eos": id} for a tokenizer that has the three special tokens."""
    out = {}
    for key, token in zip(("pad", "bos", "eos"), SPECIAL_TOKENS, strict=True):
        tid = tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"tokenizer has no {token} token")
        out[key] = tid
    return out
