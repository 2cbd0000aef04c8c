"""Lean encodings of a batch's per-token fields: send the information, not the int64 bytes.

Each codec is exact: decoding gives back bit-identical tensors (values, dtype, shape), or the
encoder says "no" and the field travels as it is. Shapes are [rows, cols] grids (THD: rows == 1).

================  ===========================================  ================================
field             lean form                                    falls back when
================  ===========================================  ================================
tokens            int32 (`narrow`)                             an id does not fit in int32
position_ids      nothing: rebuilt from the segment bounds     they are not the standard
                  (`standard_positions`)                       per-segment positions
labels            "tokens shifted by one" + the positions      more than 1/16 of the positions
                  where that is wrong, with their values       differ (not a shift at all)
                  (`shift_exceptions`): O(documents)
loss_mask         nothing: rebuilt from the boundaries         it is not "every real token but
                  (`standard_mask`)                            each document's last"
                  else one bit per position (`pack_bits`)      a value other than 0.0 or 1.0
================  ===========================================  ================================

Worked example, documents [3, 2, 4] as in `megapack.batch` (P = pad id, Q = the first token of
the next document)::

    tokens           [a, b, c, d, e, f, g, h, i]
    labels           [b, c, P, e, P, g, h, i, P]
    shifted tokens   [b, c, d, e, f, g, h, i, -]   -> exceptions at [2, 4, 8] with values [P, P, P]
    loss_mask        [1, 1, 0, 1, 0, 1, 1, 1, 0]   -> bytes 0b11101011, 0b0 (bit i = position i)
    segments         [0, 3, 5, 9]                  -> positions [0, 1, 2, 0, 1, 0, 1, 2, 3]

CPU tensors go through numpy (a few microseconds per 4,096 tokens; the same torch ops cost 5-50x
more on small CPU tensors); CUDA tensors through torch, without host synchronization.
"""

from __future__ import annotations

import numpy as np
import torch

INT32 = torch.iinfo(torch.int32)
MAX_EXCEPTION_SHARE = 16
"""Labels are sent as a shift while at most 1/16 of the positions (and at least 16) differ."""


def narrow(tokens: torch.Tensor) -> torch.Tensor | None:
    """``tokens`` (int64) as int32 when every value fits, else None.

    Example: ``narrow(torch.tensor([[5, 70000]]))`` is ``tensor([[5, 70000]], dtype=torch.int32)``.
    """
    if tokens.numel() == 0:
        return tokens.to(torch.int32)
    if _host(tokens):
        t = tokens.numpy()
        if t.min() < INT32.min or t.max() > INT32.max:
            return None
        return torch.from_numpy(t.astype(np.int32))
    low, high = torch.aminmax(tokens)  # a host sync: only on a source with CUDA input
    if int(low) < INT32.min or int(high) > INT32.max:
        return None
    return tokens.to(torch.int32)


def widen(tokens: torch.Tensor) -> torch.Tensor:
    """int32 tokens back to int64 (the dtype every rank returns)."""
    if _host(tokens):
        return torch.from_numpy(tokens.numpy().astype(np.int64))
    return tokens.to(torch.int64)


