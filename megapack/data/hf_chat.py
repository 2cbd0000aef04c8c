"""`HFChatTemplate`: a model's own Jinja chat template, token-identical to ``apply_chat_template``.

A Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``, the template in
its ``chat_template`` key or in ``chat_template.jinja``) says how the model sees a conversation at
inference. Training on the same tokens means rendering with the same template, the same template
variables (``bos_token``, ``eos_token``, ... from ``tokenizer_config.json``, ``tools``) and the same
tokenization (the rendered text encoded once, no special tokens added), which is exactly what
``transformers``' ``tokenizer.apply_chat_template(messages, tokenize=True)`` does. The rendering itself
is transformers' own (``render_jinja_template``: its sandbox, filters, ``raise_exception`` and the
``{% generation %}`` tag), imported lazily; install it with ``pip install 'megapack[hf]'``.

Loss mask (assistant-only), in two ways:

* the template marks assistant text with ``{% generation %}...{% endgeneration %}``: those
  character spans are learned, mapped to tokens as transformers' ``assistant_masks`` maps them;
* otherwise, incremental rendering: for every assistant message ``i``, render ``messages[:i]`` with
  the generation prompt (``P``) and ``messages[:i + 1]`` (``Q``); the tokens from character
  ``len(P)`` to ``len(Q)`` of the whole rendering are learned: the reply and the turn's end marker,
  exactly what the model generates after the prompt. This needs a *prefix-stable* template
  (``P`` and ``Q`` are prefixes of the whole rendering); one that rewrites earlier turns (e.g.
  strips earlier reasoning) raises `ChatTemplateError` naming the message index and the fix.

Worked example, ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n``), ``[user "hi", assistant
"yo"]``: the text is ``<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\nyo<|im_end|>\\n``;
``P`` ends after ``<|im_start|>assistant\\n``, so ``yo<|im_end|>\\n`` is learned; the next message
(if any) starts at a boundary, a cut point for conversations longer than a row.

Unlike the built-in `ChatTemplate` (the documented fallback, e.g. for `ByteTokenizer`), no eos is
appended: the template decides how turns end. Cost: one render and one ``encode`` per
conversation, plus two renders per assistant turn without generation markers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from megapack.data.records import BadLineError
from megapack.data.tokenizers import HFTokenizer

HF_ROLES = ("system", "user", "assistant", "tool", "ipython", "developer")
NO_PREFIX_FIX = (
    "wrap the assistant content in the template with {% generation %}...{% endgeneration %} "
    "(transformers' assistant-mask markers), or use the built-in ChatTemplate "
    "(megapack pack --builtin-chat-template)"
)


class ChatTemplateError(ValueError):
    """The chat template cannot give an exact assistant mask for a conversation."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HFChatTemplate:
    """A Jinja chat template with its template variables; build it with `from_pretrained`.

    Example:
        >>> template = HFChatTemplate.from_pretrained("my-model/")  # doctest: +SKIP
        >>> tok = HFTokenizer.from_file("my-model/")  # doctest: +SKIP
        >>> ids, mask, starts = template.render([{"role": "user", "content": "hi"},
        ...                                      {"role": "assistant", "content": "yo"}], tok)  # doctest: +SKIP
    """

    source: str
    """The Jinja template text."""
    variables: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Template variables besides messages/tools: ``bos_token``, ``eos_token``, ... as strings."""
    roles: tuple[str, ...] = HF_ROLES
    """Roles the reader accepts; any other is a bad row."""
    learned_roles: tuple[str, ...] = ("assistant",)
    """Roles whose turns are learned (without generation markers: found by incremental rendering)."""
    path: str = "<memory>"
    """Where the template came from, for messages."""

    @property
    def has_generation_markers(self) -> bool:
        """Whether the template marks assistant text with ``{% generation %}``."""
        return re.search(r"{%-?\s*generation\s*-?%}", self.source) is not None

    @classmethod
    def from_pretrained(
        cls, directory: str | os.PathLike[str], *, name: str | None = None
    ) -> HFChatTemplate | None:
        """The chat template of a HF tokenizer directory, or None when it has none.

        Args:
            directory: holds ``tokenizer_config.json`` (and maybe ``chat_template.jinja``,
                which wins, as in transformers).
            name: for configs with several named templates; default ``"default"``.

        Raises:
            ValueError: the config is not JSON, or names no template ``name``.
        """
        folder = Path(directory)
        jinja = folder / "chat_template.jinja"
        config = _config(folder / "tokenizer_config.json")
        variables = {
            key: value.get("content") if isinstance(value, dict) else value
            for key, value in config.items()
            if key.endswith("_token") and isinstance(value, str | dict)
        }
        source: Any = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
        if source is None:
            source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {str(t.get("name")): t.get("template") for t in source if isinstance(t, dict)}
            wanted = name or "default"
            if wanted not in named:
                raise ValueError(
                    f"{folder}: no chat template named {wanted!r}; it has {sorted(named)}: "
                    "pass name=... (megapack pack --chat-template-name)"
                )
            source = named[wanted]
        if not isinstance(source, str):
            return None
        return cls(
            source=source,
            variables=MappingProxyType({k: v for k, v in variables.items() if v is not None}),
            path=str(jinja if jinja.is_file() else folder / "tokenizer_config.json"),
        )

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = False,
        markers: bool = False,
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and, with ``markers``, the ``{% generation %}`` character spans."""
        try:
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError as e:
            raise ImportError(
                "HFChatTemplate renders with transformers: pip install 'megapack[hf]' "
                "(or pip install transformers)"
            ) from e
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        result: Any = render_jinja_template(  # (texts, spans), annotated as str upstream
            conversations=[chat],
            tools=list(tools) if tools is not None else None,
            chat_template=self.source,
            return_assistant_tokens_mask=markers,
            add_generation_prompt=add_generation_prompt,
            **self.variables,
        )
        texts, spans = result
        return str(texts[0]), [(int(a), int(b)) for a, b in spans[0]] if markers else []

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tokenizer: HFTokenizer,
        *,
        tools: Sequence[Any] | None = None,
        where: str = "<memory>",
    ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        """Tokens (as ``apply_chat_template``), assistant loss mask and message starts.

        Args:
            messages: ``{"role", "content", ...}`` dicts, passed to the template as they are.
            tokenizer: an `HFTokenizer` (the one the template belongs to).
            tools: the conversation's ``tools`` field, if any.
            where: ``"file:row"`` for errors.

        Returns:
            ``(tokens int64 [n], loss_mask float32 [n], boundaries)``; boundaries are the tokens
            right after each learned span (without markers: the start of the message after each
            assistant turn), where `split_document` cuts a conversation longer than a row.

        Raises:
            TypeError: ``tokenizer`` is not an `HFTokenizer`.
            BadLineError: the template refuses the conversation (its ``raise_exception``).
            ChatTemplateError: no generation markers and the template is not prefix-stable.
        """
        tokenizer = getattr(tokenizer, "base", tokenizer)  # a reader's batch cache wraps it
        if not isinstance(tokenizer, HFTokenizer):
            raise TypeError(
                f"HFChatTemplate.render: tokenizer must be an HFTokenizer (the template's own), "
                f"got {type(tokenizer).__name__}; use ChatTemplate with other tokenizers"
            )
        from jinja2.exceptions import TemplateError

        try:
            text, spans = self.render_text(
                messages, tools=tools, markers=self.has_generation_markers
            )
            if not self.has_generation_markers:
                spans = self._incremental_spans(messages, tools, text, where)
        except TemplateError as e:
            roles = [m.get("role") for m in messages]
            raise BadLineError(
                where, "messages", "refused by the chat template", roles, f"{e} ({self.path})"
            ) from e
        encoding = tokenizer.backend.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=np.float32)
        for start, stop in spans:  # as transformers' assistant_masks: first to last token touched
            first, last = _char_to_token(offsets, start), _char_to_token(offsets, stop - 1)
            if first is None:
                break
            mask[first : (last + 1 if last is not None else len(ids))] = 1.0
        cuts = (stop for _, stop in spans)  # where a learned turn ends, the next part starts
        starts = sorted({t for c in cuts if 0 < (t := _first_token_at(offsets, c)) < len(ids)})
        return ids, mask, tuple(starts)

    def _incremental_spans(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        text: str,
        where: str,
    ) -> list[tuple[int, int]]:
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") not in self.learned_roles:
                continue
            from jinja2.exceptions import TemplateError

            try:
                prompt, _ = self.render_text(messages[:i], tools=tools, add_generation_prompt=True)
                turn, _ = self.render_text(messages[: i + 1], tools=tools)
            except TemplateError as e:
                raise BadLineError(
                    where,
                    f"messages[{i}]",
                    "refused by the chat template",
                    [m.get("role") for m in messages[: i + 1]],
                    f"rendering the conversation up to this assistant message (to find its tokens) "
                    f"failed: {e} ({self.path}); {NO_PREFIX_FIX}",
                ) from e
            for name, prefix in (
                (f"messages[:{i}] + generation prompt", prompt),
                (f"messages[:{i + 1}]", turn),
            ):
                if not text.startswith(prefix):
                    at = next(
                        (k for k, (a, b) in enumerate(zip(prefix, text, strict=False)) if a != b),
                        len(text),
                    )
                    raise ChatTemplateError(
                        f"{where}: chat template {self.path} is not prefix-stable at messages[{i}] "
                        f"(role {message.get('role')!r}): rendering {name} is not a prefix of the "
                        f"whole conversation's rendering (from character {at}: {prefix[at : at + 40]!r} "
                        f"vs {text[at : at + 40]!r}), so the assistant tokens cannot be found by "
                        f"incremental rendering. Fix: {NO_PREFIX_FIX}"
                    )
            if not turn.startswith(prompt):
                raise ChatTemplateError(
                    f"{where}: chat template {self.path} is not prefix-stable at messages[{i}]: the "
                    f"generation prompt is not followed by the assistant turn. Fix: {NO_PREFIX_FIX}"
                )
            spans.append((len(prompt), len(turn)))
        return spans


def _char_to_token(offsets: np.ndarray, char: int) -> int | None:
    """Index of the token whose ``[start, end)`` covers ``char`` (None when none does)."""
    hit = np.flatnonzero((offsets[:, 0] <= char) & (char < offsets[:, 1]))
    return int(hit[0]) if len(hit) else None


def _first_token_at(offsets: np.ndarray, char: int) -> int:
    """Index of the first token starting at or after ``char``."""
    return int(np.searchsorted(offsets[:, 0], char, side="left"))


def _config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); fix or remove it") from e
    return raw if isinstance(raw, dict) else {}
