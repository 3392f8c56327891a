"""Every error dice_fast's core raises, in one place; each derives from `DiceError`.

Each also keeps the standard exception it has always been (``OptionError`` is a ``ValueError``,
``InputOutOfMemory`` a ``RuntimeError``), so ``except ValueError`` goes on working:

    DiceError
      OptionError(ValueError)         an option or argument value that is not allowed
      ArgumentTypeError(TypeError)    an argument of the wrong type (texts, options)
      TextError(ValueError)           a text that cannot be encoded as it is (``index`` names it)
      InputError(ValueError)          an input file or record that cannot be read (names file and line)
        MissingFile(FileNotFoundError)  an input file, or a file an output's record lists, is not there
      ModelError(ValueError)          a model that cannot be loaded or used (``path`` names it)
      CacheError(ValueError)          a chunk-cache folder or file that cannot be used
      WriteError(OSError)             a file that cannot be written (disk full, read-only): names it
      InputOutOfMemory(RuntimeError)  one chunk ran out of memory even alone in its batch
      NonFiniteOutput(RuntimeError)   the model gave NaN or an infinity for an input (``index`` names it)
      MissingDependency(ImportError)  an optional package a feature needs is not installed

The command line maps these types to one-line messages (`describe`); the server has its own
request errors (`dice_fast.serve.errors`).
"""

from __future__ import annotations

import contextlib
import sys


class DiceError(Exception):
    """Base of every error raised by dice_fast's core."""


class OptionError(DiceError, ValueError):
    """An option or argument value that is not allowed (the message names it and what is allowed)."""


class ArgumentTypeError(DiceError, TypeError):
    """An argument of the wrong type (e.g. a single string where a list of texts is expected)."""


class TextError(DiceError, ValueError):
    """A text that cannot be encoded as it is; ``index``: its position among the texts passed in."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


class InputError(DiceError, ValueError):
    """An input file or record that cannot be read (not UTF-8, malformed JSON, a CSV of other columns)."""


class MissingFile(InputError, FileNotFoundError):
    """An input file, or a file an output's record lists, that is not there (also a FileNotFoundError)."""


class MissingDependency(DiceError, ImportError):
    """An optional package a feature needs is not installed (the message says what to install)."""


class ModelError(DiceError, ValueError):
    """A model that cannot be loaded or used; ``path``: the folder or name given (None: the bundled one)."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class CacheError(DiceError, ValueError):
    """A cache folder or file that cannot be used (not a dice_fast chunk cache, unreadable)."""


class WriteError(DiceError, OSError):
    """A file that cannot be written (the disk full, a read-only or vanished folder); the message names
    it, ``errno`` is the system's. Raised through `writing`."""


@contextlib.contextmanager
def writing(path):
    """Turn an ``OSError`` raised while writing ``path`` (a file or an output folder) into a `WriteError`
    naming it (numpy and pyarrow say only "No space left on device", or "12800 requested and 7468 written")."""
    try:
        yield
    except WriteError:
        raise
    except OSError as exc:
        err = WriteError(f"cannot write {path}: {exc.strerror or _short_write(path, exc)}")
        err.errno = exc.errno
        raise err from exc


def _short_write(path, exc: OSError) -> str:
    """``exc`` (a short write that says no why: numpy's "N requested and M written") with its likely cause:
    a full disk, or a file size limit (``ulimit -f``) set for this process."""
    import shutil
    from pathlib import Path

    said, where = one_line(exc), Path(path).absolute()
    with contextlib.suppress(OSError, StopIteration):
        if shutil.disk_usage(next(p for p in (where, *where.parents) if p.exists())).free < 1 << 20:
            return f"No space left on device ({said})"
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return f"{said}; this process may write files of at most {limit:,} bytes (ulimit -f)"
    return said


@contextlib.contextmanager
def reading_parquet(path):
    """Turn a failure to open or read the Parquet file ``path`` (truncated, damaged, not Parquet: pyarrow's
    errors, an ``OSError``) into an `InputError` naming it, a `MissingFile` when it is not there. The
    core's own errors and running out of memory pass through unchanged."""
    try:
        yield
    except (DiceError, MemoryError):
        raise
    except Exception as exc:
        pa = sys.modules.get("pyarrow")  # only a process that loaded pyarrow can have its errors
        if not isinstance(exc, (OSError, ValueError, KeyError) + ((pa.ArrowException,) if pa else ())):
            raise
        if isinstance(exc, FileNotFoundError):
            raise MissingFile(f"{path}: missing") from None
        raise InputError(f"{path}: not a readable Parquet file, damaged or truncated ({one_line(exc)})") from None


class Int8Unsupported(DiceError, RuntimeError):
    """dtype="int8" was asked for on a CPU without int8 dot-product instructions (VNNI or AMX)."""


