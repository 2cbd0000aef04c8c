"""Which attention backend runs where: a pure rule over (device, dtype, training, dropout, installed).

    backend       kernel                                   takes
    flash_attn    flash_attn_varlen_func                   CUDA, float16/bfloat16, dropout
    te            Transformer Engine DotProductAttention   CUDA, float16/bfloat16, dropout
    torch_varlen  torch.nn.attention.varlen.varlen_attn    CUDA, float16/bfloat16 (FlashAttention 2)
    flex          compiled flex_attention + block mask     CUDA; CPU forward only (no CPU backward)
    sdpa          scaled_dot_product_attention per doc     anywhere, any dtype: the reference

``backend="auto"`` (`choose`): on CUDA with float16/bfloat16 the first of flash_attn, te,
torch_varlen, flex, sdpa that is installed and takes the dropout; on CUDA with any other dtype
(float32) flex, else sdpa, since every FlashAttention-based kernel refuses it; anywhere else sdpa
(flex's CPU forward compiles for seconds per row length and has no backward). It never picks a
kernel that refuses the inputs, and `choose_backend` logs the choice once per (device, dtype,
training, dropout) on the ``megapack.attention`` logger with the reasons, e.g.::

    attention backend torch_varlen for cuda bfloat16 training (flash_attn not installed, te not
    installed; varlen_attn without enable_gqa: K/V heads repeated)

An explicit backend that cannot take the inputs is a ValueError naming the backend, device, dtype,
why, and the fix (`resolve_backend`). What is installed is found once (`Installed.find`); tests pass
their own `Installed` to the pure functions `choose` and `refusal`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass

import torch

from megapack.attention.varlen import VarlenForm, form_of, installed_varlen

BACKENDS = ("flash_attn", "te", "torch_varlen", "flex", "sdpa")
"""Every backend, in ``auto``'s order of preference on CUDA with float16/bfloat16."""
HALF = (torch.float16, torch.bfloat16)
"""The dtypes FlashAttention-based kernels take."""
_NO_DROPOUT = frozenset({"torch_varlen", "flex"})

logger = logging.getLogger("megapack.attention")


@dataclass(frozen=True, kw_only=True, slots=True)
class Installed:
    """What this process has: CUDA, the optional packages, torch's varlen_attn form, flex."""

    cuda: bool
    """torch.cuda.is_available()."""
    flash_attn: bool
    """The flash-attn package is importable."""
    te: bool
    """Transformer Engine is importable."""
    varlen: VarlenForm | None
    """The form of torch's ``varlen_attn`` (`megapack.attention.varlen`), None without one."""
    flex: bool
    """torch has ``flex_attention`` (torch >= 2.5)."""

    @classmethod
    def find(cls) -> Installed:
        """This process's `Installed` (looks for modules; imports none of the optional packages)."""
        fn = installed_varlen()
        return cls(
            cuda=torch.cuda.is_available(),
            flash_attn=_has_module("flash_attn"),
            te=_has_module("transformer_engine"),
            varlen=None if fn is None else form_of(fn),
            flex=_has_module("torch.nn.attention.flex_attention"),
        )


