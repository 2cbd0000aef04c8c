"""Which attention backend runs where: `BACKENDS`, `backend_available`, `resolve_backend`, `choose_backend`."""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = ("flash_attn", "te", "torch_varlen", "flex", "sdpa")
_NO_DROPOUT = frozenset({"torch_varlen", "flex"})


def backend_available(name: str, device: torch.device | str, *, training: bool = False) -> bool:
    """Whether backend ``name`` can run on ``device`` (and backpropagate, when ``training``)."""
    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if name == "sdpa":
        return True
    if name == "flex":
        return _has_module("torch.nn.attention.flex_attention") and (cuda or not training)
    if name == "torch_varlen":
        return cuda and _has_module("torch.nn.attention.varlen")
    if name == "flash_attn":
        return cuda and _has_module("flash_attn")
    if name == "te":
        return cuda and _has_module("transformer_engine")
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS} or 'auto'")


def resolve_backend(
    backend: str, device: torch.device | str, *, training: bool, dropout: float = 0.0
) -> str:
    """The backend to run: ``backend`` itself if it can run here, else a clear error; 'auto' chooses."""
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cpu":
            return "sdpa"
        for name in BACKENDS:
            if (dropout == 0.0 or name not in _NO_DROPOUT) and backend_available(
                name, device, training=training
            ):
                return name
    if not backend_available(backend, device, training=training):
        why = (
            "its backward pass is CUDA-only in torch"
            if backend == "flex"
            else "it is not installed or needs CUDA"
        )
        raise ValueError(
            f"attention backend {backend!r} cannot run {'training ' if training else ''}on {device}: {why}; "
            f"use backend='auto' or 'sdpa'"
        )
    if dropout > 0.0 and backend in _NO_DROPOUT:
        raise ValueError(
            f"attention backend {backend!r} has no attention dropout (attention_dropout={dropout})"
        )
    return backend


def choose_backend(
    device: torch.device | str, dtype: torch.dtype, *, training: bool, dropout: float = 0.0
) -> str:
    """The backend ``backend="auto"`` runs for tensors of ``dtype`` on ``device``."""
    return resolve_backend("auto", device, training=training, dropout=dropout)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
