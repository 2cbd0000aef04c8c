"""The host-read recorder itself: each kind of read is caught, reads from outside the roots are not,
``allow`` works per module and package, and torch is restored after the block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megapack.attention.documents import Documents
from megapack.testing.host_reads import TENSOR_METHODS, host_reads

HERE = Path(__file__).resolve().parent


def every_kind_of_read(t: torch.Tensor) -> None:
    """One read of each kind, made from this file."""
    t.item()
    t.tolist()
    t.numpy()
    t.cpu()
    t.nonzero()
    if t:
        pass
    int(t)
    float(t)
    [10, 20][t]  # __index__
    torch.equal(t, t)
    torch.nonzero(t)
    torch.tensor([1, 2], device="meta")  # Python data to a non-CPU device
    torch.as_tensor([1.0], device="meta")


def harmless(t: torch.Tensor) -> None:
    """Calls that never read the device: none may be recorded."""
    torch.tensor([1, 2])  # Python data on the CPU
    torch.tensor(5)
    torch.as_tensor(t, device="meta")  # a tensor, not Python data
    (t + 1).sum()
    len(t.shape)


def test_host_read_each_kind_is_caught() -> None:
    t = torch.tensor(1)
    with host_reads(roots=[HERE]) as reads:
        every_kind_of_read(t)
        harmless(t)
    kinds = [r.kind for r in reads.records]
    assert kinds == [
        "item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__",
        "__index__", "torch.equal", "torch.nonzero", "torch.tensor(device=meta)",
        "torch.as_tensor(device=meta)",
    ]  # fmt: skip
    assert {r.function for r in reads.records} == {"every_kind_of_read"}
    assert reads.by_module() == {__name__: 13}
    assert reads.records[0].where().endswith(f"test_host_reads.py:{reads.records[0].line} in every_kind_of_read")  # fmt: skip


def test_host_read_from_outside_megapack_is_ignored() -> None:
    t = torch.tensor(1)
    with host_reads() as reads:  # default roots: the megapack package only
        every_kind_of_read(t)
        np.asarray(t)  # numpy's own conversion, outside megapack
    assert reads.records == []


def test_host_read_by_megapack_is_recorded_with_its_site_and_allow_is_per_package() -> None:
    cu = torch.tensor([0, 3, 5])
    with host_reads(allow={"megapack.attention"}) as allowed, host_reads(allow={"megapack.attention.doc"}) as prefix_only:  # fmt: skip
        Documents(cu, torch.tensor([0, 4, 6]), 4, 6).host_bounds()
        Documents(cu, cu, 3, 5).segment_ids()  # on the device: no read
    for reads in (allowed, prefix_only):
        assert reads.by_site() == {("megapack.attention.documents", "host_bounds", "tolist"): 1}
    assert allowed.unexpected() == []
    assert prefix_only.unexpected() == prefix_only.records  # "doc" is no package of "documents"
    assert "1 x tolist megapack.attention.documents" in prefix_only.report()
    assert "(allowed)" in allowed.report() and "(allowed)" not in prefix_only.report()


def run_as(file: Path, module: str, t: torch.Tensor) -> None:
    """``t.tolist()`` executed as if it were a line of ``file`` (module ``module``)."""
    exec(compile("t.tolist()", str(file), "exec"), {"t": t, "__name__": module})


def test_host_read_testing_helpers_are_not_megapack_code() -> None:
    from megapack.testing.host_reads import PACKAGE, TESTING

    t = torch.tensor([1])
    with host_reads() as reads:
        run_as(PACKAGE / "somewhere.py", "megapack.somewhere", t)
        run_as(TESTING / "helper.py", "megapack.testing.helper", t)
        run_as(PACKAGE.parent / "tests" / "x.py", "tests.x", t)
    assert reads.by_module() == {"megapack.somewhere": 1}
    with host_reads(roots=[TESTING]) as reads:  # unless asked for explicitly
        run_as(TESTING / "helper.py", "megapack.testing.helper", t)
    assert reads.by_module() == {"megapack.testing.helper": 1}


def test_host_read_patches_are_removed_after_the_block_and_nest() -> None:
    before = {name: getattr(torch.Tensor, name) for name in TENSOR_METHODS}
    before_functions = (torch.equal, torch.tensor, torch.as_tensor, torch.nonzero)
    t = torch.tensor(2)
    with host_reads(roots=[HERE]) as outer:
        with host_reads(roots=[HERE]) as inner:
            t.item()
        t.tolist()
        assert torch.Tensor.item is not before["item"]  # still patched for the outer block
    assert [r.kind for r in outer.records] == ["item", "tolist"]
    assert [r.kind for r in inner.records] == ["item"]
    assert {name: getattr(torch.Tensor, name) for name in TENSOR_METHODS} == before
    assert (torch.equal, torch.tensor, torch.as_tensor, torch.nonzero) == before_functions
    assert not any(name in torch.Tensor.__dict__ for name in ("__bool__", "item", "tolist"))


def test_host_read_allow_must_name_modules() -> None:
    with pytest.raises(TypeError, match="allow must hold module names"), host_reads(allow=[3]):  # type: ignore[list-item]
        pass
