"""Run megatron-core's real ``GPTModel`` and pipeline schedules on CPU ranks (gloo), for tests and benchmarks.

megatron-core assumes CUDA in a handful of places on the paths a small training test uses. With
a CPU-only torch each of them raises ``AssertionError: Torch not compiled with CUDA enabled``, except
``torch.cuda.manual_seed``, which is silently queued and never seeds anything. The places were
found by running a tp=2 x pp=2 model (1F1B), tp=1 x pp=2 with virtual stages (interleaved), tp=2
and tp=1 without pipelining, with and without ``attention_mask``, logging each redirected call,
then the whole suite on megatron-core 0.16.1 and on 0.19.2 (where a CUDA build of torch without a
GPU raises "Found no NVIDIA driver", or "Cannot re-initialize CUDA in forked subprocess" in a
worker, instead of the assertion). :func:`megatron_on_cpu` redirects exactly those places to the
CPU, process-wide, and changes nothing else; the same patches serve every release from 0.16.1 to
0.19.2 (each attribute exists in all of them).

How: global ``torch`` is left alone (the real ``torch.cuda.current_device()`` still raises). Instead
six megatron modules get their module attribute ``torch`` replaced by a *view* of torch that
resolves every attribute to the real torch except the six below, and four megatron functions
are replaced by CPU equivalents. Megatron code outside those modules, and all other code in the
process, sees the real torch.

The view (``_torch_view``) overrides:
  * ``torch.cuda.current_device()`` -> ``"cpu"``: used as ``device=`` for buffers.
  * ``torch.cuda.current_stream()`` -> ``torch.cpu.current_stream()``, whose ``wait_event`` and
    ``wait_stream`` do nothing: megatron-core 0.19's DDP takes the current stream in every bucket's
    ``start_grad_sync`` to wait for CUDA-graph gradient events; on CPU there are none, and gloo
    collectives are complete once they return.
  * ``torch.cuda.synchronize()`` -> no-op: called after batched p2p ops; gloo ops are complete
    once ``wait()`` returns.
  * ``torch.cuda.get_rng_state()`` / ``torch.cuda.manual_seed(s)`` -> the CPU default generator's:
    see the RNG note below.
  * ``torch.zeros(..., device="cuda")`` -> ``device="cpu"`` (other devices untouched).

The patches, one by one (module: attribute, why):
  1. ``tensor_parallel.random``: ``torch`` -> view. ``CudaRNGStatesTracker.add`` and
     ``model_parallel_cuda_manual_seed`` call ``torch.cuda.get_rng_state``/``manual_seed``.
  2. ``tensor_parallel.random``: ``_get_cuda_rng_state`` -> CPU generator state. Called by
     ``tracker.fork()`` on every TP-region dropout and by ``add``.
  3. ``tensor_parallel.random``: ``_set_cuda_rng_state`` -> CPU generator state. Same callers.
  4. ``pipeline_parallel.schedules``: ``torch`` -> view. Every schedule (no pipelining, 1F1B,
     interleaved) allocates ``total_num_tokens = torch.zeros([], device="cuda")``.
  5. ``pipeline_parallel.p2p_communication``: ``torch`` -> view. Receive buffers and shape
     buffers use ``device=torch.cuda.current_device()``; ``torch.cuda.synchronize()`` follows
     batched isend/irecv.
  6. ``utils``: ``torch`` -> view. ``GlobalMemoryBuffer.get_tensor`` (the attention matmul buffer
     of the local ``DotProductAttention``) allocates on ``torch.cuda.current_device()``.
  7. ``models.common.embeddings.rotary_pos_embedding``: ``torch`` -> view. ``RotaryEmbedding``
     moves ``inv_freq`` to ``torch.cuda.current_device()`` on each forward.
  8. ``fusions.fused_softmax``: ``get_default_causal_mask`` -> CPU version. Only reached when the
     model is called with ``attention_mask=None``; the original builds the mask on "cuda".
     (``transformer.utils`` itself is not given the view: it holds ``torch.compile``d functions.)
  9. ``models.common.embeddings.rotary_pos_embedding``: ``get_pos_emb_on_this_cp_rank`` -> CPU
     version. With context parallelism and unpacked [s, b] batches, ``RotaryEmbedding`` keeps this
     CP rank's zigzag chunks of the table; the original builds their index in pinned memory
     and moves it to CUDA.
 10. ``distributed.param_and_grad_buffer``: ``torch`` -> view. megatron-core's
     ``DistributedDataParallel`` allocates its gradient buffers (``main_grad``) on
     ``torch.cuda.current_device()``, and from 0.19 every bucket's ``start_grad_sync`` takes
     ``torch.cuda.current_stream()``; with the view it runs on CPU, and ``finalize_model_grads``
     (its all-reduce over DP x CP, the per-token loss's division) as it does on a GPU.

RNG note: on CPU, megatron's "CUDA" RNG tracker and the CPU default generator become one
generator. ``model_parallel_cuda_manual_seed(s)`` therefore seeds the CPU generator with ``s``
(so ``use_cpu_initialization=True`` weights are reproducible from ``s``), and inside
``tracker.fork()`` CPU ops such as dropout draw from the per-TP-rank stream, which is what the
tracker does for CUDA ops on a GPU. The CPU state outside a fork is restored on exit as on a GPU.
megatron logs a spurious "CPU RNG state changed within GPU RNG context" when a fork draws numbers.

Not covered: ``use_cpu_initialization=False`` (fails at model construction with the CUDA
assertion: ``tensor_parallel.layers`` allocates weights on ``torch.cuda.current_device()``),
sliding-window masks, CUDA graphs, ``use_cudagraphable_rng``, ``enable_autocast``, DDP over
several distributed-optimizer instances with overlapped reduction (its communication stream:
``torch.cuda.Stream``). Sequence parallelism is rejected by the local spec's torch LayerNorm
before any of this matters. Measured on the 2-core dev machine: building a tp=2 x pp=2
``GPTModel`` (hidden 32, 1 layer per stage) and running 2 steps of 2 microbatches of 2 x 16 tokens
takes ~0.3 s per rank; applying the patches takes microseconds once megatron is imported.

Used by megapack's tests and by ``megapack bench`` (throughput section); the training path never imports
it. It imports megatron lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

_MODULE_PREFIX = "megatron.core."

# (module, attribute, original value) for every patch in force in this process; empty if none.
_applied: list[tuple[Any, str, Any]] = []


class _Overlay:
    """An object with attributes ``overrides`` that falls back to ``base`` for all others."""

    def __init__(self, base: Any, **overrides: Any) -> None:
        self._base = base
        vars(self).update(overrides)

    def __getattr__(self, name: str) -> Any:  # only called when normal lookup fails
        if name == "_base":  # not yet set (copy/pickle): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self._base, name)

    def __repr__(self) -> str:
        return f"<{self._base.__name__} redirected to CPU by megapack.harness.megatron_cpu>"


def _zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
    """``torch.zeros`` that allocates on the CPU when asked for a CUDA device."""
    if device is not None and (isinstance(device, int) or torch.device(device).type == "cuda"):
        device = "cpu"
    return torch.zeros(*size, device=device, **kwargs)


def _get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """Stands in for megatron's ``_get_cuda_rng_state``: the CPU generator's state."""
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Stands in for megatron's ``_set_cuda_rng_state``: sets the CPU generator's state."""
    torch.set_rng_state(new_state)


