"""Builds the JAX adapter's FFI handlers (``_jax_ffi.c``) with the system C compiler, and finds
a place to keep them that no other user can write.

The handlers are compiled against the installed jaxlib's headers, which a ``pip install`` of
rmsnorm does not have at build time (and which change with jaxlib), so they are built at first
use and cached by a digest of their sources. A shared library is loaded only from a directory
that belongs to this user, with no group or other write bits, below directories that only this
user or root can write (or sticky ones, as /tmp): the rule ssh applies to its keys.
"""

import hashlib
import os
import shutil
import stat
import subprocess
import sysconfig
import tempfile
from pathlib import Path


def library_name(include):
    """The handler library's file name: a digest of everything compiled into it."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    c_api = include / "xla" / "ffi" / "api" / "c_api.h"
    for part in (here / "_jax_ffi.c", here / "rms_capi.h", c_api):
        digest.update(part.read_bytes())
    return f"jax_ffi_{digest.hexdigest()[:16]}.so"


def unsafe(path, directory):
    """Why another user could have written ``path`` (or, for a directory, replaced what is in
    it), or None when only this user and root could have. The same rule as ssh's for its keys:
    the owner is this user, no group or other write bits, and every directory above belongs to
    this user or root and is not writable by others unless sticky (as /tmp is)."""
    euid = os.geteuid()
    try:
        info = os.stat(path) if directory else os.lstat(path)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror})"
    if directory and not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != euid:
        return f"belongs to uid {info.st_uid}, not to this user (uid {euid})"
    if info.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    parents = Path(os.path.realpath(path)).parents
    for parent in parents:
        up = os.stat(parent)
        if up.st_uid not in (0, euid):
            return f"lies in {parent}, which belongs to uid {up.st_uid}"
        if up.st_mode & 0o022 and not up.st_mode & stat.S_ISVTX:
            return f"lies in {parent}, which others can write (mode {stat.S_IMODE(up.st_mode):04o})"
    return None


def cache_dir():
    """This user's private cache directory (mode 0700 and checked), or None with the reason."""
    configured = os.environ.get("RMSNORM_CACHE_DIR")
    if configured:
        cache = Path(configured)
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rmsnorm"
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"{cache} cannot be created ({exc.strerror})"
    problem = unsafe(cache, directory=True)
    if problem is None and stat.S_IMODE(os.stat(cache).st_mode) & 0o077:
        # Ours and writable by nobody else (a cache made before the mode was enforced): keep it
        # readable by this user alone too.
        os.chmod(cache, 0o700)
    return (None, f"{cache} {problem}") if problem else (cache, None)


def build(target, include):
    """Compiles the handlers into ``target``, through a scratch file beside it."""
    here = Path(__file__).parent
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = [compiler(), "-O2", "-std=gnu11", "-shared", "-fPIC", f"-I{include}", f"-I{here}"]
    try:
        done = subprocess.run(
            command + [str(here / "_jax_ffi.c"), "-o", scratch],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"compiling _jax_ffi.c failed: {done.stderr.strip()[-2000:]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def library_file(include):
    """(path of the handler library to load, private temporary directory to remove after
    loading or None, why the user's cache was not used or None). The path is in the user's own
    cache when that is safe, built there if missing; otherwise it is built afresh in a new
    ``tempfile.mkdtemp()`` directory."""
    name = library_name(include)
    cache, note = cache_dir()
    if cache is not None:
        library = cache / name
        try:
            if not os.path.lexists(library):
                build(library, include)
            problem = unsafe(library, directory=False)
        except OSError as exc:  # a full or read-only disk, say
            problem = f"cannot be written ({exc})"
        if problem is None:
            return library, None, None
        note = f"{library} {problem}"
    scratch = Path(tempfile.mkdtemp(prefix="rmsnorm-jax-"))
    try:
        build(scratch / name, include)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return scratch / name, scratch, note


def compiler():
    """The first C compiler found: $CC, Python's own, cc, gcc."""
    names = [os.environ.get("CC", ""), sysconfig.get_config_var("CC") or "", "cc", "gcc"]
    for name in names:
        found = name.split()[0] if name.split() else None
        if found and shutil.which(found):
            return found
    raise FileNotFoundError("no C compiler found ($CC, cc, gcc)")
