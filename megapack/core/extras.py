"""A trainer's own fields in a `PackedBatch` (``extras``): built from documents, joined across rows.

`megapack.core.fields.BatchField` declares each one. In a PackedBatch a field per token is [1, T]
at the label positions (value j pairs with ``labels[j]``; 0 on padding), a field per sample is
[n, ...] and a ragged field [sum n_i, ...], both in document order. A per-token field declared
``at="token"`` (value i belongs to input token i, as a rollout gives log-probs) is shifted to the
label that predicts its token, as ``loss_mask`` is: value ``i + 1`` lands at position ``i``, and a
document's last position gets 0 (its label is padding); ``at="label"`` values are placed as given.
Worked example, documents of 3 and 2 tokens packed to seq_len 6, a per-token ``advantages``
(at="label"), a per-token ``logp`` (at="token") and a ragged ``pixel_values``:

    advantages    per document  [0.5, 0.5, 0.5], [-1.0, -1.0]
                  -> [[0.5, 0.5, 0.5, -1.0, -1.0, 0.0]]
    logp          per document  [a0, a1, a2], [b0, b1]
                  -> [[a1, a2, 0.0, b1, 0.0, 0.0]]          (labels: [t1, t2, P, u1, P, P])
    pixel_values  per document  [2, 4] and [0, 4] (no image)      -> [2, 4]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from megapack.core.fields import BatchField


def document_extras(
    docs: Sequence[Any],
    fields: Sequence[BatchField],
    starts: np.ndarray,
    lengths: np.ndarray,
    width: int,
) -> dict[str, torch.Tensor]:
    """The declared ``fields`` of dict documents ``docs``, laid out as `PackedBatch.extras`.

    Args:
        docs: the documents given to `PackedBatch.from_documents`; each a dict holding every
            declared field (a ragged field may be absent: no rows for that document).
        fields: the declarations; per "token": a sequence as long as the document's tokens,
            placed at the labels (shifted by one when declared ``at="token"``); per "sample":
            one value ([...]) per document; "ragged": a tensor [n_i, ...].
        starts, lengths: where each document's tokens start in the row, and how many.
        width: the row's length T.

    Raises:
        ValueError/TypeError: a missing value or a length, shape or dtype that breaks the
            declaration, naming the document and the field.
    """
    out: dict[str, torch.Tensor] = {}
    for f in fields:
        values = [_value(i, d, f) for i, d in enumerate(docs)]
        if f.per == "token":
            row = torch.zeros(1, width, dtype=f.dtype)
            for i, (v, start, n) in enumerate(zip(values, starts, lengths, strict=True)):
                assert v is not None  # _value raises for a missing per-token value
                if v.shape != (n,):
                    raise ValueError(
                        f"docs[{i}][{f.name!r}] has shape {tuple(v.shape)}; a per-token field has "
                        f"one value per token of the document ({n})"
                    )
                if f.at == "token":  # value i + 1 pairs with label i (token i + 1), as loss_mask
                    row[0, start : start + n - 1] = v[1:]
                else:
                    row[0, start : start + n] = v
            out[f.name] = row
        else:
            out[f.name] = join_rows(f, [_rows(i, v, f) for i, v in enumerate(values)])
    return out


def join_rows(field: BatchField, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """A field's values from several rows or documents (at least one) joined as one PackedBatch
    holds them: per token along the row (dim 1), per sample and ragged one after another (dim 0)."""
    if field.per == "token":
        return torch.cat(list(parts), dim=1)
    trailing = {tuple(p.shape[1:]) for p in parts if p.shape[0]}  # empty parts fit any
    if len(trailing) > 1:
        raise ValueError(
            f"{field.name!r} has values with trailing dims {sorted(trailing)}; every sample's "
            "[n_i, ...] must agree after n_i"
        )
    shape = trailing.pop() if trailing else tuple(parts[0].shape[1:])
    return torch.cat([p if p.shape[0] else p.reshape(0, *shape) for p in parts], dim=0)


def check_extras(extras: Any) -> None:
    """``PackedBatch.extras`` is a mapping of identifiers to tensors (declarations check the rest)."""
    if not isinstance(extras, Mapping):
        raise TypeError(f"PackedBatch.extras must be a dict, got {type(extras).__name__}")
    for name, value in extras.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"PackedBatch.extras key {name!r} is not a Python identifier")
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"PackedBatch.extras[{name!r}] must be a torch.Tensor, got {type(value).__name__}"
            )


def _value(index: int, doc: Any, field: BatchField) -> torch.Tensor | None:
    if not isinstance(doc, Mapping):
        raise TypeError(
            f"docs[{index}] is a {type(doc).__name__}; with fields= every document is a dict "
            f"holding its {field.name!r}"
        )
    raw = doc.get(field.name)
    if raw is None:
        if field.per == "ragged":
            return None
        raise ValueError(f"docs[{index}] has no {field.name!r}, declared in fields=")
    value = raw if isinstance(raw, torch.Tensor) else torch.as_tensor(np.asarray(raw))
    if value.dtype != field.dtype:
        if isinstance(raw, torch.Tensor):
            raise TypeError(
                f"docs[{index}][{field.name!r}] has dtype {value.dtype} but fields= declares "
                f"{field.dtype} (values travel bit-exact, never converted)"
            )
        value = value.to(field.dtype)  # Python numbers: take the declared dtype
    return value


def _rows(index: int, value: torch.Tensor | None, field: BatchField) -> torch.Tensor:
    """One document's rows of a per-sample ([1, ...]) or ragged ([n_i, ...]) field."""
    if field.per == "sample":
        assert value is not None  # _value raises for a missing per-sample value
        return value[None]
    if value is None:
        return torch.empty(0, dtype=field.dtype)
    if value.dim() == 0:
        raise ValueError(f"docs[{index}][{field.name!r}] is a scalar; a ragged field is [n_i, ...]")
    return value
