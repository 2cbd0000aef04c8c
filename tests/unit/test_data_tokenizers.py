"""Tokenizers: ByteTokenizer's exact ids, and HFTokenizer on a tiny tokenizer.json built at test time."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megapack.data import ByteTokenizer, ChatTemplate, HFTokenizer, Tokenizer, read_jsonl

HAS_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None
needs_tokenizers = pytest.mark.skipif(
    not HAS_TOKENIZERS, reason="HF tokenizer tests need the optional 'tokenizers' package"
)
SPECIALS = ["<pad>", "</s>", "<s>", "<unk>", "<|im_start|>", "<|im_end|>"]
SENTENCES = ["hello world", "the cat sat on the mat", "user assistant system", "hello cat"]


def test_byte_tokenizer_ids() -> None:
    tok = ByteTokenizer()
    assert tok.encode("hi") == [104, 105]
    assert tok.encode("é") == [0xC3, 0xA9]  # UTF-8 bytes
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.decode([104, 105, 257, 256, 258]) == "hi"  # specials skipped
    assert tok.decode(tok.encode("naïve ☃")) == "naïve ☃"
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_decode_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match=r"ids\[1\] is 259, outside range\(0, 259\)"):
        ByteTokenizer().decode([104, 259])
    with pytest.raises(ValueError, match=r"ids\[0\] is -1"):
        ByteTokenizer().decode([-1])


def test_hf_tokenizer_without_the_package_names_the_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        HFTokenizer.from_file(tmp_path / "tokenizer.json")


def build_tokenizer(folder: Path, specials: list[str] = SPECIALS) -> tuple[Path, Any]:
    """Train a word-level tokenizer on a few sentences and save it as folder/tokenizer.json."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    rust = RustTokenizer(models.WordLevel(unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=specials))
    path = folder / "tokenizer.json"
    rust.save(str(path))
    return path, rust


@needs_tokenizers
def test_hf_tokenizer_from_file_finds_common_special_tokens(tmp_path: Path) -> None:
    path, rust = build_tokenizer(tmp_path)
    tok = HFTokenizer.from_file(path)
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)  # trainer puts specials first
    assert tok.vocab_size == rust.get_vocab_size()
    ids = tok.encode("hello world")
    assert ids == [rust.token_to_id("hello"), rust.token_to_id("world")]
    assert len(set(ids)) == 2 and min(ids) >= len(SPECIALS)
    assert tok.decode([*ids, tok.eos_id]) == "hello world"
    assert tok.encode("hello zebra")[1] == 3  # unknown word -> <unk>
    assert isinstance(tok, Tokenizer)
    texts = [*SENTENCES, "hello zebra", "", "  cat  "]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]  # encode_batch_fast: same ids


@needs_tokenizers
def test_hf_tokenizer_special_tokens_from_arguments_and_config(tmp_path: Path) -> None:
    path, _ = build_tokenizer(tmp_path)
    tok = HFTokenizer.from_file(path, eos_token="<|im_end|>", pad_token="<unk>", bos_token="<s>")
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (5, 3, 2)
    config = {"eos_token": {"content": "<|im_end|>"}, "pad_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer.from_file(path)
    assert (tok.eos_id, tok.pad_id) == (5, 1)
    assert HFTokenizer.from_file(path, eos_token="<s>").eos_id == 2  # argument beats config


@needs_tokenizers
def test_hf_tokenizer_errors_name_file_and_token(tmp_path: Path) -> None:
    path, _ = build_tokenizer(tmp_path, specials=["<unk>", "<|im_end|>"])
    with pytest.raises(ValueError, match=r"found no eos token .* pass eos_token=.*'<\|im_end\|>'"):
        HFTokenizer.from_file(path)
    with pytest.raises(ValueError, match=r"eos_token '<eot>' \(from the argument\) is not in"):
        HFTokenizer.from_file(path, eos_token="<eot>")
    tok = HFTokenizer.from_file(path, eos_token="<|im_end|>")
    assert (tok.pad_id, tok.bos_id) == (tok.eos_id, None)  # pad falls back to eos
    with pytest.raises(FileNotFoundError, match="no such tokenizer file"):
        HFTokenizer.from_file(tmp_path / "missing.json")


@needs_tokenizers
def test_chatml_template_with_hf_special_tokens(tmp_path: Path) -> None:
    path, rust = build_tokenizer(tmp_path)
    tok = HFTokenizer.from_file(path)
    w = rust.token_to_id
    line = {
        "messages": [
            {"role": "user", "content": "hello cat"},
            {"role": "assistant", "content": "hello world"},
        ]
    }
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(line) + "\n")
    (doc,) = read_jsonl(data, tok, chat_template=ChatTemplate.chatml())
    start, end = 4, 5  # <|im_start|>, <|im_end|>: one id each
    user = [start, w("user"), w("hello"), w("cat"), end]
    reply = [start, w("assistant"), w("hello"), w("world"), end]
    assert doc.tokens.tolist() == [*user, *reply, tok.eos_id]  # final eos: no eos per turn
    assert doc.loss_mask.tolist() == [0] * 5 + [0, 0, 1, 1, 1] + [1]
    assert doc.boundaries == (5,)
    assert doc.tokens.dtype == np.int64
