"""One transport interface: the TP source sends a frame (header + payload), its peers receive it.

Three implementations, chosen per TP group by `transport_for` at the group's first call, which
logs the choice and why (logger ``megapack.delivery``):

    SoloTransport       tp = 1: nobody to send to
    LinkTransport       TP ranks on one host with CPU tensors: the whole frame over a local link
                        (`megapack.delivery.link`: Unix sockets, sealed shared memory for large
                        frames); no collective per call
    BroadcastTransport  the header (and an error's message) on the host, over the local link when
                        the ranks share a host, else broadcast on the group's CPU control group;
                        the payload broadcast on the TP group itself, ordered on the current CUDA
                        stream for NCCL: no rank waits on the host for it or reads it back

A call is 1 NCCL collective after a link frame on GPUs (2 collectives, 1 gloo and 1 NCCL,
without a link), a stop or an error one link frame (or 1-2 gloo collectives). Every failure
megapack reports (stop, source error, a stuck or crashed peer within the timeout) shows on the
header's frame or collective, before any payload is posted; a peer that dies between its header
and its NCCL payload is left to the NCCL group's own timeout and watchdog.

$MEGAPACK_TRANSPORT picks another path (every rank of a group alike; read at every call):
``auto`` (default), ``collectives`` (no local link: header on the control group, payload on the
group), ``split`` (the payload on the group even on CPU: the NCCL path, which CPU tests and the
bench run this way). `use_transport` sets it for a block.

The first call for a group and a field declaration also checks that every rank passed the same
``fields=`` (one all-gather of the schema's key), so every header has the same size everywhere.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megapack.core.fields import Schema
from megapack.delivery.link import LocalLink
from megapack.delivery.link_setup import link_for
from megapack.delivery.wire import Header, Status, payload_of, write_payload
from megapack.distributed import comm
from megapack.distributed.groups import control_group
from megapack.distributed.topology import Topology

logger = logging.getLogger("megapack.delivery")
TRANSPORT_ENV = "MEGAPACK_TRANSPORT"
MODES = ("auto", "collectives", "split")


class Transport(abc.ABC):
    """Moves one frame per call from a TP group's source (TP rank 0) to its peers."""

    name: str = ""
    why: str = ""
    """Why `transport_for` chose it, for the log."""

    @abc.abstractmethod
    def send(
        self, header: Header, pieces: list[torch.Tensor], timeout: float | None
    ) -> torch.Tensor:
        """Source: send ``header`` and its payload, laid out from ``pieces`` (`wire.encode`; an
        error's message, one host tensor); returns the payload as the peers receive it, in
        memory of the source's own (its outputs are views of it)."""

    @abc.abstractmethod
    def receive(self, header_bytes: int, timeout: float | None) -> tuple[Header, torch.Tensor]:
        """Peer: the next (header, payload); an error's payload is its message, on the host.

        ``timeout``: seconds to wait for the source (None: megapack's default, `megapack.distributed.comm`).
        """

    @property
    def usable(self) -> bool:
        """False once a link it uses was closed by a failure (the group then sets up anew)."""
        return True


class SoloTransport(Transport):
    name = "none (tp=1)"
    why = "the TP group has one rank"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def send(
        self, header: Header, pieces: list[torch.Tensor], timeout: float | None
    ) -> torch.Tensor:
        on = self.device if header.status == Status.OK else torch.device("cpu")  # a message
        return payload_of(pieces, header.nbytes, on)

    def receive(self, header_bytes: int, timeout: float | None) -> tuple[Header, torch.Tensor]:
        raise RuntimeError("a TP group of one rank has no peer to receive a frame")


