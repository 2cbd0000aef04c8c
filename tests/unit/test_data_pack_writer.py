"""PackWriter: the streamed pack is PackedDataset.save's directory byte for byte, and resumes exactly."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.cli.progress import Progress
from megapack.data import Document, PackedDataset, read_jsonl
from megapack.data.convert import DocumentBatch
from megapack.data.pack_writer import PackWriter
from megapack.packing import PackOptions

NAMES = ("tokens", "loss_mask", "doc_offsets", "slices", "bin_offsets", "origins")


def corpus(path: Path, n: int = 60) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        if i % 3 == 0:
            turns = [{"role": "user", "content": "q" * int(rng.integers(1, 30))},
                     {"role": "assistant", "content": "a" * int(rng.integers(1, 90))}] * 2  # fmt: skip
            lines.append(json.dumps({"messages": turns}))
        else:
            lines.append(
                json.dumps(
                    {
                        "prompt": "p" * int(rng.integers(1, 20)),
                        "completion": "c" * int(rng.integers(1, 120)),
                    }
                )
            )
        if i == 20:
            lines.append("")  # a blank line
        if i == 40:
            lines.append('{"text": ""}')  # a bad line
    path.write_text("\n".join(lines) + "\n")
    return path


def same_dirs(a: Path, b: Path) -> None:
    """The same arrays and meta, and the same files byte for byte (the module's promise)."""
    for name in NAMES:
        x, y = np.load(a / f"{name}.npy"), np.load(b / f"{name}.npy")
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert json.loads((a / "meta.json").read_text()) == json.loads((b / "meta.json").read_text())
    for name in [*(f"{n}.npy" for n in NAMES), "meta.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize(
    ("long_docs", "multiple", "cp"),
    [("split", 1, 1), ("split", 4, 1), ("truncate", 2, 1), ("drop", 1, 1), ("split", 1, 2)],
)
def test_pack_writer_matches_packed_dataset_save(
    tmp_path: Path, long_docs: str, multiple: int, cp: int
) -> None:
    src = corpus(tmp_path / "d.jsonl")
    docs = list(read_jsonl(src, skip_bad=True))
    PackedDataset(
        docs, 128, pad_to_multiple_of=multiple, cp_size=cp, long_docs=long_docs, pad_token_id=256
    ).save(tmp_path / "ref")
    writer = PackWriter(tmp_path / "out", PackOptions(seq_len=128, pad_to_multiple_of=multiple, cp_size=cp, long_docs=long_docs), pad_token_id=256, buffer_tokens=100)  # fmt: skip
    meta = writer.write(read_jsonl(src, skip_bad=True))
    assert PackOptions.from_dict(meta["packing"]).multiple == max(multiple, 2 * cp if cp > 1 else 1)
    same_dirs(tmp_path / "ref", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [*(f"{n}.npy" for n in NAMES), "meta.json"]
    )
    loaded, ref = PackedDataset.load(tmp_path / "out"), PackedDataset.load(tmp_path / "ref")
    assert len(loaded) == len(ref) == meta["rows"]
    assert all(np.array_equal(loaded[i].tokens, ref[i].tokens) for i in range(len(ref)))
    # the same through whole DocumentBatches (megapack pack's way), some holding long documents
    writer = PackWriter(tmp_path / "batched", PackOptions(seq_len=128, pad_to_multiple_of=multiple, cp_size=cp, long_docs=long_docs), pad_token_id=256, buffer_tokens=100)  # fmt: skip
    assert writer.write(read_jsonl(src, skip_bad=True).batches()) == meta
    same_dirs(tmp_path / "ref", tmp_path / "batched")


def interrupted(docs: Iterator[Document], after: int) -> Iterator[Document]:
    for i, doc in enumerate(docs):
        if i == after:
            raise KeyboardInterrupt  # the job is killed
        yield doc


def batched(docs: Sequence[Document], size: int) -> Iterator[DocumentBatch]:
    """``docs`` as DocumentBatches of ``size`` documents (the last one shorter), a reader's way."""
    for first in range(0, len(docs), size):
        part = docs[first : first + size]
        lengths = [len(d) for d in part]
        yield DocumentBatch(
            tokens=np.concatenate([d.tokens for d in part]),
            loss_mask=np.concatenate([d.loss_mask for d in part]),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            boundaries=tuple(d.boundaries for d in part),
            sources=tuple(d.source for d in part),
        )


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    every=st.integers(1, 5),
    stops=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    batch=st.sampled_from([0, 1, 3, 7]),
    buffer_tokens=st.integers(1, 100),
    seed=st.integers(0, 2**16),
)
def test_regression_pack_writer_default_checkpoint_resumes_without_repeating(
    lengths: list[int], every: int, stops: list[int], batch: int, buffer_tokens: int, seed: int
) -> None:
    """Issue 27 (8). Without ``position`` (inputs with no row count: .npy, .bin/.idx), a checkpoint
    records the documents read so far, counted from the start of the whole pack; a resumed run
    skips exactly that many (``islice``). One too many or too few and a document is lost or
    written twice. Killed any number of times, at any item, the pack equals one uninterrupted
    `PackedDataset.save`."""
    rng = np.random.default_rng(seed)
    docs = [
        Document(tokens=rng.integers(0, 1000, n), loss_mask=rng.integers(0, 2, n), source=f"d[{i}]")
        for i, n in enumerate(lengths)
    ]

    def items(rest: Sequence[Document]) -> Iterator[Document | DocumentBatch]:
        return iter(rest) if batch == 0 else batched(rest, batch)

    with tempfile.TemporaryDirectory() as tmp:
        ref, out = Path(tmp) / "ref", Path(tmp) / "out"
        PackedDataset(docs, 32).save(ref)
        done = 0  # documents behind the last checkpoint
        for stop in stops:
            writer = PackWriter(out, 32, resume=True, checkpoint_every=every,
                                buffer_tokens=buffer_tokens)  # fmt: skip
            assert writer.rows_done == done
            sizes = [1] * (len(docs) - done) if batch == 0 else [
                min(batch, len(docs) - first) for first in range(done, len(docs), batch)
            ]  # fmt: skip
            stop %= len(sizes)  # killed while reading item `stop` of this run
            with pytest.raises(KeyboardInterrupt):
                writer.write(interrupted(items(docs[done:]), stop))
            start, read, since = done, 0, 0  # a checkpoint follows the item that makes
            for size in sizes[:stop]:  # `every` documents since the last one
                read, since = read + size, since + size
                if since >= every:
                    done, since = start + read, 0
        writer = PackWriter(out, 32, resume=True, checkpoint_every=every)
        assert writer.rows_done == done
        writer.write(items(docs[done:]))
        same_dirs(ref, out)


