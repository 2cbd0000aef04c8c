"""Exceptions megapack raises across ranks.

A failure on one rank of a collective step must surface on every rank of the group, naming where it
came from, instead of leaving the others waiting in a collective until a watchdog kills the job.
"""

from __future__ import annotations


class RemoteRankError(RuntimeError):
    """Another rank of the group failed during a collective step; raised on the ranks that did not.

    The failing rank raises its own, original exception.

    Attributes:
        rank: global rank that failed.
        step: the step (0-based) it failed at, or None when the call has no step count.
        remote_message: ``"<ExceptionType>: <message>"`` as raised there.
    """

    def __init__(self, rank: int, step: int | None, remote_message: str) -> None:
        self.rank = rank
        self.step = step
        self.remote_message = remote_message
        at = "" if step is None else f" at step {step}"
        super().__init__(f"{self._who()} failed{at}: {remote_message}")

    def _who(self) -> str:
        return f"rank {self.rank}"

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return (type(self), (self.rank, self.step, self.remote_message))


class RemoteDataError(RemoteRankError):
    """The TP source rank failed to fetch or validate a batch; raised on every other TP rank.

    Attributes:
        source_rank: global rank of the TP source that failed (same as ``rank``).
    """

    def __init__(self, source_rank: int, remote_message: str, step: int | None = None) -> None:
        self.source_rank = source_rank
        super().__init__(source_rank, step, remote_message)

    def _who(self) -> str:
        return f"TP source rank {self.rank}"

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return (type(self), (self.source_rank, self.remote_message, self.step))


class ProtocolError(RuntimeError):
    """TP ranks disagree about the step they are in (wrong topology, or a rank skipped a call)."""


class DesyncError(RuntimeError):
    """Ranks reached a `megapack.check_in_sync` point with different tags, steps or statuses.

    Attributes:
        states: ``{global_rank: (tag, step, status)}`` for every rank of the group.
    """

    def __init__(self, message: str, states: dict[int, tuple[str, int, int]]) -> None:
        super().__init__(message)
        self.states = states

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return (type(self), (str(self), self.states))


class CollectiveError(RuntimeError):
    """A megapack collective timed out or failed (a peer stuck, crashed, or in another collective)."""


class CaptureError(RuntimeError):
    """An operation that reads the device on the host ran inside a CUDA-graph capture.

    Also raised for work a capture cannot record that has to happen once first, such as building a
    cuDNN attention graph (`megapack.attention.cudnn_graph`): the message says to warm up eagerly.
    """
