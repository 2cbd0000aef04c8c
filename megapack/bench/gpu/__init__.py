"""The GPU kit (``bash scripts/gpu_check.sh``; ``python -m megapack.bench.gpu.kit``), one module a step:

    kit.py               the kit: its sections and plans (``--plan first-run``), each section's
                         steps in order, the report rewritten after each (``--dry-run``: CPU)
    sizes.py             `FULL` sizes on one GPU, `DRY` for the CPU dry run (`KitSizes`)
    steps.py             the steps `kit` runs: set-up, loss checks, model, syncs, throughput,
                         profile, captured step; each returns report checks
    smoke.py             a toy GraphStep captured with each attention backend forced
    checks.py            attention against a float64 reference, packed == padded losses
    attention_timing.py  every backend that trains here timed on one packed row
    attention_rows.py    cudnn, torch_varlen, bucketed on two real rows: vs float64, per FLOP
    compile_failure.py   whether an exception means "cannot compile here" (skipped) or a bug
    syncs.py             no synchronizing CUDA call in delivery, prefetch, steps and backends
    host_wait.py         whether a call makes the host wait (the syncs torch's detector misses)
    model.py             the 0.84B preset, its THD-aware FLOPs, the measured matmul
    throughput.py        packing against every baseline of `megapack.bench.modes` at real size
    targets.py           every target of the kit; the throughput ones judged on its summary
    graph.py             a captured training step (`GraphStep`) against eager
    graph_grouped.py     packed micro-batches under CUDA graphs against eager length-grouped
    devices.py           each device's bf16 dense peak, MFU's denominator
    profile.py           one step under torch.profiler: host vs GPU time, by owner
    report.py            gpu-report.json and .md (imports neither torch nor megatron)

Importing this package imports none of them: ``report`` must work where torch is broken. Import
each name from the module that defines it (``from megapack.bench.gpu.throughput import
run_gpu_throughput``).
"""