def test_regression_pack_cli_resume_without_row_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27 (8), through ``megapack pack --resume --checkpoint-every``: a ``.npy`` token
    stream has no row count, so the CLI relies on the writer's own count of documents and skips
    them with ``islice`` on resume."""
    from megapack.cli import main, progress

    rng = np.random.default_rng(3)
    stream = np.concatenate(
        [np.append(rng.integers(0, 255, n), 255) for n in rng.integers(1, 60, 23)]
    )
    src = tmp_path / "tokens.npy"
    np.save(src, stream)
    args = ["pack", str(src), "--eos-id", "255", "--seq-len", "64", "--checkpoint-every", "4"]
    assert main([*args, "--out", str(tmp_path / "ref")]) == 0
    calls = 0
    real_update = progress.Progress.update

    def killed_at_the_eleventh(self: progress.Progress, documents: int, tokens: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 11:
            raise KeyboardInterrupt  # after document 11 is read, before its checkpoint
        real_update(self, documents, tokens)

    monkeypatch.setattr(progress.Progress, "update", killed_at_the_eleventh)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(tmp_path / "out")])
    monkeypatch.setattr(progress.Progress, "update", real_update)
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "out"), "--resume"]) == 0
    assert "resuming after 8 input rows (8 documents)" in capsys.readouterr().err
    same_dirs(tmp_path / "ref", tmp_path / "out")


def test_pack_writer_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    src = corpus(tmp_path / "d.jsonl")
    full = PackWriter(tmp_path / "full", 128)
    full.write(read_jsonl(src, skip_bad=True))
    first = PackWriter(tmp_path / "out", 128, checkpoint_every=7, config={"input": str(src)})
    reader = read_jsonl(src, skip_bad=True, workers=1)
    with pytest.raises(KeyboardInterrupt):
        first.write(interrupted(reader, 45), position=lambda: reader.rows_done)
    assert (tmp_path / "out" / "progress.json").is_file() and not (
        tmp_path / "out" / "meta.json"
    ).exists()
    assert first.rows_done == 43  # 42 documents (6 checkpoints) + the bad line among them
    with pytest.raises(ValueError, match=r"unfinished pack.*--resume"):
        PackWriter(tmp_path / "out", 128, checkpoint_every=7, config={"input": str(src)})
    with pytest.raises(ValueError, match=r"started with seq_len=128, this run has seq_len=256"):
        PackWriter(
            tmp_path / "out", 256, resume=True, checkpoint_every=7, config={"input": str(src)}
        )
    with pytest.raises(ValueError, match=r"started with input='.*d.jsonl', this run has input='x'"):
        PackWriter(tmp_path / "out", 128, resume=True, config={"input": "x"})
    again = PackWriter(
        tmp_path / "out", 128, resume=True, checkpoint_every=7, config={"input": str(src)}
    )
    assert again.rows_done == 43 and 42 <= again.documents < first.documents  # pieces of 42 docs
    rest = read_jsonl(src, skip_bad=True, skip=again.rows_done)
    again.write(rest, position=lambda: rest.rows_done)
    same_dirs(tmp_path / "full", tmp_path / "out")
    assert not (tmp_path / "out" / "progress.json").exists()
    with pytest.raises(ValueError, match="already holds a finished pack"):
        PackWriter(tmp_path / "out", 128)


def test_pack_writer_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seq_len must be an int >= 1, got 0"):
        PackWriter(tmp_path, 0)
    with pytest.raises(
        TypeError, match=r"^seq_len must be an int >= 1, got dict \{'seq_len': 8\}$"
    ):
        PackWriter(tmp_path, {"seq_len": 8})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^pad_token_id must be an int >= 0, got -1$"):
        PackWriter(tmp_path, 8, pad_token_id=-1)
    with pytest.raises(ValueError, match=r"^documents is empty: nothing to pack$"):
        PackWriter(tmp_path / "e", 8).write([])
    for name in ("checkpoint_every", "buffer_tokens"):
        with pytest.raises(ValueError, match=rf"^{name} must be an int >= 1, got 0$"):
            PackWriter(tmp_path / "z", 8, **{name: 0})


def test_pack_cli_resume_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megapack.cli import main

    src = corpus(tmp_path / "d.jsonl")
    out = tmp_path / "out"
    args = [
        "pack",
        str(src),
        "--seq-len",
        "128",
        "--skip-bad",
        "--out",
        str(out),
        "--checkpoint-every",
        "5",
    ]
    writer = PackWriter(out, PackOptions(seq_len=128), pad_token_id=256, checkpoint_every=5, config={"input": str(src.resolve()), "tokenizer": None})  # fmt: skip
    reader = read_jsonl(src, skip_bad=True)
    with pytest.raises(KeyboardInterrupt):
        writer.write(interrupted(reader, 12), position=lambda: reader.rows_done)
    assert main(args) == 2 and "--resume" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0
    assert "resuming after 10 input rows" in capsys.readouterr().err
    assert (
        main(["pack", str(src), "--seq-len", "128", "--skip-bad", "--out", str(tmp_path / "ref")])
        == 0
    )
    same_dirs(tmp_path / "ref", out)


def test_pack_cli_never_imports_torch(tmp_path: Path) -> None:
    """Reading, packing and planning are numpy only: no torch import time (~1.3 s) or memory."""
    src = corpus(tmp_path / "d.jsonl")
    script = (
        "import sys\nfrom megapack.cli import main\n"
        f"code = main(['pack', {str(src)!r}, '--seq-len', '128', '--skip-bad', '--cp-size', '2', "
        f"'--out', {str(tmp_path / 'out')!r}])\n"
        "print(code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "0 []"
    packing = json.loads((tmp_path / "out" / "meta.json").read_text())["packing"]
    assert PackOptions.from_dict(packing) == PackOptions(seq_len=128, cp_size=2)


def test_pack_progress_plain_lines_without_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress("pack", stream=stream, every_s=0.0, input_bytes=10_000_000, tty=False)
    for i in range(1, 1025):
        progress.update(i, 100 * i)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 5  # every 256 updates, then the end
    assert lines[0].startswith("pack: 256 documents, 0.0M tokens")
    assert (
        lines[-1].startswith("pack: done, 1,024 documents, 0.1M tokens")
        and "MB/s of input" in lines[-1]
    )
    bar = io.StringIO()
    progress = Progress("pack", stream=bar, tty=True)
    progress.update(5, 50)
    progress.close()
    assert "pack" in bar.getvalue() and "5" in bar.getvalue()


def test_pack_writer_defaults_and_a_nested_output(tmp_path: Path) -> None:
    writer = PackWriter(tmp_path / "a" / "b" / "packed", 8)  # parents are created
    assert (writer.checkpoint_every, writer.buffer_tokens) == (100_000, 1 << 16)
    docs = [Document(tokens=[1, 2, 3], loss_mask=[1, 1, 1])]
    assert writer.write(docs)["documents"] == 1


def test_pack_writer_writes_whenever_buffer_tokens_are_held(tmp_path: Path) -> None:
    """``buffer_tokens``: tokens held before a write, so memory stays bounded. One-token
    documents and a buffer of 4: the held arrays go out at documents 4, 8 and 12; batches of two
    documents: at every second batch. (What is held is the writer's own buffer: the file object's
    buffering is the operating system's business.)"""
    docs = [Document(tokens=[d], loss_mask=[1]) for d in range(13)]
    for batch, want in ((0, [1, 2, 3, 0] * 3 + [1]), (2, [2, 0] * 3 + [1])):
        writer = PackWriter(tmp_path / f"b{batch}", 8, buffer_tokens=4)
        held: list[int] = []

        def record(
            documents: int, tokens: int, writer: PackWriter = writer, held: list = held
        ) -> None:
            held.append(sum(len(part) for part in writer._buffers["tokens"]))

        writer.write(iter(docs) if batch == 0 else batched(docs, batch), on_progress=record)
        assert held == want


def test_pack_writer_config_takes_any_value_and_compares_every_key(tmp_path: Path) -> None:
    """The config is stored as JSON (values that are not JSON, e.g. paths or `Fields`, as
    their text); a key added or removed between runs is a different configuration."""
    from megapack.data import Fields

    src = corpus(tmp_path / "d.jsonl")
    config = {"input": src, "fields": Fields(text="body")}
    first = PackWriter(tmp_path / "out", 128, checkpoint_every=5, config=config)
    assert first.config == {"input": str(src), "fields": str(Fields(text="body"))}
    with pytest.raises(KeyboardInterrupt):
        first.write(interrupted(read_jsonl(src, skip_bad=True), 12))
    for other, message in [
        ({**config, "shard": (0, 2)}, r"started with shard=None, this run has shard=\[0, 2\]"),
        (
            {"input": src},
            r"started with fields=.Fields\(text='body'.*\)., this run has fields=None",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            PackWriter(tmp_path / "out", 128, resume=True, checkpoint_every=5, config=other)
    cp = PackWriter(
        tmp_path / "cp", PackOptions(seq_len=8, cp_size=2), checkpoint_every=1
    )  # padding multiple 4
    with pytest.raises(KeyboardInterrupt):
        cp.write(interrupted(iter([Document(tokens=[1, 2], loss_mask=[1, 1])] * 3), 2))
    with pytest.raises(  # the same multiple, lcm(4, 2 * 2), from another setting
        ValueError, match="started with pad_to_multiple_of=1, this run has pad_to_multiple_of=4"
    ):
        PackWriter(
            tmp_path / "cp", PackOptions(seq_len=8, cp_size=2, pad_to_multiple_of=4), resume=True
        )
    assert PackWriter(tmp_path / "out", 128, resume=True, config=config).rows_done == 10


def test_pack_writer_resume_edge_cases(tmp_path: Path) -> None:
    """A crash while finishing (meta.json beside progress.json) redoes the end; an older
    progress.json without the input counters resumes counting from there; another version, or a
    finished pack, is refused with the fix."""
    docs = [Document(tokens=np.arange(1, n + 1), loss_mask=np.ones(n)) for n in range(1, 25)]
    out = tmp_path / "out"
    writer = PackWriter(out, 32, checkpoint_every=4)
    with pytest.raises(KeyboardInterrupt):
        writer.write(interrupted(iter(docs), 10))  # checkpoints after 4 and 8 documents
    (out / "meta.json").write_text("{}")  # the end had begun
    progress = json.loads((out / "progress.json").read_text())
    for key in ("input_documents", "split_documents"):
        del progress[key]
    (out / "progress.json").write_text(json.dumps(progress))
    again = PackWriter(out, 32, resume=True, checkpoint_every=4)
    assert not (out / "meta.json").exists() and again.rows_done == 8
    meta = again.write(iter(docs[8:]))
    assert (meta["documents"], meta["input_documents"], meta["split_documents"]) == (24, 16, 0)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(f"{n}.npy" for n in NAMES), "meta.json"]
    )  # lengths.partial and progress.json are gone
    with pytest.raises(
        ValueError,
        match=rf"^{out} already holds a finished pack \(meta\.json\): choose another --out or "
        "remove it$",
    ):
        PackWriter(out, 32)
    (out / "progress.json").write_text(json.dumps({**progress, "version": 2}))
    with pytest.raises(
        ValueError,
        match=rf"^{out / 'progress.json'} has version 2; this megapack resumes version 1: remove "
        "the directory to start over$",
    ):
        PackWriter(out, 32, resume=True)
    with pytest.raises(
        ValueError,
        match=rf"^{out} holds an unfinished pack \({out / 'progress.json'}\): pass --resume "
        r"\(resume=True\) to continue it, or remove the directory to start over$",
    ):
        PackWriter(out, 32)


def test_fingerprint_and_tokenizer_recorded_at_pack_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """meta.json records the contents' fingerprint (the same as PackedDataset's for the same
    documents) and what the packer knows of the tokenizer; load checks the fingerprint against
    the arrays, and computes it (logged) for a directory packed before it was recorded."""
    import logging

    rng = np.random.default_rng(3)
    docs = [Document(tokens=rng.integers(0, 300, int(n)), loss_mask=np.ones(int(n)))
            for n in rng.integers(1, 50, 40)]  # fmt: skip
    writer = PackWriter(tmp_path / "w", 64, tokenizer="my/tokenizer.json", vocab_size=300, eos_id=2)
    meta = writer.write(iter(docs))
    in_memory = PackedDataset(docs, 64)
    assert meta["fingerprint"] == in_memory.meta["fingerprint"]
    assert meta["fingerprint"].startswith("blake2b-128:")
    assert (meta["tokenizer"], meta["vocab_size"], meta["eos_id"]) == ("my/tokenizer.json", 300, 2)
    assert (in_memory.meta["tokenizer"], in_memory.meta["vocab_size"]) == (None, None)
    assert PackedDataset.load(tmp_path / "w").meta["fingerprint"] == meta["fingerprint"]
    old = json.loads((tmp_path / "w" / "meta.json").read_text())
    del old["fingerprint"]  # as an earlier megapack wrote it
    (tmp_path / "w" / "meta.json").write_text(json.dumps(old))
    with caplog.at_level(logging.INFO, logger="megapack.data.packed_dir"):
        loaded = PackedDataset.load(tmp_path / "w")
    assert loaded.meta["fingerprint"] == meta["fingerprint"]
    assert "records no fingerprint (packed by an earlier megapack): computed it" in caplog.text
    (tmp_path / "w" / "meta.json").write_text(json.dumps(meta))
    tokens = np.load(tmp_path / "w" / "tokens.npy")
    tokens[0] += 1  # the first token is always sampled
    np.save(tmp_path / "w" / "tokens.npy", tokens)
    from megapack.data.fingerprint import fingerprint

    names = ("tokens", "loss_mask", "doc_offsets", "slices", "bin_offsets")
    changed = fingerprint({n: np.load(tmp_path / "w" / f"{n}.npy") for n in names})
    assert changed != meta["fingerprint"]
    with pytest.raises(ValueError, match=rf"the arrays' fingerprint is {changed}, meta.json records "
                                         rf"{meta['fingerprint']}: the files of .* changed after they were packed"):  # fmt: skip
        PackedDataset.load(tmp_path / "w")
    with pytest.raises(TypeError, match="tokenizer must be a name"):
        PackWriter(tmp_path / "x", 64, tokenizer=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1, got 0"):
        PackWriter(tmp_path / "y", 64, vocab_size=0)


def test_fingerprint_and_tokenizer_of_megapack_pack(tmp_path: Path) -> None:
    """`megapack pack` of text records the byte tokenizer it used; of token arrays, none (their
    --eos-id where given)."""
    from megapack.cli import main

    corpus(tmp_path / "c.jsonl", n=12)
    assert main(["pack", str(tmp_path / "c.jsonl"), "--seq-len", "256", "--skip-bad",
                 "--out", str(tmp_path / "p")]) == 0  # fmt: skip
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["eos_id"]) == (
        "megapack.data.ByteTokenizer",
        259,
        257,
    )
    assert meta["fingerprint"] == PackedDataset.load(tmp_path / "p").meta["fingerprint"]
    np.save(tmp_path / "t.npy", np.array([5, 6, 1, 7, 1], dtype=np.int64))
    assert main(["pack", str(tmp_path / "t.npy"), "--seq-len", "8", "--eos-id", "1",
                 "--out", str(tmp_path / "q")]) == 0  # fmt: skip
    meta = json.loads((tmp_path / "q" / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["eos_id"]) == (None, None, 1)
