"""The host-wait probe (`megapack.bench.gpu.host_wait`) on a simulated device: a call that waits for
the device is seen waiting, one that only queues work is not, the positive control fails a probe
that sees nothing. The clock is simulated too (no test here times anything); the probe on a real
GPU, with torch's spin kernel, is the kit's smoke section."""

from __future__ import annotations

import doctest

import pytest
import torch

from megapack.bench.gpu import host_wait
from megapack.bench.gpu.host_wait import Spin, probe, probe_control, wait_check, waited

CPU = torch.device("cpu")


class Device:
    """A device with one stream: ``spin`` keeps it busy for ``seconds`` of simulated time; ``wait``
    (a synchronization) moves the host's clock to when it is idle."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy_until = 0.0

    def clock(self) -> float:
        return self.now

    def spin(self, seconds: float) -> Spin:
        def start() -> None:
            self.busy_until = max(self.now, self.busy_until) + seconds

        return Spin(start=start, finish=self.wait, seconds=seconds)

    def wait(self) -> None:
        self.now = max(self.now, self.busy_until)

    def queue(self, host_s: float = 1e-4) -> None:
        """A call that only enqueues work: some host time, no wait."""
        self.now += host_s


def test_docstring_examples() -> None:
    result = doctest.testmod(host_wait)
    assert result.failed == 0 and result.attempted > 0


def test_a_call_that_synchronizes_waits_behind_the_spin_and_one_that_queues_does_not() -> None:
    device = Device()
    spin = device.spin(0.1)
    assert probe(device.wait, spin, device.clock) == pytest.approx(0.1)
    assert device.now == pytest.approx(0.1) and device.busy_until == device.now
    queued = probe(device.queue, spin, device.clock)
    assert queued == pytest.approx(1e-4)
    assert device.now == pytest.approx(0.2)  # finish waited for the spin after the call
    assert waited(0.1, 0.1) and waited(0.05, 0.1) and not waited(0.049, 0.1)


def test_the_probe_waits_for_the_spin_even_when_the_call_raises() -> None:
    device = Device()

    def broken() -> None:
        raise RuntimeError("a kernel failed")

    with pytest.raises(RuntimeError, match="a kernel failed"):
        probe(broken, device.spin(0.1), device.clock)
    assert device.now == pytest.approx(0.1)  # the spin finished: the next probe starts idle


def test_wait_check_passes_a_call_that_queues_and_fails_one_that_waits() -> None:
    device = Device()
    spin = device.spin(0.1)
    ok = wait_check("a replay", device.queue, spin, CPU, clock=device.clock)
    assert (ok.status, ok.detail) == (
        "passed", "the host returned in 0.10 ms behind a 100 ms spin kernel: no wait")  # fmt: skip
    synced = wait_check("cudnn attention", device.wait, spin, CPU, clock=device.clock)
    assert synced.status == "failed"
    assert synced.detail == ("WAITED: the host returned after 100.0 ms behind a 100 ms spin "
                             "kernel: a device-to-host synchronization")  # fmt: skip

    def broken() -> None:
        raise RuntimeError("CUDA error")

    failed = wait_check("x", broken, spin, CPU, clock=device.clock)
    assert (failed.status, failed.detail) == ("failed", "RuntimeError: CUDA error")


def test_the_positive_control_fails_a_probe_that_sees_nothing() -> None:
    device = Device()
    control = probe_control(device.spin(0.1), CPU, clock=device.clock, planted=device.wait)
    assert control.status == "passed", control
    blind = probe_control(device.spin(0.1), CPU, clock=device.clock, planted=device.queue)
    assert blind.status == "failed" and blind.detail.endswith("the probe sees no wait at all")
    short = probe_control(device.spin(0.001), CPU, clock=device.clock, planted=device.wait)
    assert short.status == "failed" and short.detail.endswith(
        "a spin under 10 ms cannot tell a wait"
    )


def test_without_cuda_nothing_is_probed() -> None:
    assert host_wait.cuda_spin(CPU) is None
    skipped = probe_control(None, CPU)
    assert (skipped.status, skipped.detail) == ("skipped", "needs CUDA; cpu has no stream to spin")
    assert wait_check("x", lambda: None, None, CPU).status == "skipped"
