"""Mutation testing of named modules with only their own tests (mutmut 3); `scripts/mutation.sh`.

    bash scripts/mutation.sh megapack/packing/bfd.py megapack/data/split.py

1. The tests: each module's from `TESTS` (its own test files), else ``tests/unit/test_<name>.py``
   or ``test_<package>_<name>.py`` / ``test_<package>*.py``; ``--tests`` replaces them.
2. A copy of ``megapack/``, ``tests/``, ``setup.py`` and ``pyproject.toml`` (the working tree's
   files, committed or not) goes to ``.mutation/run/``, with the ``[tool.mutmut]`` table of
   ``pyproject.toml`` narrowed to these modules and tests. mutmut works in its ``mutants/`` folder;
   the source tree is never written.
3. ``mutmut run --max-children 1`` there (``--workers N`` for more; the default leaves a shared
   2-core machine usable). mutmut runs, for each mutant, only the selected tests that call the
   mutated function, stopping at the first failure.
4. The report: per module, mutants / killed / survived / score (killed, timeouts included, over all
   mutants), then each surviving mutant's diff (``mutmut show``). ``--min-score 95`` makes the
   exit code 1 when a module scores lower.

A fresh run each time (``--keep`` reuses the work folder: mutmut then re-tests only mutants of
functions that changed, so a new test does not re-judge an old survivor: don't keep to measure).
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutation" / "run"
"""Where mutmut works (``--work`` elsewhere, e.g. to keep two runs); ignored by git."""

_ITEMS_TESTS = [
    "tests/unit/test_intake.py",
    "tests/unit/test_rows.py",
    "tests/unit/test_megatron_batches.py",
    "tests/unit/test_fields.py",
    "tests/unit/test_get_batch_one_rank.py",
    "tests/unit/test_batch.py",
    "tests/unit/test_wire.py",
]
"""What a Megatron dict or a PackedBatch becomes (`to_batch`, `merge_rows`) is checked there."""

TESTS: dict[str, list[str]] = {
    "megapack/core/loss_fields.py": ["tests/unit/test_loss_fields.py"],
    "megapack/megatron/loss.py": ["tests/unit/test_loss_fields.py"],
    "megapack/data/loss_steps.py": ["tests/unit/test_loss_fields.py"],
    "megapack/packing/*.py": ["tests/unit/test_packing*.py"],
    "megapack/data/pack_writer.py": ["tests/unit/test_data_pack_writer.py"],
    "megapack/data/convert.py": [
        "tests/unit/test_data_convert.py",
        "tests/unit/test_data_jsonl.py",
    ],
    "megapack/data/packed_dir.py": [
        "tests/unit/test_data_packed_dir.py",
        "tests/unit/test_data_dataset.py",
        "tests/unit/test_data_pack_writer.py",
    ],
    "megapack/data/dataset.py": [
        "tests/unit/test_data_dataset.py",
        "tests/unit/test_data_pack_writer.py",  # byte for byte against PackedDataset.save
    ],
    "megapack/data/split.py": ["tests/unit/test_data_split.py"],
    "megapack/data/arrays.py": ["tests/unit/test_data_arrays.py"],
    "megapack/data/tables.py": ["tests/unit/test_data_parquet.py"],
    # the batch contract and its delivery (core/, delivery/): fast single-process tests only;
    # the distributed ones run in pool workers, where mutmut's per-test coverage does not look
    "megapack/core/batch.py": [
        "tests/unit/test_batch.py",
        "tests/unit/test_fields.py",
        "tests/unit/test_extras.py",
        "tests/unit/test_megatron_batches.py",
        "tests/unit/test_rows.py",
    ],
    "megapack/core/intake.py": _ITEMS_TESTS,
    "megapack/core/rows.py": _ITEMS_TESTS,
    "megapack/core/fields.py": ["tests/unit/test_fields.py", "tests/unit/test_wire.py"],
    "megapack/core/extras.py": [
        "tests/unit/test_extras.py",
        "tests/unit/test_fields.py",
        "tests/unit/test_batch.py",
    ],
    "megapack/core/cp_share.py": [
        "tests/unit/test_cp_share_indices.py",
        "tests/unit/test_cp_share.py",
    ],
    "megapack/core/seq_params.py": [
        "tests/unit/test_seq_params.py",
        "tests/unit/test_megatron_batches.py",
        "tests/unit/test_wire.py",
        "tests/unit/test_cp_share.py",
        "tests/unit/test_batch.py",
    ],
    "megapack/delivery/wire.py": ["tests/unit/test_wire.py"],
    "megapack/delivery/link.py": ["tests/unit/test_link.py"],
    "megapack/delivery/link_setup.py": ["tests/unit/test_link_setup.py"],
    "megapack/delivery/transport.py": [
        "tests/unit/test_transport.py",
        "tests/unit/test_get_batch_one_rank.py",
    ],
    "megapack/delivery/get_batch.py": [
        "tests/unit/test_get_batch.py",
        "tests/unit/test_get_batch_one_rank.py",
        "tests/unit/test_megatron_batches.py",
    ],
    "megapack/delivery/prefetch.py": ["tests/unit/test_prefetch.py"],
    # issues 46-48: resume, the dataset's identity, the lockstep, cuDNN, the buckets, GraphStep;
    # again single-process tests only (the lockstep's and GraphStep's multi-rank tests run in
    # pool workers, where mutmut does not look)
    "megapack/data/resume.py": ["tests/unit/test_resume.py", "tests/unit/test_steps_resume.py"],
    "megapack/data/fingerprint.py": [
        "tests/unit/test_data_fingerprint.py",
        "tests/unit/test_data_packed_dir.py",
    ],
    "megapack/delivery/steps.py": ["tests/unit/test_steps.py", "tests/unit/test_steps_resume.py"],
    "megapack/delivery/step_report.py": ["tests/unit/test_steps.py"],
    "megapack/attention/cudnn*.py": [
        "tests/unit/test_cudnn.py",
        "tests/unit/test_cudnn_standin.py",  # cuDNN's runtime stood in for on the CPU
        "tests/unit/test_zero_outside.py",
    ],
    "megapack/core/buckets.py": ["tests/unit/test_buckets.py", "tests/unit/test_bucketed.py"],
    "megapack/attention/bucketed.py": [
        "tests/unit/test_bucketed.py",
        "tests/unit/test_zero_outside.py",
    ],
    "megapack/megatron/graph_step.py": [
        "tests/unit/test_graph_step.py",
        "tests/unit/test_graph.py",
        "tests/unit/test_graph_parts.py",
    ],
}
"""Module (glob) -> its tests (globs), where the test file's name does not say it."""