class InputOutOfMemory(DiceError, RuntimeError):
    """One chunk of an input ran out of memory even alone in its batch.

    index: the input's index within its call (or request); name: how the message names it
    ("documents[3]", "input[3]"); tokens: the failing chunk's tokens; cause: the allocator's message.
    Nothing else of the call is mixed up: the other inputs' vectors were exact.
    """

    def __init__(self, index: int, tokens: int, cause: str, name: str | None = None):
        self.index, self.tokens, self.cause = int(index), int(tokens), cause
        self.name = name or f"input[{self.index}]"
        super().__init__(f"out of memory encoding {self.name}: one of its chunks ({self.tokens} tokens) ran out of "
                         f"memory even alone in a batch ({cause}); free memory, or lower chunk_size")

    def renamed(self, name: str, offset: int = 0) -> InputOutOfMemory:
        """The same failure with the input named ``name`` and its index shifted by ``offset``."""
        return InputOutOfMemory(self.index + offset, self.tokens, self.cause, name)


class NonFiniteOutput(DiceError, RuntimeError):
    """The model's output for one input holds NaN or an infinity (it overflows its dtype, float16's
    65,504 most often, or its weights hold NaN): never returned, cached or stored as a vector.

    index: the input's index within its call (or request); name: how the message names it
    ("documents[3]"); precision: what the forward ran in ("float16"; of an OpenVINO model's identity
    only its first word, "int8": the message may go to a server's clients). The other inputs' vectors
    were exact: attention never crosses inputs."""

    def __init__(self, index: int, precision: str, name: str | None = None):
        self.index, self.precision = int(index), precision.split(" (")[0]
        self.name = name or f"input[{self.index}]"
        super().__init__(f"the model's output for {self.name} is not finite (NaN or infinite) in {self.precision}: the "
                         "model overflows this precision, or its weights hold NaN; encode it in float32 (or "
                         "bfloat16, whose range is float32's)")

    def renamed(self, name: str, offset: int = 0) -> NonFiniteOutput:
        """The same failure with the input named ``name`` and its index shifted by ``offset``."""
        return NonFiniteOutput(self.index + offset, self.precision, name)


def require(*modules: str, extra: str, needed_by: str, hint: str = "", load: bool = True):
    """Import ``modules`` and return the first; with ``load=False`` only check that they are installed
    (nothing imported, returns None). Any missing: `MissingDependency` "<needed_by> needs <the missing>:
    pip install 'dice-fast[<extra>]'<hint>" (one installed that fails to import says so, and why)."""
    import importlib
    import importlib.util

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ValueError:  # in sys.modules without a spec: it is there
            return True
        except ImportError:  # its package failed to import: installed if the package is (the import says why)
            return name.partition(".")[0] != name and installed(name.partition(".")[0])

    if missing := [m for m in modules if not installed(m)]:
        raise MissingDependency(f"{needed_by} needs {', '.join(missing)}: pip install 'dice-fast[{extra}]'{hint}")
    if not load:
        return None
    loaded = []
    for name in modules:
        try:
            loaded.append(importlib.import_module(name))
        except ImportError as exc:
            raise MissingDependency(f"{needed_by} needs {name}, which is installed but failed to import "
                                    f"({one_line(exc)}): pip install 'dice-fast[{extra}]'{hint}") from exc
    return loaded[0]


def describe(exc: BaseException) -> str | None:
    """The one-line message the command line prints for ``exc``, or None when it is not a user's error
    (a bug: let it raise with its traceback). Decided by the exception's type, never by its message."""
    if isinstance(exc, InputOutOfMemory):
        return one_line(exc)
    torch = sys.modules.get("torch")  # only a process that loaded torch can have its errors
    if isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError)):
        return f"out of memory ({one_line(exc)[:200]}); lower --max-batch-tokens"
    if isinstance(exc, (DiceError, ValueError, TypeError, OSError, ImportError)):
        return one_line(exc)
    return None


# what torch's CPU allocator says: it raises a plain RuntimeError, so only its message tells; and oneDNN's
# GEMM under a memory cap (ulimit -v): its scratch allocation fails as "could not create a primitive"
_ALLOCATOR_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory", "defaultcpuallocator",
                       "failed to allocate", "could not create a primitive")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator failure (CUDA or CPU), which a smaller batch may avoid. The one
    place dice_fast recognises one: by type (``torch.OutOfMemoryError``, ``MemoryError``), and for the
    plain ``RuntimeError`` of torch's CPU allocator by its message (the engine's split-and-retry,
    `dice_fast.faults`, needs to know; what escapes it is an `InputOutOfMemory`)."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # only a process that loaded torch can have its errors
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _ALLOCATOR_MESSAGES)


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (an OSError as "reason: file")."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return " ".join(str(exc).split()) or type(exc).__name__


__all__ = ["ArgumentTypeError", "CacheError", "DiceError", "InputError", "InputOutOfMemory", "Int8Unsupported", "MissingDependency", "MissingFile",
           "ModelError", "NonFiniteOutput", "OptionError", "TextError", "WriteError", "describe", "is_out_of_memory", "one_line", "reading_parquet", "require", "writing"]
