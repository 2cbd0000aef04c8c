"""Every Python snippet and command of README.md, CONTRIBUTING.md and every guide in docs/ runs, so
the docs cannot drift (the dated records in docs/records/ are not guides: they hold no snippet).

How each kind is exercised (nothing is skipped: a snippet or command no rule covers fails the test,
naming its file and line, so a new README section needs a harness or a rule here):

* Python snippets run with `exec` in one process on a single-rank gloo world with megatron-core's
  ``parallel_state`` initialised (tp = pp = 1), so ``Topology.from_parallel_state`` and
  ``get_batch_on_this_tp_rank`` are the real ones. `HARNESSES` gives each snippet the names it
  assumes from its surroundings (Megatron-LM's ``get_args``, a model, ``dp_rank``, ...) and checks
  what it produced; a snippet that is a function body is run inside a function.
* ``megapack pack`` / ``megapack stats`` commands run in-process on small JSONL files written here,
  once without and once with every ``[optional]`` part.
* Commands that take minutes or set up the machine are checked, not run, and say why in `COMMANDS`:
  ``megapack bench`` and torchrun lines are parsed by their real argument parsers (full runs:
  ``test_bench.py``, ``test_examples.py``); ``bash scripts/*.sh`` must exist and parse (``bash -n``);
  pytest lines must name tests that exist; ruff and mypy must be installed (``scripts/test.sh`` runs
  them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.functional.callers.guide import HARNESSES as MEGATRON_GUIDE

ROOT = Path(__file__).resolve().parents[2]
GUIDES = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
"""Every guide in docs/ (docs/records/ holds dated records, not guides)."""
DOCS = ("README.md", "CONTRIBUTING.md", *GUIDES)
PROGRAMS = ("bash", "python", "megapack", "torchrun", "ruff", "mypy", "pip")


@dataclass(frozen=True)
class Block:
    """A fenced code block or one command, with where it is (``README.md:278``)."""

    doc: str
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def fenced(doc: str) -> list[Block]:
    """Every fenced block of ``doc`` (indented fences too), dedented."""
    blocks, lines = [], (ROOT / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if m:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            text = textwrap.dedent("\n".join(lines[i + 1 : end]))
            blocks.append(Block(doc, i + 2, m.group(2), text))
            i = end
        i += 1
    return blocks


def commands(doc: str) -> list[Block]:
    """Commands: each line of a bash block (continuations joined, comments cut), and inline
    `` `command` `` spans that are whole commands (a program, then arguments)."""
    out = []
    for block in fenced(doc):
        if block.lang != "bash":
            continue
        joined = re.sub(r"\\\n\s*", "", block.text)
        for k, line in enumerate(joined.splitlines()):
            cmd = re.sub(r"\s+#.*$", "", line).strip()
            if cmd:
                out.append(Block(doc, block.line + k, "command", cmd))
    inline = re.compile(
        r"`((?:MEGAPACK_\w+=\S+ )?(?:bash scripts/|python -m |torchrun |ruff |mypy(?=`)|pip install |"
        r"megapack (?:pack|stats) \S+\.jsonl|megapack bench)[^`]*)`"
    )
    for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        if line.startswith("```") or line.startswith("    "):
            continue
        for m in inline.finditer(line):
            out.append(Block(doc, n, "command", m.group(1)))
    return out


# -- the single-rank world the Python snippets run in ----------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A gloo world of one rank with megatron's parallel state (tp = pp = 1), and a data folder."""
    import torch.distributed as dist

    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        from megatron.core import parallel_state as ps
    data = tmp_path_factory.mktemp("docs")
    write_inputs(data)
    if dist.is_initialized():  # pragma: no cover - another test left one behind
        pytest.fail("a process group is already initialised in the test process")
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(data / "store"), 1), rank=0, world_size=1
    )
    ps.initialize_model_parallel(1, 1)
    try:
        yield data
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def write_inputs(folder: Path) -> None:
    """``train.jsonl``, ``data.jsonl``, ``sft.jsonl``: 200 documents of exactly 1,024 byte tokens.

    Rows of 2,048 or 4,096 then fill exactly, so "best" meets the lower bound at once instead of
    searching for its whole time limit (10 s a command).
    """
    lines = [{"text": f"{i:04d} " + "x" * 1018} for i in range(200)]  # + eos = 1,024 tokens
    text = "".join(json.dumps(line) + "\n" for line in lines)
    for name in ("train.jsonl", "data.jsonl", "sft.jsonl"):
        (folder / name).write_text(text)


