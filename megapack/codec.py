"""Which pieces a stage's per-token fields become on the wire: the lean forms of `megapack.lean`, chosen per batch.

The source picks, for every batch, the leanest exact form of each per-token ("grid") field the
stage returns and says which in the header's ``codec`` flags; `grid_pieces` turns the flags into
the list of pieces (name, dtype, shape) that both ends walk, so sender and receivers cannot
disagree on the layout. Receivers rebuild the fields (`expand`) bit-identical to what the source
would have sent in full: int64 tokens, labels and position_ids, float32 loss_mask.

    piece          dtype          shape             sent when
    tokens         int32 / int64  [rows, cols]      the stage returns tokens, or labels are a shift
    position_ids   int64          [rows, cols]      returned and not the standard positions
    labels         int64          [rows, cols]      returned and not a shift of the tokens
    label_at       int32          [exceptions]      returned, a shift: where it is wrong ...
    label_value    int64          [exceptions]      ... and the labels there
    loss_mask      float32        [rows, cols]      returned and not all 0.0 / 1.0
    loss_bits      uint8          [ceil(n / 8)]     returned, all 0.0 / 1.0, not the standard mask
    (nothing)                                       returned, the standard mask: every real
                                                    token but each document's last (packed)

The standard positions restart at every buffer segment (``cu_seqlens_padded``, else
``cu_seqlens``), or count 0..s-1 in every row of a plain [b, s] batch, and with context
parallelism are taken at the CP rank's share (`megapack.cp.cp_indices`), so a CP rank's
receivers rebuild its share's positions from the whole row's boundaries.

Bytes for a 4,096-token SFT row on the only stage: 114,736 (Megatron's tensors) -> about 17 KB.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megapack import lean
from megapack.cp import CP_LAYOUTS, CpLayout, cp_indices
from megapack.inputs import Layout


class Lean:
    """The ``codec`` flags of a header (bits of a plain int): which lean forms the payload uses."""

    TOKENS_INT32 = 1
    POSITIONS_DERIVED = 2
    LABELS_SHIFTED = 4
    MASK_BITS = 8
    MASK_DERIVED = 16


@dataclass(frozen=True, slots=True)
class Share:
    """Which positions of the row a rank's grid fields hold: all (cp 1) or a CP rank's share."""

    cp_size: int = 1
    """Context-parallel size."""
    cp_rank: int = 0
    """This rank's index in its CP group."""
    layout: CpLayout = "document"
    """How packed rows are split over CP ranks (plain [b, s] rows always split as one span)."""

    @property
    def layout_code(self) -> int:
        return CP_LAYOUTS.index(self.layout)


