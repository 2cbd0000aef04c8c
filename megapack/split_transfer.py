"""The split path of `get_batch_on_this_tp_rank`: header on the host, payload on the device stream.

On a gloo TP group a call is one frame (header + payload in one broadcast, `megapack.transfer`).
On an NCCL TP group that frame would make every receiver copy the header device-to-host and the
host wait for the broadcast, so the forward pass could not be queued while the batch is in flight.
Here instead, per call:

    1. the fixed-size `Header` (status, shapes, ``max_seqlen``, payload bytes) goes over the TP
       group's local link when its ranks share a host (`megapack.local_link`: Unix sockets, ~0.05
       ms on the host instead of a gloo broadcast's ~0.25), else it is broadcast on the TP
       group's CPU control group (`megapack.side_groups`); either way with megapack's timeout;
    2. on an error, the message follows the same way (in the header's link frame, or a second
       control broadcast; the source re-raises its own error, every peer raises
       `RemoteDataError`); on a clean stop nothing follows;
    3. otherwise the payload, whose size every rank now knows, is allocated on the device and
       broadcast on the TP group itself, ordered on the current CUDA stream: no host wait and no
       device-to-host copy on any rank. ``max_seqlen`` is a Python int straight from the header.

So a batch is 1 NCCL collective after a link frame (2 collectives, 1 gloo + 1 NCCL, without a
link), a stop or an error a link frame (or 1-2 gloo collectives). Every failure megapack promises
to report (stop, source error, a stuck or crashed peer within the megapack timeout) shows up on
the header's frame or collective, before any payload is posted. A peer that
dies between its header and its payload leaves the NCCL broadcast to the NCCL group's own
timeout and watchdog (``timeout=`` of ``init_process_group``/``new_group``, 10 min by default;
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` tears the job down), as for any NCCL collective of the step.

On CPU the same path runs when a control group is registered for a gloo TP group
(`megapack.side_groups.set_control_group`), which is how the tests check it; the payload
broadcast then waits with megapack's timeout like every gloo collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapack import comm
from megapack.header import HEADER_BYTES, HEADER_LEN, Header, Status
from megapack.link_setup import link_for
from megapack.local_link import LocalLink
from megapack.side_groups import control_group, registered_control_group
from megapack.topology import Topology


def split_control(topo: Topology) -> dist.ProcessGroup | None:
    """The control group when ``topo``'s TP group takes the split path, else None (one frame).

    Split when the payload lives on a device (NCCL) or a control group was registered for the TP
    group; the first call on an NCCL group creates its gloo control group (`control_group`).
    """
    if topo.tp_group is None:
        return None
    if (registered := registered_control_group(topo.tp_group)) is not None:
        return registered
    if topo.device.type == "cpu":
        return None
    return control_group(topo.tp_group)


def send_split(
    header: Header,
    chunks: list[torch.Tensor],
    topo: Topology,
    control: dist.ProcessGroup,
    timeout: float | None,
) -> torch.Tensor:
    """Source side: header (and an error's message) on ``control``, then the payload on the TP group.

    Returns the payload as every receiver gets it (the source decodes the same bytes).
    """
    message = (
        (torch.cat([c.cpu() for c in chunks]) if chunks else _empty("cpu"))
        if header.status == Status.ERROR
        else None
    )
    if (link := _link(topo, timeout)) is not None:  # header (+ message) in one local-link frame
        parts = [header.to_bytes()] if message is None else [header.to_bytes(), message]
        link.send(parts, what=_what(topo, "header"), timeout=timeout)
    else:
        _header_broadcast(header.to_tensor(torch.device("cpu")), topo, control, timeout)
        if message is not None:
            _header_broadcast(message, topo, control, timeout, part="error message")
    if message is not None:
        return message
    if header.status != Status.OK or header.nbytes == 0:
        return _empty(topo.device)
    payload = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
    _payload_broadcast(payload, topo, timeout)
    return payload


def receive_split(
    topo: Topology, control: dist.ProcessGroup, timeout: float | None
) -> tuple[Header, torch.Tensor]:
    """Receiver side of `send_split`: (header, payload); an error's payload is its message, on CPU."""
    if (link := _link(topo, timeout)) is not None:
        body = link.receive(what=_what(topo, "header"), timeout=timeout)
        header = Header.from_bytes(body)
        if header.status == Status.ERROR:
            return header, torch.from_numpy(body[HEADER_BYTES:])
    else:
        raw = torch.empty(HEADER_LEN, dtype=torch.int64)
        _header_broadcast(raw, topo, control, timeout)
        header = Header.from_tensor(raw)  # a CPU tensor: no device-to-host copy
        if header.status == Status.ERROR:
            message = torch.empty(header.nbytes, dtype=torch.uint8)
            _header_broadcast(message, topo, control, timeout, part="error message")
            return header, message
    if header.status != Status.OK or header.nbytes == 0:
        return header, _empty(topo.device)
    payload = torch.empty(header.nbytes, dtype=torch.uint8, device=topo.device)
    _payload_broadcast(payload, topo, timeout)
    return header, payload


def _link(topo: Topology, timeout: float | None) -> LocalLink | None:
    """The TP group's local link for headers (`megapack.local_link`), when its ranks share a host."""
    return link_for(topo.tp_group, topo.src_rank, timeout=timeout)


def _what(topo: Topology, part: str) -> str:
    return f"get_batch_on_this_tp_rank {part} from TP source rank {topo.src_rank}"


def _empty(device: torch.device | str) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device)


def _header_broadcast(
    tensor: torch.Tensor,
    topo: Topology,
    control: dist.ProcessGroup,
    timeout: float | None,
    part: str = "header",
) -> None:
    what = f"get_batch_on_this_tp_rank {part} broadcast from TP source rank {topo.src_rank}"
    comm.broadcast(tensor, topo.src_rank, group=control, what=what, timeout=timeout)


def _payload_broadcast(payload: torch.Tensor, topo: Topology, timeout: float | None) -> None:
    what = f"get_batch_on_this_tp_rank payload broadcast from TP source rank {topo.src_rank}"
    comm.broadcast_on_stream(
        payload, topo.src_rank, group=topo.tp_group, what=what, timeout=timeout
    )
