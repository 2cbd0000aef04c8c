"""The installed megatron-core release and what it offers megapack: the one place that knows.

megapack runs on megatron-core 0.16.1 (Python 3.11) up to 0.19.2 (Python 3.12; 0.17.0 onwards
need Python >= 3.12), both lines tested in CI; `SUPPORTED` holds that range and setup.py declares
the same. Each difference between the two that megapack meets is handled in exactly one place,
and none of them by comparing version numbers:

    difference (0.16.1 -> 0.19.2)                    handled by
    PackedSeqParams gains pad_between_seqs,          `MegatronRelease.packed_seq_fields` (read off
      total_tokens, seq_idx, tokens_per_sample         the dataclass): `megapack.core.seq_params`
                                                       fills only what the release offers
    DDP's bucket sync calls                          `megapack.harness.megatron_cpu`'s torch view
      ``torch.cuda.current_stream()``                  (CPU runs only; a GPU needs nothing)
    ``hyper_comm_grid``, now imported on megapack's  `megapack.core.quiet.HARMLESS`
      paths, warns that absl is absent
    TransformerConfig's ``cuda_graph_scope``         `megapack.core.quiet.HARMLESS` (0.16 only:
      defaults to None, no longer "full"               its "full scope is deprecated" warning)
    ``package_info`` appends the ``git rev-parse``   `MegatronRelease.version`, read from the
      of the directory it is installed in to           installed distribution's metadata (a venv
      ``__version__``                                  inside a git checkout gets that commit)
    THD RoPE reads the row's total with              nothing: one host read per call either way
      ``.item()`` where 0.16 compared tensors          (the sync control counts either)
    GPTModel logs "GPTModel IS DEPRECATED"           left visible: megatron-core's word to its users

Unchanged across the range and relied on: the schedules' keyword arguments, the
``parallel_state`` functions megapack calls (none deprecated), the TransformerConfig fields
megapack sets (tests/unit/test_megatron_release.py checks these three against the installed
release, on both lines in CI), and ``GPTModel``'s, DDP's and ``finalize_model_grads``' arguments
(0.19 only adds optional ones; the suite runs them).

The release is probed once per process, lazily (importing megatron-core takes seconds), with its
known-harmless warnings quieted that first time; a release outside `SUPPORTED` (e.g. a Megatron-LM
checkout on ``PYTHONPATH``, which pip's range does not guard) is logged once as a warning.

Example:
    >>> release = megatron_release()  # doctest: +SKIP
    >>> release.version, "pad_between_seqs" in release.packed_seq_fields  # doctest: +SKIP
    ((0, 19, 2), True)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import re
import sys
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("megapack")

Version = tuple[int, int, int]

SUPPORTED: tuple[Version, Version] = ((0, 16, 1), (0, 19, 2))
"""The lowest megatron-core release CI tests (on Python 3.11) and the highest it runs (on 3.12)."""

DISTRIBUTION = "megatron-core"


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronRelease:
    """What the installed megatron-core offers megapack (`megatron_release` probes it once)."""

    version: Version
    """(major, minor, patch) of the installed release, e.g. (0, 19, 2)."""
    packed_seq_params: type
    """Its ``megatron.core.packed_seq_params.PackedSeqParams`` class."""
    packed_seq_fields: frozenset[str]
    """The dataclass fields of ``packed_seq_params``: 0.16.1 has nine (qkv_format, the four
    boundaries, the two maxima, local_cp_size, cp_group); 0.19.2 adds total_tokens, seq_idx,
    tokens_per_sample and pad_between_seqs."""

    @property
    def supported(self) -> bool:
        """Whether ``version`` lies in `SUPPORTED` (the range CI runs)."""
        return SUPPORTED[0] <= self.version <= SUPPORTED[1]


@functools.cache
def megatron_release() -> MegatronRelease:
    """The installed megatron-core release, probed on the first call (imports megatron-core).

    Raises:
        ImportError: megatron-core is not installed.
        ValueError: its version cannot be read as major.minor.patch (names the text).
    """
    module: Any = sys.modules.get("megatron.core.packed_seq_params")
    if module is None:
        from megapack.core.quiet import quiet_megatron

        with quiet_megatron():
            import megatron.core.packed_seq_params

        module = megatron.core.packed_seq_params
    cls = module.PackedSeqParams
    release = MegatronRelease(
        version=installed_version(),
        packed_seq_params=cls,
        packed_seq_fields=frozenset(f.name for f in dataclasses.fields(cls)),
    )
    if not release.supported:
        logger.warning(
            "megatron-core %s is outside the releases megapack is tested with (%s to %s); "
            "install one of those (pip install 'megatron-core>=%s,<=%s')",
            _text(release.version),
            _text(SUPPORTED[0]),
            _text(SUPPORTED[1]),
            _text(SUPPORTED[0]),
            _text(SUPPORTED[1]),
        )
    return release


def installed_version() -> Version:
    """The installed megatron-core's (major, minor, patch): from its distribution's metadata, else
    (a source checkout on ``sys.path``) from ``megatron.core.package_info``."""
    try:
        return parse_version(importlib.metadata.version(DISTRIBUTION))
    except importlib.metadata.PackageNotFoundError:
        from megatron.core import package_info

        return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def parse_version(text: str) -> Version:
    """``"0.19.2"``, ``"0.19.2rc1"`` or ``"0.19.2+abc1234"`` -> ``(0, 19, 2)``.

    Raises:
        ValueError: ``text`` does not start with major.minor.patch.
    """
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(
            f"megatron-core's version {text!r} does not start with major.minor.patch "
            "(e.g. '0.19.2'); reinstall megatron-core from a release"
        )
    major, minor, patch = (int(g) for g in match.groups())
    return (major, minor, patch)


def _text(version: Version) -> str:
    return ".".join(map(str, version))
