"""The test and bench harness: the persistent gloo worker pool (`pool`), megatron-core on CPU
ranks (`megatron_cpu`) and the tiny megatron-core GPT the bench, examples and tests train (`gpt`).

May import everything below it (core, distributed, delivery, attention, megatron); never the
bench, the CLI or `megapack.testing`.
"""
