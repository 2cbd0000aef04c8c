"""What the bench, the examples and the tests share, one import path each: the persistent gloo
worker pool (`pool`), megatron-core on CPU ranks (`megatron_cpu`), the tiny megatron-core GPT they
train and its forward step (`gpt`), and `grid_topology` for tp x pp x cp grids of the default
group (`grid`).

May import every package below it (core, distributed, delivery, attention, megatron, packing,
data); never the bench, the CLI or `megapack.testing`.
"""
