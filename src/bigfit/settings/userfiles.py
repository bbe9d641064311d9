"""Reading the files a user names (--config, --deepspeed-config, --device-map MAP.json, --data): every
way reading one can fail is one BigfitError naming the file, and for bytes that do not decode the line,
the byte offset and the bytes found. Light on purpose (no torch): config.py reads through it."""
from __future__ import annotations

import codecs
import difflib
import io
import itertools
from contextlib import contextmanager
from encodings.aliases import aliases
from pathlib import Path

from ..errors import BigfitError

SOME_ENCODINGS = "utf-8, utf-8-sig (UTF-8 that starts with a BOM), latin-1, cp1252 or utf-16"
SAVE_AS_UTF8 = "save it as UTF-8"


def check_encoding(name: str, flag: str = "--data-encoding") -> None:
    """A BigfitError unless `name` is a text encoding that open() accepts."""
    if not _is_text_encoding(name):
        close = difflib.get_close_matches(name.lower().replace("-", "_"), _text_encodings(), 1)
        hint = f"did you mean {close[0].replace('_', '-')}?" if close else f"give one such as {SOME_ENCODINGS}"
        raise BigfitError(f"{flag} {name!r} is not a text encoding Python knows; {hint}")


def _is_text_encoding(name: str) -> bool:
    try:
        io.TextIOWrapper(io.BytesIO(), encoding=name)  # codecs.lookup alone also takes rot13 and base64
    except LookupError:
        return False
    return True


def _text_encodings() -> list[str]:
    """Python's codec names that open() takes (some, such as mbcs, exist on one platform only)."""
    return sorted(c for c in set(aliases.values()) if _is_text_encoding(c))


def user_file(path: str, what: str, valid: str) -> Path:
    """`path` once it is known to be a regular file; `what` names it in messages ("--data 'x.csv'"),
    `valid` says what to give instead."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise BigfitError(f"{what} is a directory; give {valid}")
    if not p.exists():
        raise BigfitError(f"{what} does not exist; give {valid}")
    if not p.is_file():
        raise BigfitError(f"{what} is not a regular file (a pipe or a device); give {valid}")
    return p


def read_text(path: str, what: str, valid: str, encoding: str = "utf-8", hint: str = SAVE_AS_UTF8) -> str:
    """The whole text of a small file the user named; BigfitError if it is missing, unreadable, not
    `encoding` (`hint` says what to do then) or empty."""
    p = user_file(path, what, valid)
    with reading(p, what, encoding, hint):
        text = p.read_text(encoding=encoding)
    if not text.strip():
        raise BigfitError(f"{what} is empty; give {valid}")
    return text


@contextmanager
def reading(p: Path, what: str, encoding: str, hint: str):
    """Around code that reads `p` as text: an OSError or a decoding error in it becomes one line."""
    try:
        yield
    except UnicodeError:  # UnicodeDecodeError, or utf-16's missing byte-order mark
        raise decode_error(p, what, encoding, hint) from None
    except OSError as e:  # PermissionError, IsADirectoryError (replaced meanwhile), EIO
        raise BigfitError(f"{what} cannot be read: {e.strerror or e}") from None


def decode_error(p: Path, what: str, encoding: str, hint: str) -> BigfitError:
    """The first bytes of `p` that are not `encoding`, found again from the raw bytes: a text reader's
    error counts from its own buffer, not from the start of the file."""
    decoder = codecs.getincrementaldecoder(encoding)()
    line, offset = 1, 0
    with p.open("rb") as f:
        for chunk in itertools.chain(f, [b""]):  # binary lines; the empty last one flushes a cut-off sequence
            pending = len(decoder.getstate()[0])  # bytes held back from the chunks before (e.object has them)
            try:
                line += decoder.decode(chunk, final=not chunk).count("\n")
            except UnicodeDecodeError as e:
                found = " ".join(f"0x{b:02x}" for b in e.object[e.start:e.end][:8])
                return BigfitError(f"{what} line {line}: {found} at byte offset {offset - pending + e.start} is "
                                   f"not valid {encoding} ({e.reason}); {hint}")
            except UnicodeError as e:
                return BigfitError(f"{what} line {line} is not valid {encoding} ({e}); {hint}")
            offset += len(chunk)
    return BigfitError(f"{what} is not valid {encoding} text; {hint}")  # it changed while it was read