COUNTED = ("killed", "timeout", "caught by type check")
"""mutmut statuses that count as detected (a mutant that hangs is caught by the time limit)."""


def module_path(name: str) -> str:
    """``megapack/packing/bfd.py`` from that or ``megapack.packing.bfd``, checked to exist."""
    path = name if name.endswith(".py") else name.replace(".", "/") + ".py"
    if not (ROOT / path).is_file():
        raise SystemExit(f"mutation: no module {name} ({ROOT / path} is not a file)")
    return path


def tests_of(module: str) -> list[str]:
    """The test files of ``module``: `TESTS`, else by name; an error when there are none."""
    from fnmatch import fnmatch

    for pattern, tests in TESTS.items():
        if fnmatch(module, pattern):
            return tests
    parts = Path(module).with_suffix("").parts[1:]  # ("packing", "bfd") or ("batch",)
    candidates = [f"tests/unit/test_{'_'.join(parts)}.py", f"tests/unit/test_{parts[-1]}.py"]
    if len(parts) > 1:
        candidates.append(f"tests/unit/test_{parts[0]}*.py")
    for candidate in candidates:
        if list(ROOT.glob(candidate)):
            return [candidate]
    raise SystemExit(
        f"mutation: no tests found for {module} (tried {', '.join(candidates)}); "
        "name them with --tests or add the module to TESTS in scripts/mutation.py"
    )


def copy_tree() -> None:
    """The working tree's megapack/, tests/, setup.py and pyproject.toml into `WORK`."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", "megapack", "tests", "setup.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    for name in listed:
        source = ROOT / name
        if source.is_file():  # a tracked file someone deleted is not copied
            (WORK / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, WORK / name)


def toml_value(value: object) -> str:
    """A TOML literal for the strings, numbers, booleans and lists of a mutmut table."""
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def write_config(modules: list[str], tests: list[str]) -> None:
    """`WORK`/pyproject.toml: the repository's, its [tool.mutmut] narrowed to ``modules``."""
    text = (ROOT / "pyproject.toml").read_text()
    table = dict(tomllib.loads(text).get("tool", {}).get("mutmut", {}))
    table["only_mutate"] = modules
    table["pytest_add_cli_args_test_selection"] = tests
    table.pop("tests_dir", None)
    kept = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text)
    lines = [f"{key} = {toml_value(value)}" for key, value in table.items()]
    (WORK / "pyproject.toml").write_text(
        kept.rstrip() + "\n\n[tool.mutmut]\n" + "\n".join(lines) + "\n"
    )


def run_mutmut(workers: int) -> int:
    """``mutmut run`` in `WORK`, echoing its output without the list of copied files and the
    spinner frames; its progress line at most every 10 s."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = ["mutmut", "run", "--max-children", str(workers)]
    with subprocess.Popen(
        command, cwd=WORK, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as child:  # fmt: skip
        assert child.stdout is not None
        last, pending = 0.0, ""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        for chunk in iter(lambda: child.stdout.read1(4096), b""):  # type: ignore[union-attr]
            *lines, pending = re.split(r"[\r\n]", pending + decoder.decode(chunk))
            for line in lines:
                text = line.strip()
                if not text or re.match(r"^(also copying|megapack/|tests/)", text):
                    continue
                progress = bool(re.match(r"^\W*\d+/\d+ ", text))  # "⠋ 12/60  🎉 10 ..."
                if progress and time.monotonic() - last < 10:
                    continue
                last = time.monotonic() if progress else last
                print(text, flush=True)
        if pending.strip():
            print(pending.strip())
        return child.wait()


def mutants_of(module: str) -> dict[str, int | None]:
    """mutmut's exit code per mutant of ``module`` (None: not run), from its ``.meta`` file."""
    meta = WORK / "mutants" / f"{module}.meta"
    return json.loads(meta.read_text())["exit_code_by_key"] if meta.is_file() else {}


