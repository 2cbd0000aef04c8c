"""The GPU kit (``bash scripts/gpu_check.sh``; ``python -m megapack.bench.gpu.kit``), one module a step:

    kit.py               the kit: every step in order, the report rewritten after each
                         (``--dry-run``: CPU)
    sizes.py             `FULL` sizes on one GPU, `DRY` for the CPU dry run (`KitSizes`)
    steps.py             the steps `kit` runs: set-up, loss checks, model, syncs, throughput,
                         profile, captured step; each returns report checks
    checks.py            attention against a float64 reference, packed == padded losses
    attention_timing.py  every backend that trains here timed on one packed row, and its targets
    compile_failure.py   whether an exception means "cannot compile here" (skipped) or a bug
    syncs.py             no synchronizing CUDA call in delivery, prefetch, steps and backends
    model.py             the 0.84B preset, its THD-aware FLOPs, the measured matmul
    throughput.py        packing against every baseline of `megapack.bench.modes` at real size
    targets.py           the throughput targets, judged on the throughput summary
    graph.py             a captured training step (`GraphStep`) against eager
    graph_grouped.py     packed micro-batches under CUDA graphs against eager length-grouped
    devices.py           each device's bf16 dense peak, MFU's denominator
    profile.py           one step under torch.profiler: host vs GPU time, by owner
    report.py            gpu-report.json and .md (imports neither torch nor megatron)

Importing this package imports none of them: ``report`` must work where torch is broken. Import
each name from the module that defines it (``from megapack.bench.gpu.throughput import
run_gpu_throughput``).
"""
