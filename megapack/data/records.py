"""One JSON record (a parsed JSONL line) to one `Document`, and the error for a bad record.

Three record formats, detected per line from their keys (``format="auto"``) or forced:

    format               keys                              learned tokens
    "text"               {"text": str}                     every token (pretraining), eos
    "prompt_completion"  {"prompt": str, "completion": str} the completion's tokens, eos
    "chat"               {"messages": [{"role", "content"}]} assistant turns (see `ChatTemplate`)

Worked example with `ByteTokenizer` (eos 257) and ``append_eos=True``:

    {"text": "hi"}                        tokens [104, 105, 257]   loss_mask [1, 1, 1]
    {"prompt": "a", "completion": "b"}    tokens [97, 98, 257]     loss_mask [0, 1, 1]

Other keys (``id``, ``meta``, ...) are ignored. A line whose keys fit more than one format is
ambiguous and refused in auto mode. Every refusal is a `BadLineError` naming the file, the 1-based
line, the field (``messages[2].role``) and the value (truncated), with a hint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from megapack.data.chat import ChatTemplate
from megapack.data.document import Document
from megapack.data.tokenizers import Tokenizer

Format = Literal["auto", "text", "prompt_completion", "chat"]
FORMATS: tuple[str, ...] = ("auto", "text", "prompt_completion", "chat")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fields:
    """Which record keys (JSON keys, table columns) hold each part of a record.

    Example:
        rows ``{"question": ..., "answer": ...}`` read as prompt/completion:
        ``Fields(prompt="question", completion="answer")``.
    """

    text: str = "text"
    """The text of a "text" record."""
    prompt: str = "prompt"
    """The prompt of a "prompt_completion" record (context, not learned)."""
    completion: str = "completion"
    """The completion of a "prompt_completion" record (learned)."""
    messages: str = "messages"
    """The list of ``{"role", "content"}`` messages of a "chat" record."""
    tools: str = "tools"
    """A chat record's tools, passed to a model's own chat template (`HFChatTemplate`)."""

    def keys(self, kind: str) -> tuple[str, ...]:
        """The keys that identify format ``kind``."""
        return {
            "text": (self.text,),
            "prompt_completion": (self.prompt, self.completion),
            "chat": (self.messages,),
        }[kind]


DEFAULT_FIELDS = Fields()


class ModelChatTemplate(Protocol):
    """A chat template that renders whole conversations (`megapack.data.hf_chat.HFChatTemplate`)."""

    roles: tuple[str, ...]
    learned_roles: tuple[str, ...]

    def render(
        self, messages: Any, tokenizer: Any, *, tools: Any = None, where: str = ""
    ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]: ...


class BadLineError(ValueError):
    """A JSONL line that cannot become a document.

    The message reads ``"data.jsonl:17: field 'messages[1].role': unknown role, got 'robot'.
    Hint: ..."`` (``"data.jsonl:17: the line: invalid JSON, ..."`` for the line itself); the
    parts are kept as attributes for counting and logging.
    """

    def __init__(self, where: str, field: str, problem: str, value: Any, hint: str) -> None:
        self.where = where
        """``"path:line"``."""
        self.field = field
        """The offending field, ``"text"``, ``"messages[2].content"``, or ``"<line>"``."""
        self.problem = problem
        """A short reason (``"invalid JSON"``, ``"missing"``, ``"wrong type"``, ``"empty"``, ...),
        also the key of `ReaderStats.skipped_by_problem`."""
        self.value = value
        """The offending value (the raw line for invalid JSON)."""
        self.hint = hint
        """How to fix it."""
        what = "the line" if field == "<line>" else f"field {field!r}"
        super().__init__(f"{where}: {what}: {problem}, got {shorten(value)}. Hint: {hint}")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle with the parts (worker processes send bad rows back)."""
        return (type(self), (self.where, self.field, self.problem, self.value, self.hint))


