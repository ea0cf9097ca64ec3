"""Reading a file the user named (spec, data): every way it can fail is a `SpecError` naming the file."""

from __future__ import annotations

from pathlib import Path

from .errors import SpecError


def check_file(path: Path, key: str, what: str) -> None:
    """Refuse a path that does not exist or is not a regular file; `what` says what the file should be."""
    if path.is_dir():
        raise SpecError(key, f"{path} is a directory, not a file", f"give the path of {what}")
    if not path.exists():
        raise SpecError(key, f"{path} does not exist", f"give the path of {what} (relative to the current directory)")


def read_text(path: Path, key: str, what: str) -> str:
    """The file's text (UTF-8); a missing, unreadable or binary file is a `SpecError` naming `key`."""
    check_file(path, key, what)
    name = "the file" if key == str(path) else str(path)  # the message starts with `key` already
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(key, f"{name} is not UTF-8 text (byte {err.start} is 0x{err.object[err.start]:02x})",
                        f"give {what}, not a binary file") from None
    except OSError as err:
        raise SpecError(key, f"{name} cannot be read: {err.strerror or err}",
                        "check the file's permissions (it must be readable by this user)") from None
