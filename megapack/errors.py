"""Exceptions megapack raises across ranks.

A failure on one rank of a collective step must surface on every rank of the group, naming where it
came from, instead of leaving the others waiting in a collective until a watchdog kills the job.
"""

from __future__ import annotations


class RemoteDataError(RuntimeError):
    """The TP source rank failed to fetch or validate a batch; raised on every other TP rank.

    The source rank itself raises its own, original exception.

    Attributes:
        source_rank: global rank of the TP source that failed.
        remote_message: ``"<ExceptionType>: <message>"`` as raised on the source.
    """

    def __init__(self, source_rank: int, remote_message: str) -> None:
        self.source_rank = source_rank
        self.remote_message = remote_message
        super().__init__(
            f"TP source rank {source_rank} failed to produce a batch: {remote_message}"
        )

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        return (type(self), (self.source_rank, self.remote_message))


class ProtocolError(RuntimeError):
    """TP ranks disagree about the step they are in (wrong topology, or a rank skipped a call)."""