def report(modules: list[str], show_diffs: bool) -> dict[str, dict[str, int | float]]:
    """Per module counts (printed), and each survivor's diff."""
    from mutmut.stats import status_by_exit_code

    scores: dict[str, dict[str, int | float]] = {}
    survivors: list[str] = []
    print(f"\n{'module':40} {'mutants':>7} {'killed':>7} {'survived':>8} {'other':>6} {'score':>7}")
    for module in modules:
        status = {k: status_by_exit_code[v] for k, v in mutants_of(module).items()}
        killed = sum(s in COUNTED for s in status.values())
        survived = sorted(k for k, s in status.items() if s == "survived")
        other = sorted(k for k, s in status.items() if s not in COUNTED and s != "survived")
        total = len(status)
        score = 100.0 * killed / total if total else 100.0
        scores[module] = {"mutants": total, "killed": killed, "survived": len(survived),
                          "other": len(other), "score": round(score, 1)}  # fmt: skip
        print(f"{module:40} {total:7} {killed:7} {len(survived):8} {len(other):6} {score:6.1f}%")
        survivors += survived + other
        for key in other:
            print(f"    {key}: {status[key]}")
    if survivors:
        print(f"\n{len(survivors)} not killed (an equivalent mutant, or a missing test):")
    for key in survivors:
        if show_diffs:
            shown = subprocess.run(
                ["mutmut", "show", key], cwd=WORK, capture_output=True, text=True, check=False
            )
            print(shown.stdout.rstrip() or f"# {key}\n{shown.stderr.rstrip()}")
        else:
            print(f"    {key}")
    return scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/mutation.sh", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument(
        "modules", nargs="+", help="megapack/packing/bfd.py or megapack.packing.bfd"
    )
    parser.add_argument("--tests", nargs="+", help="test files (globs) instead of the modules' own")
    parser.add_argument("--workers", type=int, default=1, help="mutmut --max-children (default 1)")
    parser.add_argument("--keep", action="store_true", help="reuse the work folder (see above)")
    parser.add_argument("--work", help="work folder (default .mutation/run/; keep it git-ignored)")
    parser.add_argument("--no-diffs", action="store_true", help="survivors' names only")
    parser.add_argument("--min-score", type=float, help="exit 1 if a module scores lower (%%)")
    parser.add_argument("--json", help="write the per-module counts here")
    parser.add_argument(
        "--report-only", action="store_true", help="print the last run's report again"
    )
    args = parser.parse_args(argv)
    global WORK
    if args.work:
        WORK = Path(args.work).resolve()

    modules = list(dict.fromkeys(module_path(m) for m in args.modules))
    tests = args.tests or list(dict.fromkeys(t for m in modules for t in tests_of(m)))
    files = sorted({str(p.relative_to(ROOT)) for t in tests for p in ROOT.glob(t)})
    if not files:
        raise SystemExit(f"mutation: the tests {tests} match no file")
    if not args.report_only:
        print(f"mutating {', '.join(modules)}\nwith {' '.join(files)}", flush=True)
        marker = WORK / ".mutation-work"  # only a folder this script made is ever removed
        if not args.keep and marker.is_file():
            shutil.rmtree(WORK)
        elif WORK.exists() and not marker.is_file() and any(WORK.iterdir()):
            raise SystemExit(f"mutation: {WORK} exists and is not a work folder of this script")
        WORK.mkdir(parents=True, exist_ok=True)
        marker.touch()
        copy_tree()
        write_config(modules, files)
        code = run_mutmut(args.workers)
        metas = [WORK / "mutants" / f"{m}.meta" for m in modules]
        if code != 0 and all(f.is_file() for f in metas) and not any(map(mutants_of, modules)):
            print("mutation: no mutants: mutmut mutates code inside functions only")
            code = 0
        if code != 0:
            print(f"mutation: mutmut run exited with {code}", file=sys.stderr)
            return code
    scores = report(modules, show_diffs=not args.no_diffs)
    if args.json:
        Path(args.json).write_text(json.dumps(scores, indent=2) + "\n")
    low = [
        m for m, s in scores.items() if args.min_score is not None and s["score"] < args.min_score
    ]
    if low:
        print(f"mutation: below {args.min_score}%: {', '.join(low)}", file=sys.stderr)
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
