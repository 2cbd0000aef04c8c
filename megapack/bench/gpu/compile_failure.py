"""Whether an exception says a kernel cannot be compiled here, as opposed to a bug: the kit reports
the first as "cannot compile here: <reason>" (skipped, with the reason) and the second as a failure.

torch.compile (dynamo, then inductor) raises its own exception types when a kernel has no valid
configuration for a shape, e.g. flex_attention in bf16 at head dim 64 on a Hopper GPU under torch
2.11: inductor's ``NoValidChoicesError``, wrapped by dynamo in ``BackendCompilerFailed`` or
``InductorError``. `compile_failure` looks through the exception and its causes for those types by
name (and inductor's by module), so it imports no torch and keeps working when torch renames its wrappers.
"""

from __future__ import annotations

COMPILE_ERRORS = frozenset(
    {
        "NoValidChoicesError",
        "BackendCompilerFailed",
        "InductorError",
        "LoweringException",
        "CppCompileError",
        "CUDACompileError",
    }
)
"""Exception type names that mean "this kernel cannot be compiled here"."""
COMPILER_MODULES = ("torch._inductor",)
"""Modules whose exceptions are the compiler's own (not dynamo's: its ``TorchRuntimeError`` is a
real error met while tracing)."""


def compile_failure(exc: BaseException) -> str | None:
    """``"cannot compile here: <reason>"`` when ``exc`` or one of its causes is a compile failure,
    else None. The reason is the innermost compiler error's type and first line.

    Example:
        >>> class NoValidChoicesError(RuntimeError): ...
        >>> try:
        ...     try:
        ...         raise NoValidChoicesError("No choices to select, please consider adding ATEN")
        ...     except NoValidChoicesError as e:
        ...         raise RuntimeError("flex_attention failed") from e
        ... except RuntimeError as outer:
        ...     compile_failure(outer)
        'cannot compile here: NoValidChoicesError: No choices to select, please consider adding ATEN'
        >>> compile_failure(ValueError("bad shape")) is None
        True
    """
    found: BaseException | None = None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        kind = type(current)
        if kind.__name__ in COMPILE_ERRORS or kind.__module__.startswith(COMPILER_MODULES):
            found = current  # keep going: the innermost one names the reason
        current = current.__cause__ or current.__context__
    if found is None:
        return None
    first = (str(found).strip().splitlines() or [""])[0][:300]
    return f"cannot compile here: {type(found).__name__}: {first}".rstrip(": ")
