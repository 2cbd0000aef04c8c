"""transfer: get_batch_on_this_tp_rank on a single rank (tp=1): clean stop and source-side errors."""

from __future__ import annotations

import pickle

import pytest
import torch

from megapack import PackedBatch, RemoteDataError, Topology, get_batch_on_this_tp_rank


def sample() -> PackedBatch:
    return PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]])


def test_single_rank_path_and_clean_stop() -> None:
    topo = Topology.single()
    data = iter([sample(), sample()])
    for _ in range(2):
        out = get_batch_on_this_tp_rank(data, topology=topo)
        assert out["cu_seqlens"].tolist() == [0, 3, 5, 9]
    with pytest.raises(StopIteration):
        get_batch_on_this_tp_rank(data, topology=topo)


@pytest.mark.parametrize(
    ("item", "error", "match"),
    [
        (
            {"tokens": torch.zeros(1, 4, dtype=torch.long), "text": "x"},
            ValueError,
            r"undeclared keys \['text'\]",
        ),
        (
            [1, 2, 3],
            TypeError,
            "data_iterator yielded list; expected a megapack.PackedBatch or a dict",
        ),
        (
            {
                "tokens": torch.zeros(1, 4, dtype=torch.long),
                "labels": torch.zeros(1, 4, dtype=torch.long),
                "loss_mask": torch.ones(1, 4),
                "position_ids": torch.zeros(1, 4, dtype=torch.long),
                "attention_mask": torch.ones(1, 1, 3, 3, dtype=torch.bool),
            },
            ValueError,
            r"attention_mask'\] is \(1, 1, 3, 3\); expected a \[b, 1, s, s\] tensor with b=1 and s=4",
        ),
    ],
)
def test_source_errors_name_the_problem(item: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        get_batch_on_this_tp_rank(iter([item]), topology=Topology.single())


def test_source_without_iterator_is_an_error() -> None:
    with pytest.raises(ValueError, match="data_iterator is None on TP source rank 0"):
        get_batch_on_this_tp_rank(None, topology=Topology.single())


def test_remote_data_error_pickles() -> None:
    err = pickle.loads(pickle.dumps(RemoteDataError(4, "ValueError: bad")))
    assert (err.source_rank, err.remote_message) == (4, "ValueError: bad")
    assert "TP source rank 4 failed" in str(err)
