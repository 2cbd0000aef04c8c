"""First-run rough edges of the `megapack` command, each pinned: help, counts, plurals, one-line errors.

In-process calls of `megapack.cli.main` where possible (fast); subprocesses where the point is the
process itself (what ``--help`` imports, ``python -m megapack``, the demo run without torchrun).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megapack.cli import main
from megapack.cli.pack_report import plural

ROOT = Path(__file__).resolve().parents[2]
Capture = pytest.CaptureFixture[str]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def one_line_error(err: str, command: str) -> str:
    """The single stderr line of a failed command (progress lines aside), with no traceback."""
    lines = [
        line for line in err.splitlines() if line and not line.startswith(("reading ", "packing "))
    ]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"megapack {command}: error: "), err
    return lines[0]


# -- help ------------------------------------------------------------------------------------------
def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from megapack.cli import main\n"
        "for argv in (['--help'], ['pack', '--help'], ['stats', '--help'], ['bench', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))\n"
    )
    done = run("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_python_dash_m_megapack_is_the_cli() -> None:
    done = run("-m", "megapack", "--help")
    assert done.returncode == 0 and "usage: megapack" in done.stdout and "pack" in done.stdout
    done = run("-m", "megapack", "pack")
    assert done.returncode == 2 and "required" in done.stderr


def test_pack_help_explains_every_option_with_its_default(capsys: Capture) -> None:
    with pytest.raises(SystemExit):
        main(["pack", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrap argparse's line breaks
    for flag, default in [
        ("--algorithm", "bfd"),
        ("--long-docs", "split"),
        ("--pad-to-multiple-of", "1"),
        ("--seed", "0"),
    ]:
        m = re.search(rf"{flag} \S+ (.*?)\(default: {default}\)", text)
        assert m and len(m.group(1)) > 20, (flag, text)  # a real explanation before the default
    assert "--eos-token" in text and "--eos-id" in text
    assert "(default: None)" not in text and "(default: False)" not in text


# -- counts and plurals ----------------------------------------------------------------------------
def test_pack_reports_inputs_splits_truncations_and_drops(tmp_path: Path, capsys: Capture) -> None:
    src = jsonl(tmp_path / "d.jsonl", ["a" * 10, "b" * 100, "c" * 20])  # +1 eos each: 11, 101, 21
    assert main(["pack", src, "--seq-len", "32", "--out", str(tmp_path / "o1")]) == 0
    text = capsys.readouterr().out
    assert f"read 3 documents from {src}\n" in text
    assert (
        "1 of 3 documents longer than --seq-len 32: split into pieces (6 pieces packed in all)\n"
        in text
    )
    assert (
        main(
            [
                "pack",
                src,
                "--seq-len",
                "32",
                "--out",
                str(tmp_path / "o2"),
                "--long-docs",
                "truncate",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "1 of 3 documents longer than --seq-len 32: truncated (69 tokens lost)\n" in text
    assert ": split into" not in text and ": dropped" not in text
    assert (
        main(["pack", src, "--seq-len", "32", "--out", str(tmp_path / "o3"), "--long-docs", "drop"])
        == 0
    )
    text = capsys.readouterr().out
    assert "1 of 3 documents longer than --seq-len 32: dropped (101 tokens lost)\n" in text
    assert "packed into 1 row of 32 tokens" in text and "(lower bound 1 row)" in text


def test_singular_counts(tmp_path: Path, capsys: Capture) -> None:
    assert [plural(1, "row"), plural(2, "row"), plural(0, "document"), plural(1234, "token")] == [
        "1 row",
        "2 rows",
        "0 documents",
        "1,234 tokens",
    ]
    src = jsonl(tmp_path / "one.jsonl", ["hello"])
    assert main(["pack", src, "--seq-len", "64", "--out", str(tmp_path / "p")]) == 0
    text = capsys.readouterr().out
    assert "read 1 document from" in text and "packed into 1 row of 64 tokens" in text
    assert main(["stats", src, "--seq-len", "64", "--search-steps", "300"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("1 document, 6 tokens;") and "0 of 1 document longer" in text
    assert re.search(r"\b1 (rows|documents|tokens)\b", text) is None, text


def test_stats_lower_bound_counts_every_token_of_long_documents(
    tmp_path: Path, capsys: Capture
) -> None:
    src = jsonl(tmp_path / "long.jsonl", ["x" * 300, "y" * 250, "z" * 10])
    assert main(["stats", src, "--seq-len", "64", "--search-steps", "300"]) == 0
    text = capsys.readouterr().out
    bfd = float(re.search(r"\| bfd \| [\d,]+ \| ([\d.]+)%", text).group(1))  # type: ignore[union-attr]
    bound = float(re.search(r"\| lower bound \| [\d,]+ \| <= ([\d.]+)%", text).group(1))  # type: ignore[union-attr]
    assert bfd <= bound  # a bound below what bfd achieves would be no bound (once "<= 38.84%")


def test_an_input_with_no_documents_is_named_exits_2_and_leaves_nothing(
    tmp_path: Path, capsys: Capture
) -> None:
    """Empty, blank-only, or (with --skip-bad) every line bad: ``stats`` and ``pack`` each say so
    in one line naming the file, exit 2 (docs/data.md), and write no --json, --plot or --out."""
    empty, blank, bad = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("")
    blank.write_text("\n  \n")
    bad.write_text('{"nope": 1}\n{"nope": 2}\n')
    outputs = [tmp_path / "s.json", tmp_path / "s.png", tmp_path / "out"]
    for src, why in ((empty, ""), (blank, ""), (bad, r" \(2 bad lines skipped \{.*\}\)")):
        stats = ["stats", str(src), "--seq-len", "64", "--skip-bad"]
        assert main([*stats, "--json", str(outputs[0]), "--plot", str(outputs[1])]) == 2
        line = one_line_error(capsys.readouterr().err, "stats")
        assert re.fullmatch(rf"megapack stats: error: {src}: no documents in it{why}", line), line
        assert (
            main(["pack", str(src), "--seq-len", "64", "--skip-bad", "--out", str(outputs[2])]) == 2
        )
        captured = capsys.readouterr()
        line = one_line_error(captured.err, "pack")
        assert re.fullmatch(
            rf"megapack pack: error: {src}: no documents in it{why}: nothing to pack", line
        ), line
        assert "done" not in captured.err and captured.out == ""
        assert not any(p.exists() for p in outputs) and not (tmp_path / "out.partial").exists()


# -- one-line errors naming the flag to use --------------------------------------------------------
def test_a_file_that_is_not_a_tokenizer(tmp_path: Path, capsys: Capture) -> None:
    src = jsonl(tmp_path / "d.jsonl", ["hello"])
    bogus = tmp_path / "tokenizer.json"
    bogus.write_text('{"a": 1}')
    assert main(["pack", src, "--seq-len", "64", "--out", str(tmp_path / "p"), "--tokenizer", str(bogus)]) == 2  # fmt: skip
    line = one_line_error(capsys.readouterr().err, "pack")
    assert f"{bogus}: not a Hugging Face tokenizer.json" in line


def test_missing_eos_names_the_eos_token_flag(tmp_path: Path, capsys: Capture) -> None:
    tokenizers = pytest.importorskip("tokenizers")  # in the test extra: never skipped in CI
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<end>": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<end>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    src = jsonl(tmp_path / "d.jsonl", ["hello world"])
    args = ["pack", src, "--seq-len", "8", "--out", str(tmp_path / "p"), "--tokenizer", str(path)]
    assert main(args) == 2
    line = one_line_error(capsys.readouterr().err, "pack")
    assert "found no eos token" in line and "--eos-token" in line and "<end>" in line
    assert main([*args, "--eos-token", "<end>"]) == 0
    assert "read 1 document" in capsys.readouterr().out
    assert main(["pack", src, "--seq-len", "8", "--out", str(tmp_path / "q"), "--eos-token", "x"]) == 2  # fmt: skip
    assert "--eos-token 'x' needs --tokenizer" in one_line_error(capsys.readouterr().err, "pack")


def test_long_document_error_names_the_cli_flag(tmp_path: Path, capsys: Capture) -> None:
    src = jsonl(tmp_path / "d.jsonl", ["x" * 100])
    assert main(["pack", src, "--seq-len", "32", "--out", str(tmp_path / "p"), "--long-docs", "error"]) == 2  # fmt: skip
    line = one_line_error(capsys.readouterr().err, "pack")
    assert f"{src}:1: a document of 101 tokens is longer than seq_len=32 (--seq-len)" in line
    assert "--long-docs split" in line
    assert not (tmp_path / "p").exists() and not (tmp_path / "p.partial").exists()  # nothing left


def test_invalid_json_hint_reads_well(tmp_path: Path, capsys: Capture) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "tab\there"}\n')
    assert main(["stats", str(bad), "--seq-len", "64"]) == 2
    line = one_line_error(capsys.readouterr().err, "stats")
    assert f"{bad}:2" in line and "Invalid control character at column 14" in line
    assert "at at" not in line


def test_numpy_inputs_skip_bad_and_eos_id(tmp_path: Path, capsys: Capture) -> None:
    path = tmp_path / "t.npy"
    np.save(path, np.array([5, 6, 0, 7, 8, 9, 0]))
    out = str(tmp_path / "p")
    assert (
        main(["pack", str(path), "--seq-len", "8", "--out", str(tmp_path / "p0"), "--skip-bad"])
        == 2
    )
    line = one_line_error(capsys.readouterr().err, "pack")
    assert line.startswith(f"megapack pack: error: --skip-bad does not apply to {path}")
    assert main(["pack", str(path), "--seq-len", "8", "--out", str(tmp_path / "p1")]) == 2
    assert "--eos-id" in one_line_error(capsys.readouterr().err, "pack")
    assert main(["pack", str(path), "--seq-len", "8", "--out", out, "--eos-id", "0"]) == 0
    assert "read 2 documents" in capsys.readouterr().out
    jsonl_src = jsonl(tmp_path / "d.jsonl", ["hi"])
    assert (
        main(["pack", jsonl_src, "--seq-len", "8", "--out", str(tmp_path / "p2"), "--eos-id", "0"])
        == 2
    )
    assert "--eos-id does not apply to" in one_line_error(capsys.readouterr().err, "pack")


# -- the demo ----------------------------------------------------------------------------------------
def test_demo_without_torchrun_says_how_to_run_it() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "examples/demo_tp_pp.py", "--tp", "2", "--pp", "2"],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "demo_tp_pp.py: error: not launched by torchrun (no RANK/WORLD_SIZE in the environment); "
        "run it with torchrun --nproc-per-node 4 examples/demo_tp_pp.py --tp 2 --pp 2 "
        "(or bash scripts/demo.sh)"
    ]


def test_demo_with_a_grid_that_does_not_fit() -> None:
    done = run(
        "-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/demo_tp_pp.py",
        "--tp", "3", "--pp", "1", timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("demo_tp_pp.py: error")]
    assert ours == [
        "demo_tp_pp.py: error: --tp 3 x --pp 1 = 3 does not divide the 2 ranks torchrun started; "
        "run it with torchrun --nproc-per-node 3 examples/demo_tp_pp.py --tp 3 --pp 1 "
        "(or bash scripts/demo.sh)"
    ]
    assert "initialize_model_parallel" not in done.stderr  # stopped before megatron was reached


def test_cli_report_docstring_example() -> None:
    import doctest

    from megapack.cli import pack_report as report

    result = doctest.testmod(report)
    assert result.failed == 0 and result.attempted > 0


# -- nothing lost on bad input (issue 33) ------------------------------------------------------------
def chats(path: Path, count: int = 301, cut: int | None = 100, long_every: int = 43) -> str:
    """Chat records as a new user's file: one line cut short, some longer than a 1,024 row."""
    rng = np.random.default_rng(7)
    lines = []
    for i in range(count):
        words = 2000 if i % long_every == 5 else int(rng.integers(5, 60))
        lines.append(json.dumps({"messages": [{"role": "user", "content": "hi " * int(rng.integers(1, 20))},
                                              {"role": "assistant", "content": "ok " * words}]}))  # fmt: skip
    if cut is not None:
        lines[cut] = lines[cut][:90]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_cli_failed_pack_says_no_done_and_leaves_no_out(tmp_path: Path, capsys: Capture) -> None:
    src, out = chats(tmp_path / "sft.jsonl"), tmp_path / "packed"
    assert main(["pack", src, "--seq-len", "1024", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    line = one_line_error(err, "pack")
    assert "done" not in err  # never "done" before it is
    assert line.startswith(f"megapack pack: error: {src}:101: the line: invalid JSON, got '")
    assert re.search(r"Unterminated string starting at column \d+ of 90; .* cut short\?", line), (
        line
    )
    assert "field '<line>'" not in line and "column 1 " not in line
    assert not out.exists() and not (tmp_path / "packed.partial").exists()
    assert (
        main(["pack", str(tmp_path / "missing.jsonl"), "--seq-len", "1024", "--out", str(out)]) == 2
    )
    assert "missing.jsonl: no such JSONL file" in one_line_error(capsys.readouterr().err, "pack")
    assert not out.exists() and not (tmp_path / "packed.partial").exists()


def test_cli_flags_are_checked_before_any_work(tmp_path: Path, capsys: Capture) -> None:
    src = chats(tmp_path / "sft.jsonl", cut=None)
    for argv, message in (
        (["stats", src, "--seq-len", "0"], "--seq-len must be an integer >= 1, got 0"),
        (["pack", src, "--seq-len", "-4", "--out", "o"], "--seq-len must be an integer >= 1, got -4"),
        (["pack", src, "--seq-len", "100", "--pad-multiple", "8", "--out", "o"],
         "--seq-len 100 must be a multiple of 8 (--pad-multiple 8)"),
        (["stats", src, "--seq-len", "64", "--search-steps", "-1"], "--search-steps must be an integer >= 0, got -1"),
        (["stats", src, "--seq-len", "64", "--dp", "0"], "--dp must be an integer >= 1, got 0"),
        (["stats", src, "--seq-len", "64", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
        (["pack", src, "--seq-len", "64", "--max-documents", "0", "--out", "o"], "--max-documents must be an integer >= 1, got 0"),
    ):  # fmt: skip
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and message in one_line_error(
            captured.err, argv[0]
        )  # no histogram
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert main(["pack", src, "--seq-len", "1024", "--out", str(afile)]) == 2
    assert f"--out {afile} is a file" in one_line_error(capsys.readouterr().err, "pack")
    assert afile.read_text() == "mine"


def test_cli_stats_predicts_the_rows_pack_makes(tmp_path: Path, capsys: Capture) -> None:
    src = chats(tmp_path / "sft.jsonl", cut=None)
    assert main(["stats", src, "--seq-len", "1024", "--json", str(tmp_path / "s.json")]) == 0
    predicted = json.loads((tmp_path / "s.json").read_text())["rows_bfd"]
    assert "at message boundaries where possible" in capsys.readouterr().out
    assert main(["pack", src, "--seq-len", "1024", "--out", str(tmp_path / "p")]) == 0
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert meta["rows"] == predicted and meta["split_documents"] == 7


def test_cli_a_failure_after_a_checkpoint_keeps_it_for_resume(
    tmp_path: Path, capsys: Capture
) -> None:
    src, out = chats(tmp_path / "sft.jsonl", count=301, cut=250), tmp_path / "packed"
    argv = ["pack", src, "--seq-len", "1024", "--out", str(out), "--checkpoint-every", "100"]
    assert main(argv) == 2
    line = one_line_error(capsys.readouterr().err, "pack")
    assert f"{src}:251" in line and f"kept in {out}.partial/: rerun with --resume" in line
    assert not out.exists() and (tmp_path / "packed.partial" / "progress.json").is_file()
    assert main(argv) == 2  # not again from scratch over it
    assert "holds an unfinished pack" in one_line_error(capsys.readouterr().err, "pack")
    assert main([*argv, "--resume", "--skip-bad"]) == 0
    assert (out / "meta.json").is_file() and not (tmp_path / "packed.partial").exists()


# -- what pack and stats say about the tokenizer and the long documents (issue 46) -----------------
SKIP_BAD = "; or pass --skip-bad to skip such lines and count them (the report gives the count)"


def test_a_bad_line_names_skip_bad_and_what_it_does(tmp_path: Path, capsys: Capture) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n{"prompt": "no completion"}\n')
    line = (
        f"{bad}:2: field 'completion': missing, got ['prompt']. Hint: each line needs "
        '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [{"role": ..., '
        '"content": ...}, ...]}' + SKIP_BAD
    )
    for command, extra in (("pack", ["--out", str(tmp_path / "p")]), ("stats", []),
                           ("pack", ["--out", str(tmp_path / "w"), "--workers", "2"])):  # fmt: skip
        assert main([command, str(bad), "--seq-len", "64", *extra]) == 2
        assert one_line_error(capsys.readouterr().err, command) == (
            f"megapack {command}: error: {line}"
        )
    assert main(["pack", str(bad), "--seq-len", "64", "--out", str(tmp_path / "p"), "--skip-bad"]) == 0  # fmt: skip
    assert f"read 1 document from {bad}; 1 bad line skipped {{'missing': 1}}\n" in (
        capsys.readouterr().out
    )
    jsonl(tmp_path / "ok.jsonl", ["fine"])  # other errors keep their own words only
    assert main(["pack", str(tmp_path / "ok.jsonl"), "--seq-len", "64", "--out", str(bad)]) == 2
    assert "--skip-bad" not in one_line_error(capsys.readouterr().err, "pack")


def test_a_bad_line_after_a_checkpoint_names_resume_and_skip_bad(
    tmp_path: Path, capsys: Capture
) -> None:
    src, out = chats(tmp_path / "sft.jsonl", count=301, cut=250), tmp_path / "packed"
    argv = ["pack", src, "--seq-len", "1024", "--out", str(out), "--checkpoint-every", "100"]
    assert main(argv) == 2
    line = one_line_error(capsys.readouterr().err, "pack")
    assert f"(the pack so far is kept in {out}.partial/: rerun with --resume" in line
    assert line.endswith(f"or remove it){SKIP_BAD}"), line


def test_pack_and_stats_name_the_tokenizer_and_its_vocab(tmp_path: Path, capsys: Capture) -> None:
    src = jsonl(tmp_path / "d.jsonl", ["hello world"])
    byte = (
        "tokenizer: megapack.data.ByteTokenizer, vocab 259 (the built-in byte tokenizer: "
        "--tokenizer DIR packs with your model's)\n"
    )
    assert main(["pack", src, "--seq-len", "64", "--out", str(tmp_path / "p")]) == 0
    assert f"read 1 document from {src}\n{byte}" in capsys.readouterr().out
    stats = ["stats", src, "--seq-len", "64", "--search-steps", "10"]
    assert main([*stats, "--json", str(tmp_path / "s.json")]) == 0
    assert byte in capsys.readouterr().out
    figures = json.loads((tmp_path / "s.json").read_text())
    assert (figures["tokenizer"], figures["vocab_size"], figures["eos_id"]) == (
        "megapack.data.ByteTokenizer",
        259,
        257,
    )
    tokenizers = pytest.importorskip("tokenizers")  # in the test extra: never skipped in CI
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<end>": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<end>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = ["--tokenizer", str(path), "--eos-token", "<end>"]
    assert main(["pack", src, "--seq-len", "8", "--out", str(tmp_path / "q"), *hf]) == 0
    assert f"\ntokenizer: {path}, vocab 4 (eos id 3)\n" in capsys.readouterr().out
    assert main([*stats, *hf]) == 0
    assert f"\ntokenizer: {path}, vocab 4 (eos id 3)\n" in capsys.readouterr().out
    ids = tmp_path / "t.npy"
    np.save(ids, np.array([5, 6, 0, 7, 8, 9, 0]))
    assert main(["pack", str(ids), "--seq-len", "8", "--out", str(tmp_path / "n"), "--eos-id", "0"]) == 0  # fmt: skip
    assert (
        "\ntokenizer: none, token ids read as they are (vocab unknown; documents end at --eos-id "
        "0)\n"
    ) in capsys.readouterr().out


def long_tail(path: Path) -> str:
    """100 documents of byte tokens (+1 eos): 94 of 100, 5 of 300, 1 of 1,000. Sorted, the 95%
    quantile (the next length up from position 94.05 of 99) is 300 and the 99% one (98.01) is
    1,000: rounded up to multiples of 128, 384 and 1,024."""
    return jsonl(path, ["a" * 99] * 94 + ["b" * 299] * 5 + ["c" * 999])


def test_pack_and_stats_count_the_documents_cut_and_suggest_a_seq_len(
    tmp_path: Path, capsys: Capture
) -> None:
    src = long_tail(tmp_path / "d.jsonl")
    fewer = (
        "  fewer cut: --seq-len 384 would {verb} 1 (95% of the documents fit whole), --seq-len "
        "1,024 would {verb} 0 (99%): each the length covering that share, rounded up to a "
        "multiple of 128\n"
    )
    assert main(["pack", src, "--seq-len", "128", "--out", str(tmp_path / "p")]) == 0
    pieces = 94 + 5 * 3 + 8  # 300 tokens: 3 pieces of at most 128; 1,000: 8
    assert (
        f"\n6 of 100 documents longer than --seq-len 128: split into pieces ({pieces} pieces "
        f"packed in all)\n{fewer.format(verb='split')}packed into "
    ) in capsys.readouterr().out
    truncate = ["--long-docs", "truncate", "--out", str(tmp_path / "t")]
    assert main(["pack", src, "--seq-len", "128", *truncate]) == 0
    lost = 5 * (300 - 128) + (1000 - 128)
    assert (
        f"\n6 of 100 documents longer than --seq-len 128: truncated ({lost:,} tokens lost)\n"
        f"{fewer.format(verb='truncate')}packed into "
    ) in capsys.readouterr().out
    stats = ["stats", src, "--seq-len", "128", "--search-steps", "10"]
    assert main([*stats, "--json", str(tmp_path / "s.json")]) == 0
    assert (
        f"\n6 of 100 documents longer than --seq-len 128 ({lost:,} tokens beyond): `megapack "
        f"pack` splits them by default (--long-docs)\n{fewer.format(verb='split')}"
    ) in capsys.readouterr().out
    figures = json.loads((tmp_path / "s.json").read_text())
    assert figures["documents_longer"] == 6
    assert figures["seq_len_covering"] == {"0.95": 384, "0.99": 1024}
    # --seq-len 512 holds 95% already: only the 99% length; a padding multiple rounds too
    assert main(["stats", src, "--seq-len", "512", "--search-steps", "10"]) == 0
    assert (
        "\n1 of 100 documents longer than --seq-len 512 (488 tokens beyond): `megapack pack` "
        "splits them by default (--long-docs)\n  fewer cut: --seq-len 1,024 would split 0 (99% "
        "of the documents fit whole): each the length covering that share, rounded up to a "
        "multiple of 128\n"
    ) in capsys.readouterr().out
    assert main(["stats", src, "--seq-len", "129", "--pad-multiple", "3", "--search-steps", "10"]) == 0  # fmt: skip
    assert (
        "  fewer cut: --seq-len 384 would split 1 (95% of the documents fit whole), --seq-len "
        "1,152 would split 0 (99%): each the length covering that share, rounded up to a "
        "multiple of 384\n"
    ) in capsys.readouterr().out
    assert main(["stats", src, "--seq-len", "1024", "--search-steps", "10"]) == 0
    text = capsys.readouterr().out
    assert "\n0 of 100 documents longer than --seq-len 1,024 (0 tokens beyond)\n" in text
    assert "fewer cut" not in text
