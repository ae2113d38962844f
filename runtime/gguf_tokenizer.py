"""The tokenizer a GGUF file describes in its metadata (llama.cpp's `tokenizer.ggml.*` keys), built as a Hugging
Face `tokenizers` tokenizer: byte-level BPE ("gpt2": Qwen2, Llama 3) or SentencePiece BPE ("llama": Llama 2,
TinyLlama)."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as bpe_models

from models.gguf import GgufFile
from models.pretokenize import LLAMA3_SPLIT, QWEN2_SPLIT

# tokenizer.ggml.pre -> the split its merges were learned on; Qwen2's vocabulary also composes its text (NFC)
SPLITS = {"qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT,
          "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT}
NFC_PRE = ("qwen2", "deepseek-r1-qwen")
IGNORE_MERGES_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")  # a word in the vocabulary is one token
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
SPIECE_SPACE = "\u2581"


class GgufTokenizerError(ValueError):
    """The file's tokenizer metadata is missing or of a kind not supported (the caller names the file)."""


def gguf_tokenizer(gguf: GgufFile) -> HFTokenizer:
    """The tokenizer of a GGUF file: its vocabulary and merges, the special tokens it marks, BOS when it says so."""
    meta = gguf.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise GgufTokenizerError("has no tokenizer.ggml.tokens list; convert the model again with llama.cpp")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level(meta, tokens)
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens, types)
    else:
        raise GgufTokenizerError(f"has tokenizer.ggml.model {kind!r}; supported: 'gpt2' (byte-level BPE), 'llama' "
                                 "(SentencePiece BPE)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and isinstance(bos, int) and bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]}:0 $A:0",
                                                           pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
                                                           special_tokens=[(tokens[bos], bos)])
    return tok


def _merges(meta: dict) -> list[tuple[str, str]]:
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
        raise GgufTokenizerError("has no valid tokenizer.ggml.merges list (\"left right\" pairs); convert the model "
                                 "again with llama.cpp")
    return [tuple(m.split(" ")) for m in merges]


def _byte_level(meta: dict, tokens: list[str]) -> HFTokenizer:
    """Byte-level BPE: the vocabulary spelled in GPT-2's byte alphabet, words split by the regex of its `pre`."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    tok = HFTokenizer(bpe_models.BPE({t: i for i, t in enumerate(tokens)}, _merges(meta), fuse_unk=False,
                                     byte_fallback=False, ignore_merges=pre in IGNORE_MERGES_PRE))
    if pre in NFC_PRE:
        tok.normalizer = normalizers.NFC()
    split = SPLITS.get(pre)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict, tokens: list[str], types: list[int]) -> HFTokenizer:
    """SentencePiece BPE: spaces as U+2581 and one in front, bytes of unknown characters as <0xNN> tokens; merges
    from the file, or (as SentencePiece merges: the best-scoring piece first) from the pieces' scores."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = _merges(meta)
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise GgufTokenizerError("has neither tokenizer.ggml.merges nor one score per token; convert the model "
                                     "again with llama.cpp")
        merges = _merges_by_score(tokens, types, scores, vocab)
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    tok = HFTokenizer(bpe_models.BPE(vocab, merges, unk_token=tokens[unk] if 0 <= unk < len(tokens) else None,
                                     fuse_unk=True, byte_fallback=True))
    prefix = [normalizers.Prepend(SPIECE_SPACE)] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", SPIECE_SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _merges_by_score(tokens: list[str], types: list[int], scores: list[float],
                     vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces, the higher-scoring merged piece first."""
    ranked = []
    for token, kind, score in zip(tokens, types, scores):
        if kind != 1 or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[token], vocab[left], (left, right)))
    return [pair for *_, pair in sorted(ranked)]


def gguf_special_tokens(gguf: GgufFile) -> dict[str, str | None]:
    """The special tokens a chat template may name (bos_token, eos_token, ...), spelled from the vocabulary."""
    tokens = gguf.metadata.get("tokenizer.ggml.tokens") or []
    ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
           "pad_token": "padding_token_id"}
    return {key: tokens[i] if isinstance(i := gguf.metadata.get(f"tokenizer.ggml.{name}"), int) and 0 <= i < len(
        tokens) else None for key, name in ids.items()}
