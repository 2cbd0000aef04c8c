"""Which attention backend runs where: a pure rule over (device, dtype, training, dropout, installed).

    backend       kernel                                   takes
    te            Transformer Engine DotProductAttention   CUDA, float16/bfloat16, dropout
    cudnn         cuDNN's ragged fused attention           CUDA sm90+, float16/bfloat16, cuDNN >= 9.6,
                  (`megapack.attention.cudnn`)             nvidia-cudnn-frontend
    bucketed      SDPA over length buckets                 anywhere, any dtype, dropout (on CUDA
                  (`megapack.attention.bucketed`)          ``auto`` needs the plan delivered)
    flash_attn    flash_attn_varlen_func                   CUDA, float16/bfloat16, dropout
    torch_varlen  torch.nn.attention.varlen.varlen_attn    CUDA, float16/bfloat16 (FlashAttention 2)
    flex          compiled flex_attention + block mask     CUDA; CPU forward only (no CPU backward)
    sdpa          scaled_dot_product_attention per doc     anywhere, any dtype: the reference

`resolve_backend` is the one function that names the backend to run: ``backend="auto"`` takes the
first backend of `preference` that is installed and takes the inputs (`choose`, the pure rule):

    CUDA sm90+, float16/bfloat16   te, cudnn, bucketed, flash_attn, torch_varlen, flex, sdpa
    other CUDA, float16/bfloat16   flash_attn, te, torch_varlen, flex, bucketed, sdpa
    CUDA float32                   flex, bucketed, sdpa (FlashAttention-based kernels refuse it)
    anywhere else (CPU)            bucketed, sdpa (flex's CPU forward compiles for seconds per row
                                   length and has no backward)

On Hopper cuDNN's sm90 kernels run about 2x torch varlen's FlashAttention 2 per FLOP (measured on
an H200, torch 2.11): te and cudnn reach them for THD directly, bucketed through dense SDPA calls
(which pick them), at the cost of padding each document to its length class. flash_attn is FA2,
no faster there than torch varlen. On CUDA, ``auto`` takes bucketed only when the batch brought its
plan (``fields=megapack.BUCKET_FIELDS``): without it every micro-batch would read its boundaries on
the host (a device sync). It never picks a kernel that refuses the inputs, and `resolve_backend`
logs the choice once per (device, dtype, training, dropout) on the ``megapack.attention`` logger
with the reasons, e.g.::

    attention backend torch_varlen for cuda bfloat16 training (flash_attn not installed, te not
    installed; varlen_attn without enable_gqa: K/V heads repeated)

A cuDNN graph that cannot be built for a shape (`megapack.attention.cudnn.CudnnUnavailable`) is
found only when it is first asked for, before any of its kernels runs: `fallback` names the next
backend, and the reason is logged once; a lasting refusal keeps ``auto`` off cudnn for the
process, a transient one (out of memory...) only for that call.

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

BACKENDS = ("te", "cudnn", "bucketed", "flash_attn", "torch_varlen", "flex", "sdpa")
"""Every backend, in ``auto``'s order of preference on CUDA sm90+ with float16/bfloat16."""
NO_CONTEXT_PARALLEL = frozenset({"cudnn", "bucketed"})
"""Backends without a context-parallel path (``auto`` under CP skips them)."""
HALF = (torch.float16, torch.bfloat16)
"""The dtypes FlashAttention-based kernels take."""
_NO_DROPOUT = frozenset({"torch_varlen", "flex", "cudnn"})
_HALF_ONLY = frozenset({"te", "cudnn", "flash_attn", "torch_varlen"})
_CUDA_ONLY = frozenset({"te", "cudnn", "flash_attn", "torch_varlen"})
MIN_CUDNN = 90600
"""cuDNN 9.6 (int64 ragged offsets): the oldest the cudnn backend takes."""

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
    cudnn_frontend: bool = False
    """nvidia-cudnn-frontend (``import cudnn``) is importable."""
    cudnn_version: int | None = None
    """The cuDNN library's version (9.19.0: 91900), None without cuDNN."""
    sm: int | None = None
    """The current CUDA device's compute capability (9.0: 90), None without CUDA."""

    @classmethod
    def find(cls) -> Installed:
        """This process's `Installed` (looks for modules; imports none of the optional packages
        but torch's own cuDNN version query)."""
        fn = installed_varlen()
        cuda = torch.cuda.is_available()
        sm = None
        if cuda:
            major, minor = torch.cuda.get_device_capability()
            sm = 10 * major + minor
        version = (
            torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None
        )
        return cls(
            cuda=cuda,
            flash_attn=_has_module("flash_attn"),
            te=_has_module("transformer_engine"),
            varlen=None if fn is None else form_of(fn),
            flex=_has_module("torch.nn.attention.flex_attention"),
            cudnn_frontend=_has_module("cudnn"),
            cudnn_version=None if version is None else int(version),
            sm=sm,
        )


