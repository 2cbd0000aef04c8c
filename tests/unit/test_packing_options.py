"""PackOptions and LoadOptions: frozen, documented, checked once in their constructors, one default
each, recorded by a packed folder and read back, and the keyword shortcuts that build them."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest

from megapack.data import Document, PackedDataset, PackWriter
from megapack.packing import CostModel, LoadOptions, PackOptions, StreamingPacker, options, plan
from megapack.packing.options import default_of, pack_options, split_shortcuts, with_shortcuts


def docs(n: int = 40) -> list[Document]:
    rng = np.random.default_rng(0)
    return [
        Document(tokens=rng.integers(1, 99, int(k)), loss_mask=np.ones(int(k)))
        for k in rng.integers(1, 60, n)
    ]


@pytest.mark.parametrize("kind", [PackOptions, LoadOptions])
def test_options_are_frozen_keyword_only_slotted_and_document_every_field(kind: type) -> None:
    params = kind.__dataclass_params__  # type: ignore[attr-defined]
    assert params.frozen and "__slots__" in vars(kind)
    made = kind(seq_len=8) if kind is PackOptions else kind()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, dataclasses.fields(kind)[0].name, 1)
    with pytest.raises(TypeError):
        kind(8)  # keyword only
    tree = ast.parse(inspect.getsource(options))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == kind.__name__)
    documented = {
        stmt.target.id  # type: ignore[union-attr]
        for stmt, after in zip(body.body, body.body[1:], strict=False)
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(kind)}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seq_len": 0}, ValueError, r"^seq_len must be an int >= 1, got 0$"),
        ({"seq_len": 8.0}, TypeError, r"^seq_len must be an int >= 1, got float 8\.0$"),
        ({"seq_len": 8, "algorithm": "worst"}, ValueError, r"^algorithm must be one of \('bfd', .*got 'worst'$"),
        ({"seq_len": 8, "algorithm": None}, TypeError, r"^algorithm must be one of .*, got NoneType None$"),
        ({"seq_len": 8, "long_docs": "fold"}, ValueError, r"^long_docs must be one of .*, got 'fold'$"),
        ({"seq_len": 8, "pad_to_multiple_of": 0}, ValueError, r"^pad_to_multiple_of must be an int >= 1, got 0$"),
        ({"seq_len": 8, "cp_size": True}, TypeError, r"^cp_size must be an int >= 1, got bool True$"),
        ({"seq_len": 8, "max_documents": 0}, ValueError, r"^max_documents must be an int >= 1, got 0$"),
        ({"seq_len": 8, "seed": -1}, ValueError, r"^seed must be an int >= 0, got -1$"),
        ({"seq_len": 8, "search_steps": "10"}, TypeError, r"^search_steps must be an int >= 0, got str '10'$"),
        ({"seq_len": 6, "pad_to_multiple_of": 4}, ValueError, r"^seq_len=6 must be a multiple of pad_to_multiple_of=4$"),
        ({"seq_len": 6, "cp_size": 2}, ValueError, r"^seq_len=6 must be a multiple of 4 \(pad_to_multiple_of=1, cp_size=2: lcm\(pad_to_multiple_of, 2 \* cp_size\)\)$"),
    ],
)  # fmt: skip
def test_pack_options_name_the_field_and_the_value(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        PackOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rows_per_micro_batch": 0}, ValueError, r"^rows_per_micro_batch must be an int >= 1, got 0$"),
        ({"micro_batches": 1.5}, TypeError, r"^micro_batches must be an int >= 1, got float 1\.5$"),
        ({"dp_rank": -1}, ValueError, r"^dp_rank must be an int >= 0, got -1$"),
        ({"dp_rank": 2, "dp_size": 2}, ValueError, r"^dp_rank=2 is outside dp_size=2 \(0 <= dp_rank < dp_size\)$"),
        ({"balance": "flops"}, ValueError, r"^balance must be one of \('token', 'compute'\), got 'flops'$"),
        ({"balance": "compute"}, TypeError, r"^balance='compute' needs cost=CostModel\(\.\.\.\), got None"),
        ({"cost": (1, 2)}, TypeError, r"^cost must be a CostModel or None, got tuple$"),
        ({"loss_fields": 1}, TypeError, r"^loss_fields must be True or False, got 1$"),
        ({"split_documents": "halves"}, ValueError, r"^split_documents='halves'; choose one of \('whole', 'pieces'\)"),
        ({"pad_token_id": -3}, ValueError, r"^pad_token_id must be an int >= 0, got -3$"),
    ],
)  # fmt: skip
def test_load_options_name_the_field_and_the_value(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        LoadOptions(**kwargs)


def test_options_convert_numpy_ints_and_compute_what_they_imply() -> None:
    p = PackOptions(seq_len=np.int64(48), cp_size=np.int32(4), pad_to_multiple_of=3)
    assert type(p.seq_len) is int and type(p.cp_size) is int and p.multiple == 24
    load = LoadOptions(rows_per_micro_batch=2, micro_batches=3, dp_size=4, dp_rank=np.int64(3))
    assert load.rows_per_step == 24 and type(load.dp_rank) is int
    assert LoadOptions(loss_fields=True, split_documents="pieces").split_documents == "pieces"


def test_one_default_each_read_by_every_entry_point() -> None:
    """The defaults live in the classes: the CLI's flags, `plan`, `StreamingPacker`,
    `PackWriter` and `PackedDataset` all take them from there (balance "token" everywhere)."""
    from megapack.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[union-attr]
    for command, names in (
        ("pack", ("algorithm", "long_docs", "seed", "cp_size", "pad_to_multiple_of", "search_steps")),
        ("stats", ("seed", "cp_size", "pad_to_multiple_of", "search_steps")),
    ):  # fmt: skip
        defaults = {a.dest: a.default for a in sub[command]._actions}
        assert {n: defaults[n] for n in names} == {n: default_of(PackOptions, n) for n in names}
    assert default_of(LoadOptions, "balance") == "token"
    ds = PackedDataset(docs(), 64)
    assert ds.packing == PackOptions(seq_len=64) and ds.loading == LoadOptions()
    assert StreamingPacker(64).packing == PackOptions(seq_len=64)
    assert StreamingPacker(64).state_dict()["config"]["balance"] == "token"


def test_no_entry_point_keeps_a_copy_of_the_settings(tmp_path: Path) -> None:
    """Each reads its settings from the options objects: none has them as attributes."""
    flat = [f.name for kind in (PackOptions, LoadOptions) for f in dataclasses.fields(kind)]
    ds = PackedDataset(docs(), 64, dp_size=2, micro_batches=1)
    writer = PackWriter(tmp_path / "w", 64)
    packer = StreamingPacker(64, loading=LoadOptions(dp_size=2))
    counts = {"pad_token_id", "split_documents"}  # the pad id read back; the writer's count
    for holder in (ds, writer, packer):
        assert not [n for n in flat if n not in counts and hasattr(holder, n)], holder
    assert not hasattr(writer, "settings") and not hasattr(packer, "capacity")


def test_every_pack_option_is_recorded_by_the_folder_the_writer_and_the_stream(
    tmp_path: Path,
) -> None:
    """Adding a field to `PackOptions` reaches meta.json, a resumed pack's check and a stream's
    state with no other edit: all three take the whole `to_dict`."""
    names = {f.name for f in dataclasses.fields(PackOptions)}
    packing = PackOptions(seq_len=64, algorithm="ffd", long_docs="truncate", pad_to_multiple_of=4,
                          cp_size=2, max_documents=9, seed=5, search_steps=7)  # fmt: skip
    ds = PackedDataset(docs(), packing)
    assert set(ds.meta["packing"]) == names and ds.packing is packing
    ds.save(tmp_path / "p")
    assert PackedDataset.load(tmp_path / "p").packing == packing  # a folder says how it was packed
    writer = PackWriter(tmp_path / "w", packing)
    assert names <= set(writer._settings())
    assert writer.write(iter(docs()))["packing"] == packing.to_dict()
    assert PackedDataset.load(tmp_path / "w").packing == packing
    assert names <= set(StreamingPacker(packing).state_dict()["config"])
    with pytest.raises(ValueError, match=r"has 'x', which PackOptions does not know"):
        PackOptions.from_dict({**packing.to_dict(), "x": 1})
    with pytest.raises(TypeError, match=r"^packing options must be a dict of PackOptions fields"):
        PackOptions.from_dict(None)


def test_load_shortcuts_build_the_same_load_options(tmp_path: Path) -> None:
    """``PackedDataset.load(path, rows_per_micro_batch=2, ...)`` (what quickstarts write) is
    ``PackedDataset.load(path, LoadOptions(...))``: the same options, batches and settings; a
    shortcut given with an options object replaces that field; a packing field is refused (the
    folder records it), and so is a name that is no option."""
    PackedDataset(docs(), 64).save(tmp_path / "p")
    given = {"rows_per_micro_batch": 2, "micro_batches": 2, "dp_rank": 1, "dp_size": 2}
    short = PackedDataset.load(tmp_path / "p", **given)
    spelled = PackedDataset.load(tmp_path / "p", LoadOptions(**given))
    assert short.loading == spelled.loading == LoadOptions(**given)
    assert short.settings() == spelled.settings()
    assert [b.tokens.tolist() for b in short] == [b.tokens.tolist() for b in spelled]
    mixed = PackedDataset.load(tmp_path / "p", LoadOptions(**given), dp_rank=0)
    assert mixed.loading == LoadOptions(**{**given, "dp_rank": 0})
    with pytest.raises(TypeError, match=r"^PackedDataset\.load: seq_len= is how the folder was"):
        PackedDataset.load(tmp_path / "p", seq_len=64)
    with pytest.raises(TypeError, match=r"^PackedDataset\.load got an unexpected keyword argument "
                                        r"'dp'; its shortcuts are the fields of PackOptions"):  # fmt: skip
        PackedDataset.load(tmp_path / "p", dp=2)
    with pytest.raises(ValueError, match=r"^dp_rank=2 is outside dp_size=2"):
        PackedDataset.load(tmp_path / "p", dp_rank=2, dp_size=2)


def test_dataset_shortcuts_build_the_same_options() -> None:
    """``PackedDataset(docs, seq_len=..., dp_rank=...)`` routes each keyword to the class that
    defines it: the same dataset as the options spelled out, or as ``seq_len`` given alone."""
    cost = CostModel(a=1, b=1)
    pack = {"seq_len": 64, "pad_to_multiple_of": 8, "algorithm": "ffd", "seed": 3}
    load = {"dp_rank": 1, "dp_size": 2, "balance": "compute", "cost": cost, "micro_batches": 2}
    short = PackedDataset(docs(), **pack, **load)
    spelled = PackedDataset(docs(), PackOptions(**pack), LoadOptions(**load))
    positional = PackedDataset(docs(), 64, pad_to_multiple_of=8, algorithm="ffd", seed=3, **load)
    for ds in (spelled, positional):
        assert (ds.packing, ds.loading) == (short.packing, short.loading)
        assert ds.meta == short.meta and ds.order().tolist() == short.order().tolist()
    assert short.settings() == spelled.settings()
    assert PackedDataset(docs(), PackOptions(**pack), seed=4).packing.seed == 4  # replaced
    with pytest.raises(TypeError, match="got seq_len twice"):
        PackedDataset(docs(), 64, seq_len=64)
    with pytest.raises(TypeError, match="needs seq_len"):
        PackedDataset(docs())
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'time_limit_s'"):
        PackedDataset(docs(), 64, time_limit_s=1.0)


def test_plan_shortcuts_are_pack_options() -> None:
    lengths = np.random.default_rng(1).integers(1, 50, 200)
    options = PackOptions(seq_len=64, algorithm="best", seed=2, search_steps=100, max_documents=4)
    assert plan(lengths, options) == plan(lengths, 64, algorithm="best", seed=2, search_steps=100,
                                           max_documents=4)  # fmt: skip
    assert plan(lengths, options, seed=3) == plan(lengths, dataclasses.replace(options, seed=3))


def test_shortcut_helpers() -> None:
    assert pack_options(8, {"seed": 1}, where="x") == PackOptions(seq_len=8, seed=1)
    assert with_shortcuts(LoadOptions, None, {}, where="x") == LoadOptions()
    assert split_shortcuts({"seq_len": 8, "dp_size": 2}, where="x") == (
        {"seq_len": 8},
        {"dp_size": 2},
    )
    pack_names = {f.name for f in dataclasses.fields(PackOptions)}
    assert not pack_names & {f.name for f in dataclasses.fields(LoadOptions)}  # routed by name
    with pytest.raises(TypeError, match=r"^x: expected LoadOptions, got PackOptions"):
        with_shortcuts(LoadOptions, PackOptions(seq_len=8), {}, where="x")  # type: ignore[arg-type]


def test_docstring_examples() -> None:
    import doctest

    assert doctest.testmod(options).failed == 0
