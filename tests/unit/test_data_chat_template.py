"""A model's own chat template (HFChatTemplate): token identity with transformers' apply_chat_template,
exact assistant masks, and the prefix-stability error. Tokenizers are trained here (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megapack.data import HFTokenizer, read_jsonl
from megapack.data.hf_chat import ChatTemplateError, HFChatTemplate
from megapack.data.records import BadLineError

pytest.importorskip("transformers", reason="install megapack[test] (transformers) to run these")

SPECIALS = [
    "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
]  # fmt: skip
CORPUS = [
    "You are a helpful assistant.",
    "What is the capital of France? The capital of France is Paris.",
    "hi there, how are you today? I am fine, thank you very much.",
    "user assistant system tool get_weather city temperature",
    '{"name": "get_weather", "parameters": {"city": "string"}}',
    "[INST] tell me a joke [/INST] Why did the chicken cross the road?",
]

CHATML = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for t in tools %}{{ t | tojson + '\\n' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_BODY = (
    "{{ bos_token }}{%- for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if m['role'] == 'assistant' %}GEN_OPEN{{ m['content'] | trim + '<|eot_id|>' }}GEN_CLOSE"
    "{%- else %}{{ m['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
LLAMA3 = LLAMA3_BODY.replace("GEN_OPEN", "").replace("GEN_CLOSE", "")
LLAMA3_MARKED = LLAMA3_BODY.replace("GEN_OPEN", "{% generation %}").replace(
    "GEN_CLOSE", "{% endgeneration %}"
)
MISTRAL = (
    "{{ bos_token }}{%- for m in messages %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{%- else %}{{ ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}"
)
UNSTABLE = (  # marks every turn but the last: earlier turns render differently once a turn follows
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{%- if not loop.last %}{{ ' (earlier)' }}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "hi there, how are you today?"},
    {"role": "assistant", "content": "I am fine, thank you very much."},
]
NO_SYSTEM = CHAT[1:]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"city": "string"}}}
]


def make_model(folder: Path, template: str, bos: str, eos: str) -> Path:
    """Train a small byte-level BPE tokenizer and write a HF tokenizer directory with ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rust = Tokenizer(models.BPE(unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rust.train_from_iterator(CORPUS * 5, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    rust.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": "<unk>",
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def reference(folder: Path, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return {"input_ids": list(out["input_ids"]), "assistant_masks": out.get("assistant_masks")}


def learned_text(folder: Path, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded runs of learned tokens, specials kept."""
    tok = HFTokenizer.from_file(folder)
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.backend.decode(r, skip_special_tokens=False) for r in runs]


FAMILIES = {
    "chatml": (CHATML, "<s>", "<|im_end|>", ["The capital of France is Paris.<|im_end|>\n",
                                             "I am fine, thank you very much.<|im_end|>\n"]),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ["The capital of France is Paris.<|eot_id|>",
                                                          "I am fine, thank you very much.<|eot_id|>"]),
    "mistral": (MISTRAL, "<s>", "</s>", [" The capital of France is Paris.</s>",
                                        " I am fine, thank you very much.</s>"]),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chat_template_tokens_match_apply_chat_template(tmp_path: Path, family: str) -> None:
    template_text, bos, eos, expected_learned = FAMILIES[family]
    folder = make_model(tmp_path / family, template_text, bos, eos)
    template = HFChatTemplate.from_pretrained(folder)
    assert template is not None and not template.has_generation_markers
    tok = HFTokenizer.from_file(folder)
    messages = NO_SYSTEM if family == "mistral" else CHAT
    ids, mask, starts = template.render(messages, tok)
    assert ids.tolist() == reference(folder, messages)["input_ids"]
    assert learned_text(folder, ids, mask) == expected_learned  # every assistant turn, nothing else
    tok_text = [
        tok.backend.decode(ids[b : b + 3].tolist(), skip_special_tokens=False) for b in starts
    ]
    assert len(starts) == 1  # after the first reply (the second ends the conversation)
    assert "user" in tok_text[0] or tok_text[0].startswith("[INST")  # the next message starts there


def test_chat_template_system_prompt_tools_and_generation_prompt(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "chatml", CHATML, "<s>", "<|im_end|>")
    template = HFChatTemplate.from_pretrained(folder)
    assert template is not None
    tok = HFTokenizer.from_file(folder)
    for messages in (NO_SYSTEM, CHAT):  # default system prompt added only without a system message
        for tools in (None, TOOLS):
            ids, mask, _ = template.render(messages, tok, tools=tools)
            assert ids.tolist() == reference(folder, messages, tools=tools)["input_ids"]
            assert learned_text(folder, ids, mask) == FAMILIES["chatml"][3]
    prompt, _ = template.render_text(NO_SYSTEM[:1], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert (
        tok.encode(prompt)
        == reference(folder, NO_SYSTEM[:1], add_generation_prompt=True)["input_ids"]
    )


def test_chat_template_generation_markers_match_transformers_mask(tmp_path: Path) -> None:
    marked = make_model(tmp_path / "marked", LLAMA3_MARKED, "<|begin_of_text|>", "<|eot_id|>")
    plain = make_model(tmp_path / "plain", LLAMA3, "<|begin_of_text|>", "<|eot_id|>")
    with_markers = HFChatTemplate.from_pretrained(marked)
    incremental = HFChatTemplate.from_pretrained(plain)
    assert with_markers is not None and with_markers.has_generation_markers
    assert incremental is not None
    tok = HFTokenizer.from_file(marked)
    ids, mask, _ = with_markers.render(CHAT, tok)
    ref = reference(marked, CHAT, return_assistant_tokens_mask=True)
    assert ids.tolist() == ref["input_ids"]
    assert mask.astype(int).tolist() == list(ref["assistant_masks"])
    ids2, mask2, _ = incremental.render(CHAT, tok)  # the two ways agree
    assert ids2.tolist() == ids.tolist() and mask2.tolist() == mask.tolist()


def test_chat_template_not_prefix_stable_names_the_message(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "unstable", UNSTABLE, "<s>", "<|im_end|>")
    template = HFChatTemplate.from_pretrained(folder)
    assert template is not None
    with pytest.raises(ChatTemplateError, match=r"not prefix-stable at messages\[2\].*generation"):
        template.render(CHAT, HFTokenizer.from_file(folder), where="chat.jsonl:1")


def test_chat_template_refusal_is_a_bad_row_and_jsonl_reads_tools(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "m", MISTRAL, "<s>", "</s>")
    chatml = make_model(tmp_path / "c", CHATML, "<s>", "<|im_end|>")
    data = tmp_path / "chat.jsonl"
    rows = [
        {"messages": NO_SYSTEM},
        {"messages": [NO_SYSTEM[1], NO_SYSTEM[0]]},  # starts with the assistant: Mistral refuses
        {"messages": NO_SYSTEM, "tools": TOOLS},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = HFChatTemplate.from_pretrained(folder)
    reader = read_jsonl(data, HFTokenizer.from_file(folder), chat_template=template)
    with pytest.raises(
        BadLineError,
        match=r"chat.jsonl:2: field 'messages': refused by the chat template.*alternate",
    ):
        list(reader)
    reader = read_jsonl(data, HFTokenizer.from_file(folder), chat_template=template, skip_bad=True)
    assert len(list(reader)) == 2 and reader.stats.skipped == 1
    tok = HFTokenizer.from_file(chatml)
    reader = read_jsonl(
        data, tok, chat_template=HFChatTemplate.from_pretrained(chatml), skip_bad=True
    )
    docs = list(reader)  # ChatML renders row 2, but not the empty prefix before its first reply
    assert len(docs) == 2 and "messages[0]" in reader.stats.first_errors[0]
    assert docs[1].tokens.tolist() == reference(chatml, NO_SYSTEM, tools=TOOLS)["input_ids"]
    assert docs[0].tokens.tolist() == reference(chatml, NO_SYSTEM)["input_ids"]  # no eos appended


def test_chat_template_needs_an_hf_tokenizer_and_reads_jinja_files(tmp_path: Path) -> None:
    from megapack.data import ByteTokenizer

    folder = make_model(tmp_path / "c", CHATML, "<s>", "<|im_end|>")
    template = HFChatTemplate.from_pretrained(folder)
    assert template is not None
    with pytest.raises(TypeError, match=r"tokenizer must be an HFTokenizer.*got ByteTokenizer"):
        template.render(CHAT, ByteTokenizer())  # type: ignore[arg-type]
    (folder / "chat_template.jinja").write_text(LLAMA3)  # transformers' newer layout wins
    jinja = HFChatTemplate.from_pretrained(folder)
    assert jinja is not None and jinja.source == LLAMA3
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink()
    assert HFChatTemplate.from_pretrained(folder) is None  # no template: the built-in fallback


def test_chat_template_cli_tokenizer_directory(tmp_path: Path) -> None:
    from megapack.cli import main
    from megapack.data import PackedDataset

    folder = make_model(tmp_path / "c", CHATML, "<s>", "<|im_end|>")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    for flags, out in (([], "own"), (["--builtin-chat-template"], "builtin")):
        argv = ["pack", str(data), "--seq-len", "256", "--tokenizer", str(folder), "--out"]
        assert main([*argv, str(tmp_path / out), *flags]) == 0
    own = PackedDataset.load(tmp_path / "own")
    builtin = PackedDataset.load(tmp_path / "builtin")
    expected = reference(folder, CHAT)["input_ids"]
    assert own[0].tokens[0, : len(expected)].tolist() == expected
    assert builtin[0].tokens[0, : len(expected)].tolist() != expected
    assert main(["pack", str(data), "--seq-len", "256", "--out", str(tmp_path / "x"),
                 "--tokenizer", str(folder / "tokenizer.json")]) == 0  # fmt: skip