def grid_pieces(
    present: frozenset[str], flags: int, exceptions: int, rows: int, cols: int
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The grid fields' pieces in wire order (see the module table)."""
    grid = (rows, cols)
    pieces: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    if "tokens" in present or ("labels" in present and flags & Lean.LABELS_SHIFTED):
        pieces.append(("tokens", torch.int32 if flags & Lean.TOKENS_INT32 else torch.int64, grid))
    if "position_ids" in present and not flags & Lean.POSITIONS_DERIVED:
        pieces.append(("position_ids", torch.int64, grid))
    if "labels" in present and flags & Lean.LABELS_SHIFTED:
        pieces += [
            ("label_at", torch.int32, (exceptions,)),
            ("label_value", torch.int64, (exceptions,)),
        ]
    elif "labels" in present:
        pieces.append(("labels", torch.int64, grid))
    if "loss_mask" in present and flags & Lean.MASK_DERIVED:
        pass  # rebuilt from the boundaries: no bytes
    elif "loss_mask" in present and flags & Lean.MASK_BITS:
        pieces.append(("loss_bits", torch.uint8, (-(-rows * cols // 8),)))
    elif "loss_mask" in present:
        pieces.append(("loss_mask", torch.float32, grid))
    return pieces


def compact(
    layout: Layout,
    tensors: Mapping[str, torch.Tensor | None],
    present: frozenset[str],
    share: Share,
    *,
    enabled: bool = True,
) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(codec flags, label exceptions, grid pieces by name) for the stage's ``present`` fields.

    ``tensors`` are the normalized fields (after the CP share), with ``tokens`` present whenever
    ``labels`` are (the label base). ``enabled=False`` sends every field in full (today's
    encoding, kept for comparison).
    """
    flags, exceptions, pieces = 0, 0, {}
    tokens = tensors.get("tokens")
    labels = tensors.get("labels") if "labels" in present else None
    narrow = None
    if enabled and tokens is not None and ("tokens" in present or labels is not None):
        narrow = lean.narrow(as_dtype(tokens, torch.int64))
    if enabled and labels is not None and tokens is not None:
        found = lean.shift_exceptions(as_dtype(labels, torch.int64), as_dtype(tokens, torch.int64))
        if found is not None:
            n, token_bytes = labels.numel(), (4 if narrow is not None else 8) * labels.numel()
            shift = _aligned(4 * found[0].numel()) + 8 * found[0].numel()
            shift += 0 if "tokens" in present else _aligned(token_bytes)
            if shift < 8 * n:  # the shift must pay for itself (and for the tokens, on LAST)
                flags |= Lean.LABELS_SHIFTED
                pieces["label_at"], pieces["label_value"] = found
                exceptions = int(found[0].numel())
    if labels is not None and not flags & Lean.LABELS_SHIFTED:
        pieces["labels"] = labels
    if tokens is not None and ("tokens" in present or flags & Lean.LABELS_SHIFTED):
        flags |= Lean.TOKENS_INT32 if narrow is not None else 0
        pieces["tokens"] = narrow if narrow is not None else tokens
    positions = tensors.get("position_ids") if "position_ids" in present else None
    if positions is not None:
        if enabled and _standard(layout, tensors, positions, share):
            flags |= Lean.POSITIONS_DERIVED
        else:
            pieces["position_ids"] = positions
    mask = tensors.get("loss_mask") if "loss_mask" in present else None
    if mask is not None and enabled and _standard_mask(layout, tensors, mask, share):
        flags |= Lean.MASK_DERIVED
    elif mask is not None:
        bits = lean.pack_bits(as_dtype(mask, torch.float32)) if enabled else None
        flags |= Lean.MASK_BITS if bits is not None else 0
        pieces["loss_mask" if bits is None else "loss_bits"] = mask if bits is None else bits
    return flags, exceptions, pieces


def expand(
    views: Mapping[str, torch.Tensor],
    present: frozenset[str],
    flags: int,
    layout: Layout,
    bounds: Mapping[str, torch.Tensor | None],
    rows: int,
    cols: int,
    share: Share,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The stage's grid fields rebuilt from the received pieces (`grid_pieces`), bit-identical."""
    out: dict[str, torch.Tensor] = {}
    tokens = views.get("tokens")
    if tokens is not None and flags & Lean.TOKENS_INT32:
        tokens = lean.widen(tokens)
    if "tokens" in present and tokens is not None:
        out["tokens"] = tokens
    if "position_ids" in present:
        out["position_ids"] = (
            _reference(layout, bounds, rows, cols, share, device)
            if flags & Lean.POSITIONS_DERIVED
            else views["position_ids"]
        )
    if "labels" in present:
        out["labels"] = (
            lean.apply_shift(tokens, views["label_at"], views["label_value"])
            if flags & Lean.LABELS_SHIFTED and tokens is not None
            else views["labels"]
        )
    if "loss_mask" in present and flags & Lean.MASK_DERIVED:
        out["loss_mask"] = _mask_reference(bounds, cols, share, device)
    elif "loss_mask" in present:
        out["loss_mask"] = (
            lean.unpack_bits(views["loss_bits"], rows, cols)
            if flags & Lean.MASK_BITS
            else views["loss_mask"]
        )
    return out


def _standard_mask(
    layout: Layout, fields: Mapping[str, torch.Tensor | None], mask: torch.Tensor, share: Share
) -> bool:
    """Whether a packed ``mask`` is, bit for bit, the standard mask receivers rebuild
    (`_mask_reference`): -0.0 is not 0.0 here, so the rebuilt mask is always identical."""
    if layout != Layout.PACKED or fields.get("cu_seqlens") is None or mask.dtype != torch.float32:
        return False
    reference = _mask_reference(fields, mask.shape[1], share, mask.device)
    return reference.shape == mask.shape and torch.equal(
        mask.view(torch.int32), reference.view(torch.int32)
    )


def _mask_reference(
    fields: Mapping[str, torch.Tensor | None], cols: int, share: Share, device: torch.device
) -> torch.Tensor:
    """The standard mask (`megapack.lean.standard_mask`) of this rank's [1, cols] share of the row."""
    cu = fields.get("cu_seqlens")
    if cu is None:
        raise ValueError("a packed batch without cu_seqlens has no standard loss mask")
    padded = fields.get("cu_seqlens_padded")
    full = cols * share.cp_size
    mask = lean.standard_mask(cu.to(device), None if padded is None else padded.to(device), full)
    if share.cp_size == 1:
        return mask
    bounds = padded if padded is not None else cu
    index = cp_indices(bounds, share.cp_size, share.cp_rank, layout=share.layout, total=full)
    return mask.index_select(1, index.to(device))


def _standard(
    layout: Layout,
    fields: Mapping[str, torch.Tensor | None],
    positions: torch.Tensor,
    share: Share,
) -> bool:
    """Whether ``positions`` are the standard positions receivers rebuild (`_reference`)."""
    bounds = fields.get("cu_seqlens_padded")
    bounds = bounds if bounds is not None else fields.get("cu_seqlens")
    if layout == Layout.PACKED and share.cp_size == 1 and bounds is not None:
        fast = lean.restarts_at(positions, bounds)  # no reference built: two passes, not five
        if fast is not None:
            return fast
    rows, cols = positions.shape
    reference = _reference(layout, fields, rows, cols, share, positions.device)
    return torch.equal(as_dtype(positions, torch.int64), reference)


def _reference(
    layout: Layout,
    fields: Mapping[str, torch.Tensor | None],
    rows: int,
    cols: int,
    share: Share,
    device: torch.device,
) -> torch.Tensor:
    """The standard positions of this rank's [rows, cols] grid (see the module docstring)."""
    full = cols * share.cp_size
    if layout == Layout.PLAIN:
        if share.cp_size == 1:
            empty = torch.empty(0, dtype=torch.int32, device=device)
            return lean.standard_positions(empty, rows, cols)
        return _row_share(full, share, device).expand(rows, cols).contiguous()
    padded = fields.get("cu_seqlens_padded")
    bounds = padded if padded is not None else fields.get("cu_seqlens")
    if bounds is None:
        raise ValueError("a packed batch without cu_seqlens has no standard positions")
    positions = lean.standard_positions(bounds, 1, full)
    if share.cp_size == 1:
        return positions
    index = cp_indices(bounds, share.cp_size, share.cp_rank, layout=share.layout, total=full)
    return positions.index_select(1, index.to(positions.device))


def _row_share(full: int, share: Share, device: torch.device) -> torch.Tensor:
    """CP rank's zigzag positions of a plain row of ``full`` tokens: chunks r and 2cp-1-r of 2cp.

    Built with ``arange`` on the device (no host-to-device copy); equals
    ``cp_indices([0, full], cp, r, layout="row")``.
    """
    chunk = full // (2 * share.cp_size)
    first = share.cp_rank * chunk
    second = (2 * share.cp_size - 1 - share.cp_rank) * chunk
    return torch.cat(
        [
            torch.arange(first, first + chunk, device=device),
            torch.arange(second, second + chunk, device=device),
        ]
    )


def _aligned(nbytes: int) -> int:
    """Bytes a piece takes on the wire: 8-byte aligned."""
    return nbytes + (-nbytes % 8)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, without a call into torch when it already is (the usual case)."""
    return t if t.dtype == dtype else t.to(dtype)