def preference(device_type: str, dtype: torch.dtype, installed: Installed) -> tuple[str, ...]:
    """``auto``'s order of backends for these inputs (module docstring).

    Example:
        >>> have = Installed(cuda=True, flash_attn=False, te=False, varlen=None, flex=True, sm=90)
        >>> preference("cuda", torch.bfloat16, have)[:3]
        ('te', 'cudnn', 'bucketed')
        >>> preference("cpu", torch.float32, have)
        ('bucketed', 'sdpa')
    """
    if device_type != "cuda":
        return ("bucketed", "sdpa")
    if dtype not in HALF:
        return ("flex", "bucketed", "sdpa")
    if installed.sm is not None and installed.sm >= 90:
        return BACKENDS
    return ("flash_attn", "te", "torch_varlen", "flex", "bucketed", "sdpa")


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
    if name in ("sdpa", "bucketed"):
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
    why = _missing(name, installed)
    if why is not None:
        return why
    if name in _HALF_ONLY and dtype not in HALF:
        kind = "cuDNN's fused attention" if name == "cudnn" else "FlashAttention-based"
        return f"{name} is {kind} and takes float16/bfloat16 only"
    if dropout > 0.0 and name in _NO_DROPOUT:
        return f"{name} has no attention dropout"
    return None


def _missing(name: str, installed: Installed) -> str | None:
    """Why a CUDA-only backend is not installed or not usable on this GPU, or None."""
    if name == "flash_attn" and not installed.flash_attn:
        return "flash-attn is not installed (pip install flash-attn)"
    if name == "te" and not installed.te:
        return "Transformer Engine is not installed"
    if name == "torch_varlen" and installed.varlen is None:
        return "this torch has no usable torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
    if name != "cudnn":
        return None
    if not installed.cudnn_frontend:
        return "nvidia-cudnn-frontend is not installed (pip install 'megapack[cudnn]')"
    if installed.sm is None or installed.sm < 90:
        return f"cuDNN's ragged (THD) attention needs sm90 or newer, this GPU is sm{installed.sm}"
    if installed.cudnn_version is None or installed.cudnn_version < MIN_CUDNN:
        return f"cuDNN {installed.cudnn_version} is older than 9.6 (int64 ragged offsets)"
    return None


def choose(
    device_type: str,
    dtype: torch.dtype,
    *,
    training: bool,
    dropout: float,
    installed: Installed,
    planned: bool = False,
    excluded: frozenset[str] = frozenset(),
) -> tuple[str, str]:
    """(backend, reasons) that ``auto`` picks: a pure function of its arguments.

    ``planned``: the batch brought its bucket plan (on CUDA ``bucketed`` needs it); ``excluded``:
    backends found unable to run these inputs (`fallback`).

    Example:
        >>> have = Installed(cuda=True, flash_attn=False, te=False, flex=True,
        ...                  varlen=VarlenForm(causal="window_size", scale=True, enable_gqa=False))
        >>> choose("cuda", torch.bfloat16, training=True, dropout=0.0, installed=have)
        ('torch_varlen', 'flash_attn not installed, te not installed; varlen_attn without enable_gqa: K/V heads repeated')
        >>> choose("cuda", torch.float32, training=True, dropout=0.0, installed=have)[0]
        'flex'
    """
    skipped: list[str] = []
    for name in preference(device_type, dtype, installed):
        why = refusal(
            name, device_type, dtype, training=training, dropout=dropout, installed=installed
        )
        if why is None and name in excluded:
            why = "cannot run these inputs"
        if why is None and name == "bucketed" and device_type == "cuda" and not planned:
            why = "no bucket plan delivered (fields=megapack.BUCKET_FIELDS)"
        if why is None:
            reasons = ", ".join(skipped)
            if name == "torch_varlen" and installed.varlen is not None:
                notes = installed.varlen.describe()
                reasons = f"{reasons}; {notes}" if notes else reasons
            if device_type != "cuda":
                reasons = f"{device_type}: " + (
                    "dense SDPA per length bucket" if name == "bucketed" else "the reference"
                )
            elif dtype not in HALF:
                reasons = f"{_name(dtype)}: FlashAttention kernels take float16/bfloat16 only" + (
                    f"; {reasons}" if reasons else ""
                )
            return name, reasons
        skipped.append(_short(name, why))
    return "sdpa", ", ".join(skipped)  # everything else excluded: the reference takes anything