def shorten(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def record_to_document(
    record: Any,
    *,
    where: str,
    tokenizer: Tokenizer,
    format: Format = "auto",
    append_eos: bool = True,
    chat_template: ChatTemplate | ModelChatTemplate | None = None,
    fields: Fields = DEFAULT_FIELDS,
) -> Document:
    """Turn one parsed JSON value into a Document; see the module docstring for the formats.

    Args:
        record: the value ``json.loads`` returned for the line.
        where: ``"path:line"``, used as the document's source and in errors.
        tokenizer: encodes the text fields.
        format: ``"auto"`` (detect from the keys) or one of ``"text"``, ``"prompt_completion"``,
            ``"chat"``.
        append_eos: end text and prompt/completion documents with ``tokenizer.eos_id`` (learned);
            chat documents end with eos when the template ends every turn with it, otherwise this
            appends one, learned when the last message's role is learned.
        chat_template: how chat messages are rendered (default `ChatTemplate()`); a model's own
            template (`HFChatTemplate`) renders the messages as given, tools included, and no eos
            is appended (the template ends the turns).
        fields: the keys holding each part (default: ``text``, ``prompt``, ...).

    Raises:
        BadLineError: the record does not fit the format.
    """
    if not isinstance(record, dict):
        raise BadLineError(where, "<line>", "not a JSON object", record, _FORMAT_HINT)
    kind = _detect(record, where, fields) if format == "auto" else format
    eos = [tokenizer.eos_id] if append_eos else []
    if kind == "text":
        ids = _encode(record, fields.text, where, tokenizer)
        return _document(ids + eos, [1.0] * (len(ids) + len(eos)), (), where)
    if kind == "prompt_completion":
        prompt = _encode(record, fields.prompt, where, tokenizer)
        completion = _encode(record, fields.completion, where, tokenizer)
        learned = [0.0] * len(prompt) + [1.0] * (len(completion) + len(eos))
        return _document(prompt + completion + eos, learned, (), where)
    template = chat_template if chat_template is not None else ChatTemplate()
    messages = _messages(record, where, template, fields.messages)
    if not isinstance(template, ChatTemplate):
        tools = record.get(fields.tools)
        tokens, mask, starts = template.render(
            record[fields.messages], tokenizer, tools=tools, where=where
        )
        return _document(tokens, mask, starts, where)
    tokens, mask, starts = template.render(messages, tokenizer)
    if append_eos and not template.eos_per_turn:
        last = 1.0 if messages[-1][0] in template.learned_roles else 0.0
        tokens, mask = np.append(tokens, tokenizer.eos_id), np.append(mask, np.float32(last))
    return _document(tokens, mask, starts, where)


_FORMAT_HINT = (
    'each line needs {"text": ...}, {"prompt": ..., "completion": ...} or '
    '{"messages": [{"role": ..., "content": ...}, ...]}'
)


def _detect(record: dict[str, Any], where: str, fields: Fields) -> str:
    kinds = ("text", "prompt_completion", "chat")
    found = [kind for kind in kinds if any(k in record for k in fields.keys(kind))]
    if len(found) > 1:
        raise BadLineError(
            where,
            "<line>",
            "ambiguous format",
            sorted(record),
            f"keys of {' and '.join(found)}: drop the extra keys or pass format=... to choose",
        )
    if not found:
        raise BadLineError(where, fields.text, "missing", sorted(record), _FORMAT_HINT)
    return found[0]


def _text(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise BadLineError(
            where,
            field,
            "wrong type",
            value,
            "text fields must be JSON strings",
        )
    if not value.strip():
        raise BadLineError(where, field, "empty", value, "drop the line or give it text")
    return value


def _encode(record: dict[str, Any], key: str, where: str, tokenizer: Tokenizer) -> list[int]:
    if key not in record:
        raise BadLineError(where, key, "missing", sorted(record), _FORMAT_HINT)
    ids = tokenizer.encode(_text(record[key], key, where))
    if not ids:
        raise BadLineError(where, key, "empty", record[key], "the text encodes to no tokens")
    return ids


def _messages(
    record: dict[str, Any], where: str, template: ChatTemplate | ModelChatTemplate, key: str
) -> list[tuple[str, str]]:
    if key not in record:
        raise BadLineError(where, key, "missing", sorted(record), _FORMAT_HINT)
    raw = record[key]
    if not isinstance(raw, list):
        raise BadLineError(
            where,
            key,
            "wrong type",
            raw,
            "messages must be a list of {role, content} objects",
        )
    if not raw:
        raise BadLineError(where, key, "empty", raw, "drop the line or give it messages")
    out = []
    for i, message in enumerate(raw):
        field = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise BadLineError(
                where,
                field,
                "wrong type",
                message,
                'each message is an object like {"role": "user", "content": "hi"}',
            )
        tool_call = message.get("tool_calls") is not None and not isinstance(template, ChatTemplate)
        for part in ("role",) if tool_call else ("role", "content"):
            if part not in message:
                raise BadLineError(
                    where,
                    f"{field}.{part}",
                    "missing",
                    sorted(message),
                    'each message is an object like {"role": "user", "content": "hi"}',
                )
        role = message["role"]
        if not isinstance(role, str):
            raise BadLineError(
                where,
                f"{field}.role",
                "wrong type",
                role,
                f"a role is a string, one of {', '.join(template.roles)}",
            )
        if role not in template.roles:
            raise BadLineError(
                where,
                f"{field}.role",
                "unknown role",
                role,
                f"use one of {', '.join(template.roles)} (or a ChatTemplate with other roles=)",
            )
        if tool_call and message.get("content") in (None, ""):
            out.append((role, ""))  # an assistant turn that only calls tools
        else:
            out.append((role, _text(message["content"], f"{field}.content", where)))
    if not any(role in template.learned_roles for role, _ in out):
        raise BadLineError(
            where,
            key,
            "nothing to learn",
            [role for role, _ in out],
            f"a conversation needs at least one {' or '.join(template.learned_roles)} message",
        )
    return out


def _document(tokens: Any, mask: Any, boundaries: tuple[int, ...], where: str) -> Document:
    return Document(
        tokens=np.asarray(tokens, dtype=np.int64),
        loss_mask=np.asarray(mask, dtype=np.float32),
        boundaries=boundaries,
        source=where,
    )
