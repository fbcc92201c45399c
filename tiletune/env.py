"""Reading tiletune's environment variables without ever failing on a bad value.

A setting like TILETUNE_COMPILE_TIMEOUT_SEC=60s or TILETUNE_COMPILE_JOBS=auto must not stop an
import or a run: each reader here returns the default for a value it cannot use and says so in
one warning per (variable, value) in the process. An unset or blank variable is the default,
silently.
"""
import math
import os
import warnings

# Spellings that turn a feature off / on (compared stripped and case-insensitive).
OFF = frozenset({"", "0", "off", "no", "none", "false", "disable", "disabled"})
ON = frozenset({"1", "on", "yes", "true", "enable", "enabled"})

_warned = set()         # (variable, raw value) pairs already warned about in this process


def warn_once(tag, message):
    """warnings.warn(message) the first time this process sees `tag` (any hashable)."""
    if tag in _warned:
        return
    _warned.add(tag)
    warnings.warn(message, stacklevel=3)


def _raw(name):
    """The variable's value stripped, or None when it is unset or blank."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def number(name, default, maximum=None):
    """The variable as a positive finite float, e.g. TILETUNE_COMPILE_TIMEOUT_SEC=90 or 2.5.

    Unset or blank: `default`. Anything else (60s, -1, 0, nan, inf): one warning, then
    `default`. Above `maximum`, when one is given: one warning, then `maximum`."""
    value = _raw(name)
    if value is None:
        return default
    try:
        x = float(value)
    except ValueError:
        x = None
    if x is None or not math.isfinite(x) or x <= 0:
        warn_once((name, value), f"tiletune: {name}={value!r} is not a positive number of "
                                 f"seconds; using the default {default}")
        return default
    if maximum is not None and x > maximum:
        warn_once((name, value), f"tiletune: {name}={value!r} is more than the {maximum:g} "
                                 f"seconds it can be; using {maximum:g}")
        return maximum
    return x


def integer(name, default, minimum=None, refuse=None):
    """The variable as an int (decimal, e.g. TILETUNE_COMPILE_JOBS=8).

    Unset or blank: `default`. Not an integer (auto, 4.0, eight), or below `minimum` when one
    is given: one warning, then `default`; where `refuse` is given (a value the caller cannot
    do without, and why), a ValueError naming the variable instead."""
    value = _raw(name)
    if value is None:
        return default
    try:
        n = int(value, 10)
    except ValueError:
        n = None
    if n is None or (minimum is not None and n < minimum):
        want = "an integer" if minimum is None else f"an integer >= {minimum}"
        if refuse is not None:
            raise ValueError(f"tiletune: {name}={value!r} is not {want} ({refuse})")
        warn_once((name, value), f"tiletune: {name}={value!r} is not {want}; "
                                 f"using the default {default}")
        return default
    return n


def flag_off(value):
    """True when a setting's value means "off": off, 0, no, none, false, disable(d) or blank
    (case-insensitive). None (the variable is unset) is not off."""
    return value is not None and value.strip().lower() in OFF


def flag_on(value):
    """True when a setting's value means "on": 1, on, yes, true, enable(d) (case-insensitive).
    None (unset) and anything else are not on."""
    return value is not None and value.strip().lower() in ON


def unwritable(path):
    """Why `path` (a file, or the folder it would be made in) cannot be written, or "" when
    it can: what a command checks before its work, so a long run is not lost at the end.
    The folder must be writable too where the file exists: tiletune replaces its files
    through a temporary file beside them, and the store's database keeps -wal and -shm files
    there."""
    folder = os.path.dirname(path)
    while folder and not os.path.exists(folder):       # to be made: its first existing parent
        folder = os.path.dirname(folder) if os.path.dirname(folder) != folder else ""
    if os.path.isdir(path):
        return "a folder, not a file"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "not writable"
    if folder and not os.path.isdir(folder):
        return f"{folder} is not a folder"
    return "" if not folder or os.access(folder, os.W_OK) else f"{folder} is not writable"