@contextlib.contextmanager
def inside(folder: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def a_batch() -> Any:
    from megapack import PackedBatch

    return PackedBatch.from_documents([[5, 6, 7], [8, 9]], seq_len=8)


class FakeModel:
    """Stands in for a megatron ``GPTModel``: records how it was built and called."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.built, self.calls = (args, kwargs), []

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append((args, kwargs))
        return torch.zeros(1)


class OnesModel(FakeModel):
    """GPTModel with labels=: a loss of 1 at every position."""

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        super().__call__(*args, **kwargs)
        return torch.ones(tuple(kwargs["labels"].shape))


class OneRankSchedule:
    """Stands in for megatron-core's schedule on one rank (tp = pp = 1): each micro-batch's
    forward step and loss, in order; records (num_microbatches, forward_only) of each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, *, forward_step_func: Callable[..., Any], data_iterator: Any, model: Any,
                 num_microbatches: int, forward_only: bool = False, **kwargs: Any) -> None:  # fmt: skip
        for _ in range(num_microbatches):
            output, loss_func = forward_step_func(data_iterator, model)
            loss_func(output)
        assert len(data_iterator) == 0, "the step held more micro-batches than the schedule took"
        self.calls.append((num_microbatches, forward_only))


# -- harnesses: what each snippet assumes around it, and what it must produce ------------------------
def pretrain_get_batch(ns: dict[str, Any], run: Callable[[], None]) -> None:
    run()
    out = ns["get_batch"](iter([a_batch()]), None)
    assert len(out) == 6 and out[0].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert out[5].qkv_format == "thd"  # packed_seq_params


def prefetch_loop(ns: dict[str, Any], run: Callable[[], None]) -> None:
    import megapack

    seen = []

    def train(forward_step: Callable[..., Any], data_iterator: Iterator[Any]) -> None:
        with contextlib.suppress(StopIteration):
            while True:
                forward_step(data_iterator, model=None)
                seen.append(1)

    ns.update(megapack=megapack, data_iterator=iter([a_batch()] * 3), is_tp_source=True, train=train,
              topology=megapack.Topology.from_parallel_state())  # fmt: skip
    run()
    assert len(seen) == 3


def megatron_lm_names(ns: dict[str, Any]) -> None:
    """Megatron-LM's pretrain_gpt.py names the snippets use, as a plain SFT run sets them."""
    args = SimpleNamespace(
        sequence_parallel=False, sft=True, dataloader_inter_document_masking=False
    )
    ns.update(
        get_args=lambda: args,
        core_transformer_config_from_args=lambda a: SimpleNamespace(
            pipeline_model_parallel_layout=None, mtp_num_layers=None
        ),
        mtp_on_this_rank_func=lambda **kw: False,
    )


def megatron_lm_get_batch(ns: dict[str, Any], run: Callable[[], None]) -> None:
    megatron_lm_names(ns)
    run()
    batch = ns["get_batch"](iter([a_batch()]), None)
    assert batch["tokens"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]] and batch["max_seqlen"] == 3


def megatron_lm_forward_step(ns: dict[str, Any], run: Callable[[], None]) -> None:
    megatron_lm_names(ns)
    exec(compile(snippet("args = get_args()").text, "get_batch", "exec"), ns)
    model = FakeModel()
    ns.update(partial=functools.partial, loss_func=lambda mask, output, model=None: output.sum())
    run()  # defines forward_step around the fragment (see `as_function`)
    output, loss = ns["forward_step"](iter([a_batch()]), model, None)
    assert loss(output).item() == 0 and model.calls[0][1]["packed_seq_params"].qkv_format == "thd"


def gpt_model(ns: dict[str, Any], run: Callable[[], None]) -> None:
    import megapack

    ns.update(GPTModel=FakeModel, config=object(), batch=megapack.get_batch_on_this_tp_rank(
        iter([a_batch()]), topology=megapack.Topology.from_parallel_state()))  # fmt: skip
    run()
    spec = ns["model"].built[1]["transformer_layer_spec"]
    assert "PackedAttention" in repr(spec.submodules.self_attention.submodules.core_attention)
    assert ns["model"].calls and ns["output"] is not None


