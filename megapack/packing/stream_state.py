"""What a `StreamingPacker` state holds, checked whole before a packer loads it (`check_stream_state`).

A state is ``StreamingPacker.state_dict()``'s dict, saved in a checkpoint and read back later,
perhaps by another megapack or after a hand edit. Loading a malformed one used to fail with a
bare ``KeyError``, or later at the next bin, or not at all (a negative count). Each key is
checked here instead, the error naming the key and the value:

    key        holds                                            checked
    ---------  -----------------------------------------------  ---------------------------------
    version    `STATE_VERSION`                                   equal
    config     the packer's settings (`StreamingPacker._config`)  every setting equal to the packer's
    consumed   upstream documents read                          int >= 0
    rounds     buffers planned                                  int >= 0
    buffer     [(piece, round it arrived)]                      pieces below; 0 <= round <= rounds
    ready      [[piece, ...], ...] bins planned, not yielded    pieces below; no empty bin
    ordered    bins at the front of ready in balanced order     int in [0, len(ready)]; absent: 0
    stats      the six counters of ``StreamingPacker.stats``    each an int >= 0

A piece (`megapack.packing.Piece`) is ``(doc_index, start, stop, doc)``: ``0 <= doc_index <
consumed``, ``0 <= start < stop``, ``stop - start <= seq_len``. ``ordered`` may be absent (states
saved before compute balance had it; 0 then).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megapack.core.checks import check_int

STATE_VERSION = 2
"""Version of ``StreamingPacker.state_dict()`` (2: the settings of `PackOptions`, ``seq_len``)."""
REQUIRED = ("version", "config", "consumed", "rounds", "buffer", "ready", "stats")
"""The keys every state has; ``ordered`` is optional (0)."""
STATS = ("bins", "tokens", "split_docs", "truncated_tokens", "dropped_docs", "dropped_tokens")


def check_stream_state(state: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """``state``'s values checked against a packer of settings ``config``.

    Returns:
        ``{"consumed", "rounds", "buffer", "ready", "ordered", "stats"}``: plain ints, pieces as
        tuples, rounds as ints.

    Raises:
        TypeError: not a dict, or a key of the wrong type, naming the key and the value.
        ValueError: another version or setting (naming both values), a missing key, or a value
            out of range, naming the key and the value.
    """
    if not isinstance(state, Mapping):
        raise TypeError(
            f"a StreamingPacker state is a dict (StreamingPacker.state_dict()), got "
            f"{type(state).__name__} {_short(state)}"
        )
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"state version {state.get('version')!r} != {STATE_VERSION}")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise ValueError(
            f"the state has no {', '.join(map(repr, missing))} (keys {sorted(map(str, state))}): "
            "save StreamingPacker.state_dict() whole"
        )
    saved = _typed("config", state["config"], Mapping, "a dict of settings")
    for key in sorted({*saved, *config}):  # a setting an older state lacks reads as None
        if saved.get(key) != config.get(key):
            raise ValueError(
                f"state was saved with {key}={saved.get(key)!r} but this packer has "
                f"{key}={config.get(key)!r}"
            )
    consumed = check_int("state['consumed']", state["consumed"], minimum=0)
    rounds = check_int("state['rounds']", state["rounds"], minimum=0)
    seq_len = int(config["seq_len"])
    buffer = []
    for i, entry in enumerate(_typed("buffer", state["buffer"], list | tuple, "a list")):
        where = f"state['buffer'][{i}]"
        if not isinstance(entry, list | tuple) or len(entry) != 2:
            raise TypeError(f"{where} must be a pair (piece, round), got {_short(entry)}")
        piece = _piece(where + "[0]", entry[0], consumed, seq_len)
        arrived = check_int(where + "[1]", entry[1], minimum=0)
        if arrived > rounds:
            raise ValueError(
                f"{where}[1]={arrived}: a piece arrived in round {arrived} but the state has "
                f"planned only {rounds} rounds"
            )
        buffer.append((piece, arrived))
    ready = []
    for b, bin_ in enumerate(_typed("ready", state["ready"], list | tuple, "a list of bins")):
        where = f"state['ready'][{b}]"
        if not isinstance(bin_, list | tuple) or not bin_:
            raise TypeError(f"{where} must be a non-empty list of pieces, got {_short(bin_)}")
        ready.append([_piece(f"{where}[{k}]", p, consumed, seq_len) for k, p in enumerate(bin_)])
    ordered = check_int("state['ordered']", state.get("ordered", 0), minimum=0)
    if ordered > len(ready):
        raise ValueError(
            f"state['ordered']={ordered}: more bins in balanced order than the {len(ready)} ready"
        )
    stats = _typed("stats", state["stats"], Mapping, "a dict of counters")
    lost = [k for k in STATS if k not in stats]
    if lost:
        raise ValueError(f"state['stats'] has no {', '.join(map(repr, lost))}")
    counters = {k: check_int(f"state['stats'][{k!r}]", stats[k], minimum=0) for k in STATS}
    return {
        "consumed": consumed,
        "rounds": rounds,
        "buffer": buffer,
        "ready": ready,
        "ordered": ordered,
        "stats": counters,
    }


def _typed(key: str, value: Any, kind: Any, what: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(
            f"state[{key!r}] must be {what}, got {type(value).__name__} {_short(value)}"
        )
    return value


def _piece(where: str, value: Any, consumed: int, seq_len: int) -> tuple[int, int, int, Any]:
    """A piece ``(doc_index, start, stop, doc)`` of a document the state has read."""
    if not isinstance(value, list | tuple) or len(value) != 4:
        raise TypeError(
            f"{where} must be a piece (doc_index, start, stop, doc), got {_short(value)}"
        )
    doc_index = check_int(where + "[0]", value[0], minimum=0)
    start = check_int(where + "[1]", value[1], minimum=0)
    stop = check_int(where + "[2]", value[2], minimum=1)
    if doc_index >= consumed:
        raise ValueError(
            f"{where} is of document {doc_index}, but the state has read only {consumed} documents"
        )
    if not start < stop <= start + seq_len:
        raise ValueError(
            f"{where} holds tokens {start}:{stop}; a piece holds 1 to seq_len={seq_len} tokens"
        )
    return doc_index, start, stop, value[3]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
