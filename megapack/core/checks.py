"""Argument checks shared by every public function: one exception type per kind of mistake.

A wrong *type* (a float, a str, a bool where an int belongs) is a ``TypeError``; a value of the
right type outside its range is a ``ValueError``. Both name the argument and the value::

    >>> check_int("seq_len", 4096, minimum=1)
    4096
    >>> check_int("seq_len", 0, minimum=1)
    Traceback (most recent call last):
    ValueError: seq_len must be an int >= 1, got 0
    >>> check_int("seq_len", 4096.0, minimum=1)
    Traceback (most recent call last):
    TypeError: seq_len must be an int >= 1, got float 4096.0
    >>> check_int("cp_rank", 2, minimum=0, maximum=1)
    Traceback (most recent call last):
    ValueError: cp_rank must be an int from 0 to 1, got 2

Every hand-written check of an int argument goes through `check_int`, so a wrong type is never
a ValueError and the messages read alike.
"""

from __future__ import annotations

import numpy as np


def check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` as an int; TypeError unless an int (numpy ints too, never bool), ValueError
    below ``minimum`` or above ``maximum``."""
    if minimum is not None and maximum is not None:
        need = f"an int from {minimum} to {maximum}"
    elif minimum is not None:
        need = f"an int >= {minimum}"
    elif maximum is not None:
        need = f"an int <= {maximum}"
    else:
        need = "an int"
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be {need}, got {type(value).__name__} {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {need}, got {value!r}")
    return int(value)


def check_seconds(name: str, value: object) -> float:
    """``value`` as float seconds; TypeError unless a real number (not bool), ValueError unless > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(
            f"{name} must be a positive number of seconds, got {type(value).__name__} {value!r}"
        )
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)