def _causal_mask(sq: int) -> torch.Tensor:
    """Stands in for ``get_default_causal_mask``: ``[sq, sq]`` bool, True above the diagonal."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Stands in for ``get_pos_emb_on_this_cp_rank``: chunks r and 2*cp-1-r of ``2*cp`` along ``seq_dim``."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def _torch_view() -> _Overlay:
    """torch as the patched megatron modules see it (see the module docstring)."""
    cuda = _Overlay(
        torch.cuda,
        current_device=lambda: "cpu",
        current_stream=torch.cpu.current_stream,
        synchronize=lambda device=None: None,
        get_rng_state=lambda device="cuda": torch.get_rng_state(),
        manual_seed=torch.manual_seed,
    )
    return _Overlay(torch, cuda=cuda, zeros=_zeros)


def _patch_table() -> list[tuple[str, str, Any]]:
    """(module under ``megatron.core.``, attribute, replacement), numbered as in the docstring."""
    view = _torch_view()
    return [
        ("tensor_parallel.random", "torch", view),
        ("tensor_parallel.random", "_get_cuda_rng_state", _get_rng_state),
        ("tensor_parallel.random", "_set_cuda_rng_state", _set_rng_state),
        ("pipeline_parallel.schedules", "torch", view),
        ("pipeline_parallel.p2p_communication", "torch", view),
        ("utils", "torch", view),
        ("models.common.embeddings.rotary_pos_embedding", "torch", view),
        ("fusions.fused_softmax", "get_default_causal_mask", _causal_mask),
        (
            "models.common.embeddings.rotary_pos_embedding",
            "get_pos_emb_on_this_cp_rank",
            _pos_emb_on_this_cp_rank,
        ),
        ("distributed.param_and_grad_buffer", "torch", view),
    ]


def megatron_on_cpu(*, force: bool = False) -> bool:
    """Lets megatron-core's ``GPTModel`` and pipeline schedules run on CPU (gloo) in this process.

    Call it on every rank before building the model, e.g. first thing in a ``dist_pool`` task.
    Idempotent: the patches are applied once per process and stay for its lifetime.

    Args:
        force: Apply the patches even though ``torch.cuda.is_available()`` is True. Without it,
            a CUDA machine is left untouched so megatron runs on its GPUs as usual.

    Returns:
        True if the patches are in force after the call; False if CUDA is available, ``force``
        is False and no earlier call applied them (nothing was changed).

    Example:
        In a worker function run by ``dist_pool.run(fn, 4, timeout=120)``::

            megatron_on_cpu()
            parallel_state.initialize_model_parallel(2, 2)
            model_parallel_cuda_manual_seed(1234)
            model = GPTModel(config, get_gpt_layer_local_spec(), ...)  # use_cpu_initialization
            get_forward_backward_func()(forward_step_func=..., model=[model], ...)
    """
    if _applied:
        return True
    if torch.cuda.is_available() and not force:
        return False
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        patches = [
            (importlib.import_module(_MODULE_PREFIX + name), attr, new)
            for name, attr, new in _patch_table()
        ]
    for module, attr, new in patches:  # all imports succeeded: now patch, recording originals
        _applied.append((module, attr, getattr(module, attr)))
        setattr(module, attr, new)
    return True


def _restore() -> None:
    """Undoes every patch (for tests that patch the pytest process itself)."""
    while _applied:
        module, attr, original = _applied.pop()
        setattr(module, attr, original)
