"""`ChatTemplate`: how a list of chat messages becomes tokens, a loss mask and message boundaries.

Every message is rendered the same way, as three pieces tokenized separately and concatenated::

    header.format(role=role)   never learned            default "<|{role}|>\\n"
    content                    learned if role learned  the message text, verbatim
    footer [+ eos]             learned if role learned  default "\\n", then the tokenizer's eos id

So with the default template, ``[user "hi", assistant "yo"]`` renders (as text) to
``"<|user|>\\nhi\\n" EOS "<|assistant|>\\nyo\\n" EOS`` and only ``yo\\n EOS`` is learned: the model
learns the reply and to stop after it, never the user's words or the markers it is given. Markers are
tokenized as ordinary text, so the byte tokenizer needs no special tokens. The offset where each
message after the first starts is recorded as a document boundary.

With a HF tokenizer whose vocabulary has special tokens, a template written with them encodes each
marker to its single id (``tokenizers`` matches added tokens inside text):
``ChatTemplate.chatml()`` renders ``<|im_start|>user\\nhi<|im_end|>\\n`` with no extra eos, and
learns the assistant's content, ``<|im_end|>`` and the newline.

Why pieces and not one rendered string: tokenizing content separately keeps the mask exact (no
token straddles a header and a reply) and makes rendering deterministic per message. Cost: three
``encode`` calls per message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megapack.data.tokenizers import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatTemplate:
    """Per-message rendering of chat conversations; see the module docstring for a worked example.

    Example:
        >>> from megapack.data.tokenizers import ByteTokenizer
        >>> tokens, mask, bounds = ChatTemplate().render([("user", "hi"), ("assistant", "yo")],
        ...                                              ByteTokenizer())
        >>> len(tokens), mask.tolist()[-5:], bounds
        (31, [0.0, 1.0, 1.0, 1.0, 1.0], (13,))
    """

    header: str = "<|{role}|>\n"
    """Text before each message, ``{role}`` replaced by the role (``{{``/``}}`` for literal braces);
    never learned."""
    footer: str = "\n"
    """Text after each message's content; learned on learned roles."""
    eos_per_turn: bool = True
    """Append the tokenizer's eos id after every message (learned on learned roles), so the model
    learns to stop after its reply. False for templates whose footer already ends a turn."""
    roles: tuple[str, ...] = ROLES
    """Accepted roles; any other role is a bad line."""
    learned_roles: tuple[str, ...] = ("assistant",)
    """Roles whose content and footer (and eos) are learned."""

    def __post_init__(self) -> None:
        try:
            self.header.format(role="user")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"ChatTemplate.header {self.header!r} is not a valid format string ({e!r}); "
                "use {role} for the role and {{ }} for literal braces"
            ) from e
        unknown = [r for r in self.learned_roles if r not in self.roles]
        if unknown:
            raise ValueError(
                f"ChatTemplate.learned_roles has {unknown[0]!r}, which is not in roles={self.roles}"
            )

    @classmethod
    def chatml(cls) -> ChatTemplate:
        """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, no eos per turn."""
        return cls(header="<|im_start|>{role}\n", footer="<|im_end|>\n", eos_per_turn=False)

    def render(
        self, messages: Sequence[tuple[str, str]], tokenizer: Tokenizer
    ) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        """Tokens, loss mask and message starts of a conversation.

        Args:
            messages: ``(role, content)`` pairs, already checked by the reader (roles in
                ``self.roles``, non-empty content).
            tokenizer: encodes every piece; its ``eos_id`` ends each turn when ``eos_per_turn``.

        Returns:
            ``(tokens int64 [n], loss_mask float32 [n], boundaries)`` where boundaries are the
            offsets of every message after the first.
        """
        tokens: list[int] = []
        mask: list[float] = []
        starts: list[int] = []
        for role, content in messages:
            learned = 1.0 if role in self.learned_roles else 0.0
            header = tokenizer.encode(self.header.format(role=role))
            tail = tokenizer.encode(content) + tokenizer.encode(self.footer)
            if self.eos_per_turn:
                tail.append(tokenizer.eos_id)
            if tokens and header + tail:
                starts.append(len(tokens))
            tokens += header + tail
            mask += [0.0] * len(header) + [learned] * len(tail)
        return np.asarray(tokens, dtype=np.int64), np.asarray(mask, dtype=np.float32), tuple(starts)
