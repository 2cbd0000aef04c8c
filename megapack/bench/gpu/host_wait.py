"""Whether a call makes the host wait for the device: the probe for the syncs torch cannot see.

``torch.cuda.set_sync_debug_mode("error")`` (`megapack.bench.gpu.syncs`) flags the synchronizing
calls torch itself makes (``.item()``, a blocking copy, ``torch.cuda.synchronize``), not those of
a library torch hands a stream to: cuDNN, cudnn-frontend's ``execute``, NCCL. cudnn-frontend's
issue #552 is one of those: its ragged (THD) execution synchronised the device with the host on
every call, and the fix names SM100/SM120 only. The probe sees every kind of wait: it queues a
spin kernel of known length on the current stream (``torch.cuda._sleep``: a kernel that counts
clock cycles, in torch since 1.x and in 2.11), then times the call on the host. A call that waits
for the device (a stream or device synchronization, a blocking copy, a host read of a device
value) returns only after the spin ends; one that only queues work returns in microseconds.

    spin (device)   |=========== 100 ms ===========|
    probed call     |-| 0.3 ms: queued, no wait
    a planted sync  |------------------------------| 100 ms: waited

A call waited when its host time reaches `WAIT_SHARE` of the spin (`waited`). The positive
control is a planted ``.item()``: it must be seen waiting, or the probe sees nothing. Caveats: a
call that launches more kernels than the device's launch queue holds (about a thousand) also
blocks behind a long spin, so the probe is for a replay or a few kernels (one attention call),
not an eager training step; and the call must be warm (a first call may allocate with
``cudaMalloc``, which can wait).

Without CUDA nothing can be probed (`cuda_spin` returns None); `probe` itself takes any `Spin`
and clock, so CPU tests drive it with a simulated device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megapack.bench.gpu.report import Check

SPIN_S = 0.1
"""How long the spin keeps the device busy ahead of a probed call (seconds, calibrated)."""
WAIT_SHARE = 0.5
"""A call whose host time reaches this share of the spin waited for the device."""
MIN_SPIN_S = 0.01
"""A spin shorter than this cannot tell a wait from a slow host (the control fails on it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Spin:
    """Device work of a known length, queued ahead of a probed call."""

    start: Callable[[], None]
    """Queue the spin on the current stream (returns at once)."""
    finish: Callable[[], None]
    """Wait until the device is idle again (after the probed call)."""
    seconds: float
    """How long the spin keeps the device busy."""


def cuda_spin(device: torch.device, seconds: float = SPIN_S) -> Spin | None:
    """A calibrated spin of about ``seconds`` on ``device``'s current stream; None without CUDA.

    Calibration: a spin of 1e7 cycles is timed (synchronized at both ends) and its cycle count
    scaled towards ``seconds`` (at most 100x a round, three rounds: the GPU's clock rises while
    it spins); the final spin is timed again: its measured length is `Spin.seconds`.
    """
    if device.type != "cuda":
        return None

    def run(cycles: int) -> float:
        torch.cuda.synchronize(device)
        begin = time.perf_counter()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize(device)
        return time.perf_counter() - begin

    with torch.cuda.device(device):
        run(1_000)  # the sleep kernel's first launch loads it
        cycles = 10_000_000
        for _ in range(3):  # the clock may rise while it spins: scale until the spin is long enough
            took = run(cycles)
            if took >= 0.8 * seconds:
                break
            cycles = int(cycles * min(100.0, seconds / max(took, 1e-4)))
        measured = run(cycles)
    return Spin(
        start=lambda: torch.cuda._sleep(cycles),
        finish=lambda: torch.cuda.synchronize(device),
        seconds=measured,
    )


def probe(
    call: Callable[[], object],
    spin: Spin,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Host seconds ``call`` took with ``spin`` queued ahead of it on the device."""
    spin.start()
    begin = clock()
    try:
        call()
        return clock() - begin
    finally:
        spin.finish()


def waited(host_s: float, spin_s: float) -> bool:
    """Whether a call that took ``host_s`` on the host behind a ``spin_s`` spin waited for it.

    Example:
        >>> waited(0.0004, 0.1), waited(0.099, 0.1), waited(0.0, 0.0)
        (False, True, False)
    """
    return spin_s > 0 and host_s >= WAIT_SHARE * spin_s


def probe_control(
    spin: Spin | None,
    device: torch.device,
    *,
    clock: Callable[[], float] = time.perf_counter,
    planted: Callable[[], object] | None = None,
) -> Check:
    """The probe's positive control: a planted wait (by default ``.item()`` on a device tensor)
    must be seen waiting behind the spin, or the probe sees nothing and the check fails."""
    label = "host-wait probe: positive control (a planted .item() must wait behind the spin)"
    if spin is None:
        return Check(
            name=label, status="skipped", detail=f"needs CUDA; {device.type} has no stream to spin"
        )
    if planted is None:
        tensor = torch.ones(2, device=device)

        def planted() -> object:
            return (tensor * 2).sum().item()

    host_s = probe(planted, spin, clock)
    what = (f"the planted .item() returned after {host_s * 1e3:.1f} ms behind a "
            f"{spin.seconds * 1e3:.0f} ms spin")  # fmt: skip
    if spin.seconds < MIN_SPIN_S:
        return Check(name=label, status="failed",
                     detail=f"{what}: a spin under {MIN_SPIN_S * 1e3:.0f} ms cannot tell a wait")  # fmt: skip
    ok = waited(host_s, spin.seconds)
    return Check(name=label, status="passed" if ok else "failed",
                 detail=what + ("" if ok else ": the probe sees no wait at all"))  # fmt: skip


def wait_check(
    label: str,
    call: Callable[[], object],
    spin: Spin | None,
    device: torch.device,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> Check:
    """A check that ``call`` (warm) does not make the host wait for the device: passed when it
    returns before `WAIT_SHARE` of the spin, failed (saying how long it waited) otherwise; skipped
    without CUDA. An exception is the check's failure, with its type and message."""
    if spin is None:
        return Check(
            name=label, status="skipped", detail=f"needs CUDA; {device.type} has no stream to spin"
        )
    try:
        host_s = probe(call, spin, clock)
    except Exception as exc:
        return Check(name=label, status="failed", detail=f"{type(exc).__name__}: {exc}")
    behind = f"behind a {spin.seconds * 1e3:.0f} ms spin kernel"
    if waited(host_s, spin.seconds):
        return Check(name=label, status="failed",
                     detail=f"WAITED: the host returned after {host_s * 1e3:.1f} ms {behind}: a "
                     "device-to-host synchronization")  # fmt: skip
    return Check(name=label, status="passed",
                 detail=f"the host returned in {host_s * 1e3:.2f} ms {behind}: no wait")  # fmt: skip