def _auto(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    training: bool,
    dropout: float,
    planned: bool,
    excluded: frozenset[str],
) -> str:
    """What ``backend="auto"`` runs here (logged once): `choose` over what is installed, never one
    of ``excluded`` or of the backends that failed here (`fallback`)."""
    device_type = torch.device(device).type
    name, why = choose(
        device_type,
        dtype,
        training=training,
        dropout=dropout,
        installed=_installed(),
        planned=planned,
        excluded=excluded | frozenset(_failed),
    )
    _log_choice(name, device_type, dtype, training, dropout, why)
    return name


_failed: dict[str, str] = {}
"""Backends that failed at run time in this process (`fallback`), with the reason."""


def fallback(failed: str, reason: str, device: torch.device | str, dtype: torch.dtype, *,
             training: bool, dropout: float = 0.0, planned: bool = False,
             remember: bool = True) -> str:  # fmt: skip
    """The backend ``auto`` runs instead of ``failed``, which could not run (``reason``, logged
    once). With ``remember`` (a lasting refusal) ``failed`` is not chosen again in this process;
    without (a transient failure) it is skipped for this call only."""
    if not remember:
        _log_transient(failed, reason)
        return resolve_backend("auto", device, training=training, dropout=dropout, dtype=dtype,
                               planned=planned, excluded=frozenset({failed}))  # fmt: skip
    if failed not in _failed:
        _failed[failed] = reason
        logger.warning("attention backend %s cannot run here, falling back: %s", failed, reason)
    return resolve_backend(
        "auto", device, training=training, dropout=dropout, dtype=dtype, planned=planned
    )


@functools.cache
def _log_transient(failed: str, reason: str) -> None:
    logger.warning(
        "attention backend %s failed for this call, falling back (it is tried again on the "
        "next): %s",
        failed,
        reason,
    )


def resolve_backend(
    backend: str,
    device: torch.device | str,
    *,
    training: bool,
    dropout: float = 0.0,
    dtype: torch.dtype = torch.float32,
    planned: bool = False,
    excluded: frozenset[str] = frozenset(),
) -> str:
    """The attention backend to run for ``dtype`` tensors on ``device``.

    Args:
        backend: one of `BACKENDS`, or ``"auto"``: the first of `preference` that is installed
            and takes the inputs (the choice and its reasons logged once).
        training: the backward will run.
        dropout: the attention dropout probability.
        planned: the batch brought its bucket plan (on CUDA ``auto`` takes ``bucketed`` only then).
        excluded: backends ``auto`` must not pick (e.g. `NO_CONTEXT_PARALLEL` under CP); the ones
            that failed in this process (`fallback`) are never picked either.

    Returns:
        ``backend`` itself when it takes the inputs, or ``auto``'s choice.

    Raises:
        ValueError: an unknown backend, or one that cannot take the inputs (naming why and what
            ``auto`` would run).

    Example:
        >>> resolve_backend("auto", "cpu", training=True)
        'bucketed'
        >>> resolve_backend("sdpa", "cpu", training=True, dtype=torch.bfloat16)
        'sdpa'
    """
    if backend == "auto":
        return _auto(
            device, dtype, training=training, dropout=dropout, planned=planned, excluded=excluded
        )
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


def installed_here() -> Installed:
    """This process's `Installed`, found once."""
    return _installed()


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
    if "not installed" in why:
        return f"{name} not installed"
    return f"{name}: {why}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
