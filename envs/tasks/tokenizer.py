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


# the attribute with_model_specials sets on a pretrained model's tokenizer
MODEL_SPECIALS = "laminar_special_ids"


def with_model_specials(tok: Tokenizer, tokenizer_config: dict) -> Tokenizer:
    """A pretrained model's tokenizer, told which of its tokens are pad, bos and eos: tokenizer_config.json's
    pad_token, bos_token and eos_token (a string or {"content": ...}; no pad_token: eos). special_ids then
    answers with those ids (SmolLM2: bos <|im_start|> 1, eos and pad <|im_end|> 2)."""
    out = {}
    for key in ("pad", "bos", "eos"):
        name = tokenizer_config.get(f"{key}_token") or (tokenizer_config.get("eos_token") if key == "pad" else None)
        name = name.get("content") if isinstance(name, dict) else name
        tid = tok.token_to_id(name) if isinstance(name, str) else None
        if tid is None:
            raise KeyError(f"tokenizer_config.json {key}_token={name!r} is not a token of tokenizer.json")
        out[key] = tid
    setattr(tok, MODEL_SPECIALS, out)
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """{"pad": id, "bos": id, "eos": id}: a pretrained model's (with_model_specials), else the three special
    tokens of the word-level tokenizer."""
    model = getattr(tok, MODEL_SPECIALS, None)
    if model is not None:
        return dict(model)
    out = {}
    for key, token in zip(("pad", "bos", "eos"), SPECIAL_TOKENS, strict=True):
        tid = tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"tokenizer has no {token} token")
        out[key] = tid
    return out