class LinkTransport(Transport):
    """The whole frame over the group's local link: header and payload in one message."""

    name = "local link"

    def __init__(self, link: LocalLink, what: str, why: str) -> None:
        self.link, self.what, self.why = link, what, why

    def send(
        self, header: Header, pieces: list[torch.Tensor], timeout: float | None
    ) -> torch.Tensor:
        head = header.to_bytes()
        start = len(head)

        def write(frame: np.ndarray) -> None:
            frame[:start] = np.frombuffer(head, dtype=np.uint8)
            write_payload(pieces, frame[start:].data)

        frame, shared = self.link.send_frame(
            start + header.nbytes, write, what=self.what, timeout=timeout
        )
        payload = frame[start:]  # the shared memory takes the next frame: the source copies
        return torch.from_numpy(payload.copy() if shared else payload)

    def receive(self, header_bytes: int, timeout: float | None) -> tuple[Header, torch.Tensor]:
        body = self.link.receive(what=self.what, timeout=timeout)
        return Header.from_bytes(body[:header_bytes]), torch.from_numpy(body[header_bytes:])

    @property
    def usable(self) -> bool:
        return not self.link.closed


class BroadcastTransport(Transport):
    """Header on the host (link or control group), payload broadcast on the TP group."""

    def __init__(self, topo: Topology, link: LocalLink | None, why: str) -> None:
        self.topo, self.link, self.why = topo, link, why
        self.control = control_group(topo.tp_group)
        where = "the local link" if link is not None else "the gloo control group"
        self.name = f"header over {where}, payload broadcast on the TP group"
        self.what = f"get_batch_on_this_tp_rank %s from TP source rank {topo.src_rank}"

    def send(
        self, header: Header, pieces: list[torch.Tensor], timeout: float | None
    ) -> torch.Tensor:
        error = header.status == Status.ERROR
        payload = payload_of(
            pieces, header.nbytes, torch.device("cpu") if error else self.topo.device
        )
        head = header.to_bytes()
        if self.link is not None:  # header (+ message) in one link frame
            self.link.send(
                [head, payload] if error else [head], what=self.what % "header", timeout=timeout
            )
        else:
            self._control(torch.frombuffer(bytearray(head), dtype=torch.uint8), "header", timeout)
            if error:
                self._control(payload, "error message", timeout)
        if header.status == Status.OK and header.nbytes:
            self._payload(payload, timeout)
        return payload

    def receive(self, header_bytes: int, timeout: float | None) -> tuple[Header, torch.Tensor]:
        if self.link is not None:
            body = self.link.receive(what=self.what % "header", timeout=timeout)
            header = Header.from_bytes(body[:header_bytes])
            message = torch.from_numpy(body[header_bytes:])
        else:
            raw = np.empty(header_bytes, dtype=np.uint8)  # the control group's: on the host
            self._control(torch.from_numpy(raw), "header", timeout)
            header = Header.from_bytes(raw)
            error = header.status == Status.ERROR
            message = torch.empty(header.nbytes if error else 0, dtype=torch.uint8)
            if error:
                self._control(message, "error message", timeout)
        if header.status != Status.OK:
            return header, message
        payload = torch.empty(header.nbytes, dtype=torch.uint8, device=self.topo.device)
        if header.nbytes:
            self._payload(payload, timeout)
        return header, payload

    @property
    def usable(self) -> bool:
        return self.link is None or not self.link.closed

    def _control(self, tensor: torch.Tensor, part: str, timeout: float | None) -> None:
        comm.broadcast(
            tensor,
            self.topo.src_rank,
            group=self.control,
            what=self.what % f"{part} broadcast",
            timeout=timeout,
        )

    def _payload(self, payload: torch.Tensor, timeout: float | None) -> None:
        comm.broadcast_on_stream(
            payload,
            self.topo.src_rank,
            group=self.topo.tp_group,
            what=self.what % "payload broadcast",
            timeout=timeout,
        )


@dataclass(slots=True)
class _GroupState:
    transports: dict[str, Transport] = field(default_factory=dict)
    agreed: set[int] = field(default_factory=set)
    """Schema keys every rank of the group was shown to share."""