def refusal(
    name: str,
    device_type: str,
    dtype: torch.dtype,
    *,
    training: bool,
    dropout: float,
    installed: Installed,
) -> str | None:
    """Why backend ``name`` cannot take these inputs, or None when it can.

    Example:
        >>> have = Installed(cuda=True, flash_attn=False, te=False, varlen=None, flex=True)
        >>> refusal("flex", "cpu", torch.float32, training=True, dropout=0.0, installed=have)
        'flex_attention has no backward on CPU in torch (forward only)'
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS} or 'auto'")
    if name == "sdpa":
        return None
    cuda = device_type == "cuda"
    if name == "flex":
        if not installed.flex:
            return "this torch has no flex_attention (torch >= 2.5)"
        if device_type not in ("cuda", "cpu"):
            return f"flex_attention runs on CUDA and CPU, not {device_type}"
        if training and not cuda:
            return "flex_attention has no backward on CPU in torch (forward only)"
    elif not cuda or not installed.cuda:
        return f"{name} runs on CUDA only"
    elif name == "flash_attn" and not installed.flash_attn:
        return "flash-attn is not installed (pip install flash-attn)"
    elif name == "te" and not installed.te:
        return "Transformer Engine is not installed"
    elif name == "torch_varlen" and installed.varlen is None:
        return "this torch has no usable torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
    elif dtype not in HALF:
        return f"{name} is FlashAttention-based and takes float16/bfloat16 only"
    if dropout > 0.0 and name in _NO_DROPOUT:
        return f"{name} has no attention dropout"
    return None


def choose(
    device_type: str, dtype: torch.dtype, *, training: bool, dropout: float, installed: Installed
) -> tuple[str, str]:
    """(backend, reasons) that ``auto`` picks: a pure function of its arguments.

    Example:
        >>> have = Installed(cuda=True, flash_attn=False, te=False, flex=True,
        ...                  varlen=VarlenForm(causal="window_size", scale=True, enable_gqa=False))
        >>> choose("cuda", torch.bfloat16, training=True, dropout=0.0, installed=have)
        ('torch_varlen', 'flash_attn not installed, te not installed; varlen_attn without enable_gqa: K/V heads repeated')
        >>> choose("cuda", torch.float32, training=True, dropout=0.0, installed=have)[0]
        'flex'
    """
    if device_type != "cuda":
        return "sdpa", f"{device_type}: the per-document reference"
    order = BACKENDS if dtype in HALF else ("flex", "sdpa")
    skipped: list[str] = []
    for name in order:
        why = refusal(
            name, device_type, dtype, training=training, dropout=dropout, installed=installed
        )
        if why is None:
            reasons = ", ".join(skipped)
            if name == "torch_varlen" and installed.varlen is not None:
                notes = installed.varlen.describe()
                reasons = f"{reasons}; {notes}" if notes else reasons
            if dtype not in HALF:
                reasons = f"{_name(dtype)}: FlashAttention kernels take float16/bfloat16 only" + (
                    f"; {reasons}" if reasons else ""
                )
            return name, reasons
        skipped.append(_short(name, why))
    raise AssertionError("sdpa takes every input")  # unreachable: sdpa never refuses


def choose_backend(
    device: torch.device | str, dtype: torch.dtype, *, training: bool, dropout: float = 0.0
) -> str:
    """The backend ``backend="auto"`` runs here for ``dtype`` tensors on ``device`` (logged once).

    Example:
        >>> choose_backend("cpu", torch.float32, training=True)
        'sdpa'
    """
    device_type = torch.device(device).type
    name, why = choose(
        device_type, dtype, training=training, dropout=dropout, installed=_installed()
    )
    _log_choice(name, device_type, dtype, training, dropout, why)
    return name


def resolve_backend(
    backend: str,
    device: torch.device | str,
    *,
    training: bool,
    dropout: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> str:
    """The backend to run: ``backend`` itself when it takes the inputs, else a ValueError; 'auto' chooses."""
    if backend == "auto":
        return choose_backend(device, dtype, training=training, dropout=dropout)
    device_type = torch.device(device).type
    why = refusal(
        backend, device_type, dtype, training=training, dropout=dropout, installed=_installed()
    )
    if why is not None:
        auto, _ = choose(
            device_type, dtype, training=training, dropout=dropout, installed=_installed()
        )
        raise ValueError(
            f"attention backend {backend!r} cannot run {'training ' if training else ''}on "
            f"{device_type} {_name(dtype)}: {why}; use backend='auto' (here: {auto!r})"
            + (" or bfloat16 tensors" if dtype not in HALF and "float16" in why else "")
        )
    return backend


def backend_available(
    name: str,
    device: torch.device | str,
    *,
    training: bool = False,
    dtype: torch.dtype | None = None,
) -> bool:
    """Whether backend ``name`` can run on ``device`` (and backpropagate, when ``training``).

    ``dtype=None`` asks about the backend's best dtype (bfloat16 on CUDA, float32 elsewhere).
    """
    device_type = torch.device(device).type
    if dtype is None:
        dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    why = refusal(name, device_type, dtype, training=training, dropout=0.0, installed=_installed())
    return why is None


@functools.cache
def _installed() -> Installed:
    return Installed.find()


@functools.cache
def _log_choice(
    name: str, device_type: str, dtype: torch.dtype, training: bool, dropout: float, why: str
) -> None:
    mode = "training" if training else "inference"
    extra = f", dropout {dropout}" if dropout else ""
    logger.info(
        "attention backend %s for %s %s %s%s (%s)",
        name,
        device_type,
        _name(dtype),
        mode,
        extra,
        why,
    )


def _short(name: str, why: str) -> str:
    if why.endswith("is not installed (pip install flash-attn)") or why.endswith("not installed"):
        return f"{name} not installed"
    return f"{name}: {why}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