def standard_positions(bounds: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] int64 positions that restart at 0 at every segment start of the buffer.

    Args:
        bounds: 1-D cumulative segment starts over all ``rows * cols`` positions, from 0 to the
            end (``cu_seqlens_padded`` when set, else ``cu_seqlens``); None-like empty for plain
            [b, s] batches, whose rows each count 0..s-1.
        rows, cols: the grid's shape.

    Example: bounds [0, 3, 5, 9] -> [[0, 1, 2, 0, 1, 0, 1, 2, 3]].
    """
    total = rows * cols
    if bounds.numel() == 0:  # plain batch: every row is one sequence
        if _host(bounds):
            return torch.from_numpy(np.tile(np.arange(cols, dtype=np.int64), (rows, 1)))
        return torch.arange(cols, device=bounds.device).expand(rows, cols).contiguous()
    if _host(bounds):
        b = bounds.numpy()
        if b[-1] == total:  # the usual case: one repeat, no scatter
            starts = np.repeat(b[:-1], b[1:] - b[:-1])
        else:
            b = b.astype(np.int64)
            inner = b[1:-1][b[1:-1] < total]
            starts = np.zeros(total, dtype=np.int64)
            starts[inner] = inner
            np.maximum.accumulate(starts, out=starts)
        return torch.from_numpy(np.arange(total, dtype=np.int64) - starts).view(rows, cols)
    # bounds end at the buffer's end; clamping instead of filtering needs no host sync
    inner_t = bounds[1:-1].to(torch.int64).clamp(max=total - 1)
    starts_t = torch.zeros(total, dtype=torch.int64, device=bounds.device)
    starts_t.scatter_(0, inner_t, inner_t)
    starts_t = torch.cummax(starts_t, 0).values
    return (torch.arange(total, device=bounds.device) - starts_t).view(rows, cols)


def restarts_at(positions: torch.Tensor, bounds: torch.Tensor) -> bool | None:
    """Whether host [1, T] ``positions`` equal `standard_positions` of ``bounds``; None: not decided
    here (a device tensor, or bounds that do not end at T: compare with the reference instead).

    Standard means 0 at every segment start and +1 everywhere else, which one difference pass
    checks without building the reference. Example: bounds [0, 3, 5], positions [[0, 1, 2, 0, 1]]
    -> differences [1, 1, -2, 1], starts [0, 3]: True.
    """
    if not _host(positions, bounds) or positions.shape[0] != 1:
        return None
    b, p = bounds.numpy(), positions.numpy()[0]
    if len(b) < 2 or b[0] != 0 or b[-1] != p.size or p.size == 0:
        return None
    if p.dtype != np.int64:
        return None
    starts = b[:-1][b[:-1] < p.size]
    if (p[starts] != 0).any():
        return False
    steps = p[1:] - p[:-1]
    steps[starts[starts > 0] - 1] = 1  # the drop into each later segment's 0 (checked above)
    return bool((steps == 1).all())


def standard_mask(
    cu_seqlens: torch.Tensor, padded: torch.Tensor | None, total: int
) -> torch.Tensor:
    """[1, total] float32: 1.0 at every real token of each document but its last, 0.0 elsewhere.

    Document i's real tokens start at ``padded[i]`` (``cu_seqlens[i]`` without padding) and
    number ``cu_seqlens[i + 1] - cu_seqlens[i]``; padding, and each document's last token (its
    label is the next document's or a pad id), are 0.0. Pretraining-style packing trains on
    exactly these tokens; SFT masks (prompts at 0.0) are not this and travel as bits.

    Example: cu_seqlens [0, 3, 5], padded [0, 4, 8], total 8 -> [[1, 1, 0, 0, 1, 0, 0, 0]].
    Boundaries that run past ``total`` (not this row's) give a mask no batch equals, not an error.
    """
    starts_of = padded if padded is not None else cu_seqlens
    if _host(cu_seqlens, starts_of):
        cu = cu_seqlens.numpy().astype(np.int64)
        starts = starts_of.numpy()[:-1].astype(np.int64)
        ends = starts + (cu[1:] - cu[:-1]) - 1
        steps = np.zeros(total + 1, dtype=np.int32)  # boundaries past ``total`` land in the spare
        steps[np.minimum(starts, total)] += 1
        steps[np.minimum(ends, total)] -= 1  # a one-token document: +1 - 1 at its start
        return torch.from_numpy(np.cumsum(steps[:total]).astype(np.float32)).view(1, total)
    cu_t = cu_seqlens.to(torch.int64)
    starts_t = starts_of[:-1].to(torch.int64)
    ones = torch.ones_like(starts_t, dtype=torch.int32)
    steps_t = torch.zeros(total + 1, dtype=torch.int32, device=cu_seqlens.device)
    steps_t.index_add_(0, starts_t.clamp(max=total), ones)
    steps_t.index_add_(0, (starts_t + (cu_t[1:] - cu_t[:-1]) - 1).clamp(max=total), -ones)
    return steps_t[:total].cumsum(0).to(torch.float32).view(1, total)


def shift_exceptions(
    labels: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where ``labels`` differ from ``tokens`` shifted left by one (within each row), or None.

    Returns (flat positions int32, label values int64 there); the last position of every row
    is always an exception (no next token). None when more than 1/16 of the positions (and
    more than 16) differ: then the labels are sent as they are.
    """
    rows, cols = labels.shape
    if _host(labels, tokens):
        lab, tok = labels.numpy(), tokens.numpy()
        if rows == 1:  # THD: one comparison, then the row's end
            where = np.append(np.flatnonzero(lab[0, :-1] != tok[0, 1:]), cols - 1)
        else:
            differ = np.ones((rows, cols), dtype=bool)
            np.not_equal(lab[:, :-1], tok[:, 1:], out=differ[:, :-1])
            where = np.flatnonzero(differ)
        if len(where) > max(MAX_EXCEPTION_SHARE, labels.numel() // MAX_EXCEPTION_SHARE):
            return None
        return torch.from_numpy(where.astype(np.int32)), torch.from_numpy(lab.reshape(-1)[where])
    differ_t = torch.ones((rows, cols), dtype=torch.bool, device=labels.device)
    torch.ne(labels[:, :-1], tokens[:, 1:], out=differ_t[:, :-1])
    where_t = differ_t.view(-1).nonzero().view(-1)  # a host sync: only on a source with CUDA input
    if where_t.numel() > max(MAX_EXCEPTION_SHARE, labels.numel() // MAX_EXCEPTION_SHARE):
        return None
    return where_t.to(torch.int32), labels.reshape(-1)[where_t]


def apply_shift(tokens: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Labels rebuilt from int64 ``tokens`` and `shift_exceptions`' (positions, values)."""
    if _host(tokens):
        tok = tokens.numpy()
        out = np.empty_like(tok)
        out[:, :-1] = tok[:, 1:]
        out.reshape(-1)[where.numpy()] = values.numpy()
        return torch.from_numpy(out)
    labels = torch.empty_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    labels.view(-1).index_copy_(0, where.to(torch.int64), values)
    return labels


def pack_bits(mask: torch.Tensor) -> torch.Tensor | None:
    """A float32 mask of exact 0.0 / 1.0 as uint8 bits (little-endian per byte), else None.

    ``-0.0`` and any other value return None, so decoding is always bit-identical.
    """
    if _host(mask):
        m = mask.numpy().reshape(-1)
        ones = m == 1.0
        if not (ones | (m.view(np.int32) == 0)).all():
            return None
        return torch.from_numpy(np.packbits(ones, bitorder="little"))
    flat = mask.reshape(-1)
    ones = flat == 1.0
    if not bool((ones | (flat.view(torch.int32) == 0)).all()):  # host sync: CUDA input only
        return None
    padded = torch.zeros(-(-flat.numel() // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[: flat.numel()] = ones.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] float32 0.0 / 1.0 from `pack_bits`' bytes."""
    n = rows * cols
    if _host(bits):
        out = np.unpackbits(bits.numpy(), count=n, bitorder="little").astype(np.float32)
        return torch.from_numpy(out).view(rows, cols)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    flags = bits[:, None].bitwise_and(weights).ne(0).view(-1)[:n]
    return flags.to(torch.float32).view(rows, cols)


def _host(*tensors: torch.Tensor) -> bool:
    """True when the (one or two) tensors are on the CPU (the numpy path); tests patch it to run the torch path."""
    return tensors[0].is_cpu and (len(tensors) == 1 or tensors[1].is_cpu)