def data_section(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack.data import PackedDataset, read_documents

    evaluation = PackedDataset(list(read_documents("sft.jsonl")), seq_len=256)
    ns.update(dp_rank=0, dp_size=1, epoch=1, i=0, evaluation=evaluation, dp_group=None)
    run()
    assert tuple(ns["train"][0].tokens.shape) == (1, 8192)  # "a PackedBatch of [1, 8192]"
    assert ns["batch"] is not None  # the lockstep loop ran


def compute_balance(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack.data import PackedDataset, read_documents

    ns.update(PackedDataset=PackedDataset, docs=list(read_documents("sft.jsonl")), dp_rank=0)
    run()
    assert len(ns["train"]) > 0 and ns["p"].num_bins > 0 and ns["packer"] is not None


def contributing_pool_test(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack.harness.grid import grid_topology
    from megapack.testing.grids import GRIDS

    class OneRankPool:  # the dist_pool fixture's `run`, on this process's one-rank world
        def run(
            self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float
        ) -> list[Any]:
            assert world_size == 1
            return [fn(*args)]

    ns.update(grid_topology=grid_topology, GRIDS=GRIDS, pytest=pytest)
    run()
    grid = next(g for g in GRIDS if g.world_size == 1)
    ns["test_something"](OneRankPool(), grid)
    assert ns["run_on_rank"](1, 1) == {"stage": "only"}


def rl_fields(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack import PackedBatch

    run()
    fields = ns["RL_FIELDS"]
    docs = [{"tokens": [5, 6, 7], "advantages": [1.0] * 3, "old_logprobs": [-2.0] * 3,
             "pixel_values": torch.ones(4, 6, dtype=torch.bfloat16), "image_grid_thw": torch.tensor([[1, 2, 2]])},
            {"tokens": [8, 9], "advantages": [-1.0] * 2, "old_logprobs": [-2.0] * 2}]  # fmt: skip
    item = PackedBatch.from_documents(docs, seq_len=8, fields=fields)
    batch = ns["get_batch"](iter([item]), None)
    assert batch["advantages"].tolist() == [[1.0, 1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0]]  # at="token"
    assert batch["pixel_values"].shape == (4, 6) and batch["image_grid_thw"].tolist() == [[1, 2, 2]]
    per_token = -batch["old_logprobs"]  # the policy still is the rollout's: every ratio is 1
    total, count, _ = ns["loss_func"](batch, per_token)  # --calculate-per-token-loss: (sum, count)
    trained = batch["loss_mask"].bool()
    assert total.item() / count.item() == pytest.approx(-batch["advantages"][trained].mean().item())


def loss_modes(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack.data import read_documents

    config = SimpleNamespace(calculate_per_token_loss=False)
    ns.update(docs=list(read_documents("sft.jsonl")), dp_rank=0, dp_size=1, num_microbatches=2,
              config=config)  # fmt: skip
    run()

    class PerTokenModel(FakeModel):  # GPTModel with labels=: one loss per position
        def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            super().__call__(*args, **kwargs)
            return torch.ones(tuple(kwargs["labels"].shape))

    model = PerTokenModel()
    output, loss_func = ns["forward_step"](iter(ns["train"]), model)
    loss, report = loss_func(output)  # every per-token loss 1: the step's sequence mean is 1
    total, documents = report["lm loss"].tolist()
    assert total == pytest.approx(documents) and documents > 0  # each document's mean is 1
    assert loss.item() > 0 and model.calls[0][1]["packed_seq_params"].qkv_format == "thd"
    config.calculate_per_token_loss = True
    output, loss_func = ns["forward_step"](iter(ns["train"]), model)
    assert len(loss_func(output)) == 3  # (sum, count, report) for the per-token path


def resume_recipe(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack.data import PackedDataset, read_documents

    packed = PackedDataset(list(read_documents("sft.jsonl")), seq_len=64)
    packed.save("packed/")
    step = 1 * 1 * 2  # Megatron's THD micro-batch size 1 x dp x micro-batches: samples a step
    ns.update(PackedDataset=PackedDataset, dp_rank=0, dp_size=1, num_microbatches=2,
              args=SimpleNamespace(consumed_train_samples=3 * step, micro_batch_size=1,
                                   global_batch_size=step))  # fmt: skip
    run()
    first = next(ns["data_iterator"])
    reference = PackedDataset.load("packed/", rows_per_micro_batch=2, micro_batches=2)
    assert torch.equal(first.tokens, reference[6].tokens)  # micro-batch 6: after three steps


def quickstart(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack.cli import main

    if not Path("packed").exists():  # the quickstart's own `megapack pack ... --out packed/`
        assert main(["pack", "sft.jsonl", "--seq-len", "256", "--out", "packed"]) == 0
    schedule = OneRankSchedule()
    ns.update(dp_rank=0, dp_size=1, num_microbatches=2, tp_rank=0, train_iters=3,
              model=OnesModel(), forward_backward_func=schedule)  # fmt: skip
    run()
    assert schedule.calls == [(2, False)] * 3  # the loop ran train_iters steps

    class PerTokenModel(FakeModel):
        def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            super().__call__(*args, **kwargs)
            return torch.ones(tuple(kwargs["labels"].shape))

    output, loss_func = ns["forward_step"](ns["data_iterator"], PerTokenModel())
    total, count, report = loss_func(output)  # every per-token loss 1: the sum is the count
    assert total.item() == count.item() > 0 and report["lm loss"].tolist() == [
        total.item(),
        count.item(),
    ]


def schedule_loops(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack.data import PackedDataset, read_documents

    docs = list(read_documents("sft.jsonl"))  # 1,024 tokens each: 2 a row of 2,048
    schedule = OneRankSchedule()
    ns.update(train=PackedDataset(docs, seq_len=2048, micro_batches=2),
              valid=PackedDataset(docs[:24], seq_len=2048, micro_batches=2),  # 12 rows: 6 steps
              num_microbatches=2, train_iters=3, seq_length=2048, model=OnesModel(),
              schedule=schedule)  # fmt: skip
    run()
    assert schedule.calls == [(2, False)] * 3 + [(2, True)] * 6


def static_shapes(ns: dict[str, Any], run: Callable[[], None]) -> None:
    import megapack
    from megapack.core.static import segments_for
    from megapack.data import PackedDataset, read_documents

    train = PackedDataset(list(read_documents("sft.jsonl")), seq_len=4096, rows_per_micro_batch=2,
                          max_documents=8)  # fmt: skip
    ns.update(megapack=megapack, segments_for=segments_for, data_iterator=iter(train))
    run()
    first = ns["inputs"].batch
    assert first["cu_seqlens"].shape == (19,) and first["max_seqlen"] == 4096
    ns["ahead"].close()


def graph_step(ns: dict[str, Any], run: Callable[[], None]) -> None:
    import megapack
    from megapack.core.static import segments_for
    from megapack.data import PackedDataset, read_documents
    from megapack.harness.gpt import TinyGPT
    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()  # CPU: the snippet's mode="eager", the same work without the capture
    model = TinyGPT(num_layers=1, hidden_size=32, vocab_size=512, max_sequence_length=4096).build()
    model.config.calculate_per_token_loss = True
    train = PackedDataset(list(read_documents("sft.jsonl")), seq_len=4096, rows_per_micro_batch=2,
                          max_documents=8)  # fmt: skip
    shape = megapack.StaticShape(max_segments=segments_for(8, 2), max_seqlen=4096)
    ns.update(megapack=megapack, model=model, shape=shape, data_iterator=iter(train),
              num_microbatches=2, train_iters=3, lr_at=lambda i: 1e-3 / (i + 1))  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    run()
    step, out = ns["step"], ns["out"]
    assert step.eager_steps == 0 and len(out.reports) == 2 and int(out.tokens) > 0
    assert ns["lr"].item() == torch.tensor(1e-3 / 3).item()  # set_lr filled the optimizer's tensor
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


HARNESSES: dict[str, Callable[[dict[str, Any], Callable[[], None]], None]] = {
    "step = GraphStep(model, optimizer, forward_step": graph_step,
    "inputs = megapack.GraphInputs(next(ahead))": static_shapes,
    "valid_data = valid.iterate() if topology.is_source else None": schedule_loops,
    "data_iterator = train.iterate(repeat=True) if tp_rank == 0": quickstart,
    "state_for(consumed_samples=": resume_recipe,
    "loss_fields=True)": loss_modes,
    "RL_FIELDS = (": rl_fields,
    "# Every rank of the TP group calls this once per micro-step": pretrain_get_batch,
    "batches = megapack.prefetch(": prefetch_loop,
    "args = get_args()": megatron_lm_get_batch,
    "output_tensor = model(batch[": megatron_lm_forward_step,
    "transformer_layer_spec=packed_gpt_layer_spec()": gpt_model,
    'docs = list(read_documents("sft.jsonl"))': data_section,
    "CostModel.from_shape(hidden=4096": compute_balance,
    "def run_on_rank(tp: int, pp: int)": contributing_pool_test,
}
"""A unique line fragment of each snippet -> its harness."""
HARNESSES.update(MEGATRON_GUIDE)  # docs/megatron.md's, run against the re-created callers

FUNCTION_BODIES = ("output_tensor = model(batch[",)
"""Snippets that are a function's body (they ``return``): run as ``forward_step``'s body."""

SNIPPETS = [b for doc in DOCS for b in fenced(doc) if b.lang == "python"]


def snippet(key: str) -> Block:
    return next(b for b in SNIPPETS if key in b.text)


def as_function(block: Block) -> str:
    if any(key in block.text for key in FUNCTION_BODIES):
        return "def forward_step(data_iterator, model, vp_stage=None):\n" + textwrap.indent(
            block.text, "    "
        )
    return block.text


@pytest.mark.parametrize("block", SNIPPETS, ids=lambda b: b.where)
def test_python_snippet_runs(block: Block, world: Path) -> None:
    keys = [key for key in HARNESSES if key in block.text]
    assert len(keys) == 1, (
        f"{block.where}: no harness (or several) for this snippet; add one to HARNESSES in "
        f"{Path(__file__).name}:\n{block.text}"
    )
    ns: dict[str, Any] = {"__name__": f"docs_{block.doc}_{block.line}"}
    code = compile(as_function(block), block.where, "exec")  # tracebacks name the README line

    def run() -> None:
        exec(code, ns)

    with inside(world):
        try:
            HARNESSES[keys[0]](ns, run)
        except Exception as e:
            raise AssertionError(f"{block.where}: the snippet failed:\n{block.text}") from e


# -- commands ----------------------------------------------------------------------------------------
def variants(cmd: str) -> list[str]:
    """``a [b] [c]`` -> ``["a", "a b c"]``: without and with every optional part."""
    bare = re.sub(r"\s*\[[^\]]*\]", "", cmd)
    full = re.sub(r"\[([^\]]*)\]", r"\1", cmd)
    return [bare] if bare == full else [bare, full]


def run_megapack(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megapack.cli import main

    for variant in variants(cmd):
        words = shlex.split(variant)
        if "--out" in words:  # each run writes a fresh output directory
            shutil.rmtree(world_dir / words[words.index("--out") + 1], ignore_errors=True)
        with inside(world_dir):
            code = main(words[1:])
        err = capsys.readouterr().err
        assert code == 0, f"`{variant}` exited {code}: {err[-1500:]}"


def parse_megapack(argv: list[str]) -> None:
    from megapack.cli import build_parser

    build_parser().parse_args(argv)  # SystemExit(2) names a bad flag


def check_bench(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parse_megapack(shlex.split(cmd)[1:])


def check_torchrun(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for variant in variants(cmd):
        words = shlex.split(variant)
        assert words[1] == "--nproc-per-node" and int(words[2]) >= 1, variant
        if words[3] == "-m":
            assert words[4] == "megapack.cli", variant
            parse_megapack(words[5:])
            continue
        script = ROOT / words[3]
        spec = importlib.util.spec_from_file_location(script.stem, script)
        assert spec and spec.loader, f"{variant}: no such script {script}"
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        argv = sys.argv
        sys.argv = [str(script), *words[4:]]
        try:
            if hasattr(module, "parse_args"):
                parsed = module.parse_args()
                for flag in ("--tp", "--pp", "--cp"):
                    if flag in words:
                        assert getattr(parsed, flag[2:]) == int(words[words.index(flag) + 1]), (
                            variant
                        )
            else:  # demo_tp_pp: parses, then says it needs torchrun (exit 2) when not launched by it
                env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
                try:
                    with pytest.raises(SystemExit) as stop:
                        module.main()
                finally:
                    os.environ.update(env)
                assert stop.value.code == 2
                assert "not launched by torchrun" in capsys.readouterr().err, variant
        finally:
            sys.argv = argv


def check_script(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    words = shlex.split(cmd)
    env = [w for w in words if re.match(r"^[A-Z_]+=", w)]
    words = words[len(env) :]
    script = ROOT / words[1]
    assert words[0] == "bash" and script.is_file(), f"`{cmd}`: no script {script}"
    subprocess.run(["bash", "-n", str(script)], check=True)
    for assignment in env:  # a documented variable must be one the script reads
        assert assignment.split("=")[0] in script.read_text(), f"`{cmd}`: {script.name} ignores it"
    if script.name == "bench.sh":
        parse_megapack(["bench", *words[2:]])


def check_pytest(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    words = shlex.split(cmd)[3:]
    for word in words:
        if word.startswith("tests"):
            assert (ROOT / word).exists(), f"`{cmd}`: {word} does not exist"
    if "-k" in words:
        key = words[words.index("-k") + 1]
        from megapack.testing.grids import GRIDS

        names = " ".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
        for term in re.split(r"\s+(?:or|and)\s+|\bnot\s+|[()]", key):  # a -k expression
            term = term.strip()
            assert not term or term in names or term in {g.id for g in GRIDS}, (
                f"`{cmd}`: -k {term} selects nothing"
            )


def run_module_help(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*shlex.split(cmd)[1:], "--help"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "usage: megapack" in done.stdout, done.stderr[-1500:]


def check_parse(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for variant in variants(cmd):
        parse_megapack(shlex.split(variant)[1:])


def check_module(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = shlex.split(cmd)[2]
    assert importlib.util.find_spec(name), f"`{cmd}`: no module {name}"


def check_pip_extra(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = re.search(r"\[(\w+)\]", cmd)
    assert extra, f"`{cmd}`: expected pip install 'megapack[EXTRA]' or -e '.[EXTRA]'"
    assert f'"{extra.group(1)}":' in (ROOT / "setup.py").read_text(), f"`{cmd}`: no such extra"


def check_tool(cmd: str, world_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = cmd.split()[0]
    assert shutil.which(tool) or importlib.util.find_spec(tool), f"`{cmd}`: {tool} not installed"


COMMANDS: list[tuple[str, Callable[[str, Path, pytest.CaptureFixture[str]], None], str]] = [
    (r"^megapack pack \S+\.parquet .*--tokenizer my-model/", check_parse, "parsed only: needs your model's tokenizer folder (test_data_parquet.py and the chat-template tests run this path)"),
    (r"^python -m megapack\.bench\.\w+", check_module, "checked only: that bench takes minutes (megapack bench runs it)"),
    (r"^pip install ", check_pip_extra, "checked only: the extra must exist in setup.py (installing is the set-up's job)"),
    (r"^megapack (pack|stats) ", run_megapack, "run on the small JSONL files written here"),
    (r"^megapack bench\b", check_bench, "parsed only: the full bench takes minutes (test_bench.py runs --quick)"),
    (r"^torchrun ", check_torchrun, "parsed only: test_examples.py runs the examples under torchrun"),
    (r"^([A-Z_]+=\S+ )*bash scripts/", check_script, "checked only: they install packages and run the suite or the full bench"),
    (r"^python -m pytest\b", check_pytest, "checked only: it is this suite"),
    (r"^python -m megapack$", run_module_help, "run with --help (the commands are checked above)"),
    (r"^(ruff|mypy)\b", check_tool, "checked only: scripts/test.sh runs them"),
]  # fmt: skip
"""(pattern, what exercises it, why not more) for every command the docs show."""

ALL_COMMANDS = [c for doc in DOCS for c in commands(doc)]


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: f"{c.where} {c.text[:40]}")
def test_command_works(command: Block, world: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = [check for pattern, check, _ in COMMANDS if re.match(pattern, command.text)]
    assert rules, f"{command.where}: no rule for `{command.text}`; add one to COMMANDS"
    try:
        rules[0](command.text, world, capsys)
    except (Exception, SystemExit) as e:
        raise AssertionError(f"{command.where}: `{command.text}` failed") from e


def test_every_doc_has_what_this_test_expects() -> None:
    """A guard against a parser bug that would make the two tests above check nothing."""
    assert len(SNIPPETS) >= 8 and {b.doc for b in SNIPPETS} <= set(DOCS)
    assert {"README.md", "docs/delivery.md", "docs/losses.md"} <= {b.doc for b in SNIPPETS}
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is a first screen: guides go in docs/"
    for guide in GUIDES:  # every guide is linked from the README (STYLE.md: via CONTRIBUTING too)
        assert f"]({guide})" in readme or f"]({guide}#" in readme, (
            f"README.md does not link {guide}"
        )
    kinds = {
        rule[1].__name__ for c in ALL_COMMANDS for rule in COMMANDS if re.match(rule[0], c.text)
    }
    assert kinds == {check.__name__ for _, check, _ in COMMANDS}
    assert all(
        any(c.text.startswith(p) or "bash" in c.text for p in PROGRAMS) for c in ALL_COMMANDS
    )