# Keyed weakly by the TP process group: the state lives exactly as long as the group.
_states: weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupState] = weakref.WeakKeyDictionary()


def transport_mode() -> str:
    """$MEGAPACK_TRANSPORT: "auto" (default), "collectives" or "split"."""
    mode = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"${TRANSPORT_ENV}={mode!r}; expected one of {MODES}")
    return mode


@contextlib.contextmanager
def use_transport(mode: str) -> Iterator[None]:
    """Within the block, groups use transport ``mode`` ("auto", "collectives" or "split").

    Sets $MEGAPACK_TRANSPORT in this process and restores it after; every rank of a group must
    enter it alike (the bench times the transports this way, the tests test each).
    """
    if mode not in MODES:
        raise ValueError(f"transport mode {mode!r}; expected one of {MODES}")
    before = os.environ.get(TRANSPORT_ENV)
    os.environ[TRANSPORT_ENV] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TRANSPORT_ENV, None)
        else:
            os.environ[TRANSPORT_ENV] = before


def transport_for(topo: Topology, schema: Schema, timeout: float | None) -> Transport:
    """The transport of ``topo``'s TP group (collective set-up at a group's first call)."""
    if topo.tp_group is None:
        return _solo(topo.device)
    state = _states.get(topo.tp_group)  # not setdefault: that builds a weakref every call
    if state is None:
        state = _states[topo.tp_group] = _GroupState()
    if schema.key not in state.agreed:
        _agree(topo, schema, timeout)
        state.agreed.add(schema.key)
    mode = transport_mode()
    transport = state.transports.get(mode)
    if transport is None or not transport.usable:
        transport = state.transports[mode] = _choose(topo, mode, timeout)
        logger.info(
            "megapack: TP group %s sends batches by %s (%s)",
            topo.tp_ranks,
            transport.name,
            transport.why,
        )
    return transport


@functools.cache
def _solo(device: torch.device) -> SoloTransport:
    return SoloTransport(device)


def _choose(topo: Topology, mode: str, timeout: float | None) -> Transport:
    if mode == "collectives":
        return BroadcastTransport(topo, None, f"${TRANSPORT_ENV}=collectives")
    link = link_for(topo.tp_group, topo.src_rank, timeout=timeout)
    if link is not None and topo.device.type == "cpu" and mode == "auto":
        what = f"get_batch_on_this_tp_rank frame from TP source rank {topo.src_rank}"
        return LinkTransport(link, what, "the TP ranks share a host and the batch stays on the CPU")
    why = (
        f"${TRANSPORT_ENV}=split"
        if mode == "split"
        else f"the batch lives on {topo.device.type}: the payload goes by its collective"
    )
    if link is None:
        why += "; no local link (ranks on several hosts or namespaces, or set-up refused)"
    return BroadcastTransport(topo, link, why)


def _agree(topo: Topology, schema: Schema, timeout: float | None) -> None:
    """Raise ValueError on every rank unless all of ``topo``'s TP ranks declared the same fields."""
    control = control_group(topo.tp_group)
    what = f"megapack fields= check over TP ranks {topo.tp_ranks}"
    keys = comm.all_gather(
        torch.tensor([schema.key], dtype=torch.int64), group=control, what=what, timeout=timeout
    )
    if all(int(k) == schema.key for k in keys):
        return
    declared = repr(  # a per-token field's alignment too: it is part of the key
        [
            (f.name, f.per, str(f.dtype), f.stages) + ((f"at={f.at}",) if f.at else ())
            for f in schema.declared
        ]
    )
    texts = comm.all_gather_strings(declared, group=control, what=what, timeout=timeout)
    lines = "; ".join(f"rank {r}: {t}" for r, t in zip(topo.tp_ranks, texts, strict=True))
    raise ValueError(
        f"TP ranks passed different fields= to get_batch_on_this_tp_rank: {lines}. Every TP "
        "rank must declare the same fields, in the same order"
    )
