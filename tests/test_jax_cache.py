# The JAX adapter's compiled FFI handlers are loaded only from a directory that no other user
# can write: a library planted in a world-writable directory, in a directory of another user, or
# as a file that others can write, is never loaded (the handlers are built afresh in a private
# temporary directory instead).
import importlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")

# Imported after the skip check; an ImportError here with jax installed is a real failure.
rj = importlib.import_module("rmsnorm.jax")
build = importlib.import_module("rmsnorm._jax_build")

NOBODY = 65534  # another user's uid (nobody's on Debian)

# A shared library that, when loaded, writes the file named by $RMSNORM_PLANTED_MARKER.
PLANTED_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("RMSNORM_PLANTED_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) {
        fputs("loaded", f);
        fclose(f);
    }
}
"""

PROBE = textwrap.dedent(
    """
    import json, rmsnorm.jax as rj
    print(json.dumps([rj.BACKEND, rj.FFI_LIBRARY, rj.CACHE_NOTE, rj.FFI_ERROR]))
    """
)

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another uid")


def library_name():
    return build.library_name(Path(jax.ffi.include_dir()))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The planted library, compiled once."""
    try:
        compiler = build.compiler()
    except FileNotFoundError:
        pytest.skip("no C compiler")
    where = tmp_path_factory.mktemp("planted")
    (where / "planted.c").write_text(PLANTED_SOURCE)
    subprocess.run(
        [compiler, "-shared", "-fPIC", str(where / "planted.c"), "-o", str(where / "planted.so")],
        check=True,
        timeout=120,
    )
    return where / "planted.so"


def plant(planted, directory, mode=0o755):
    """Copies the planted library into ``directory`` under the name the adapter looks for."""
    target = directory / library_name()
    shutil.copyfile(planted, target)
    os.chmod(target, mode)
    return target


def import_in_subprocess(cache_dir, marker):
    env = dict(os.environ, RMSNORM_CACHE_DIR=str(cache_dir), RMSNORM_PLANTED_MARKER=str(marker))
    env.pop("RMSNORM_JAX_FFI", None)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_library_planted_in_a_world_writable_directory_is_never_loaded(tmp_path, planted):
    """End to end, in a fresh process: the cache directory is world-writable and holds a
    library of the right name; it is not loaded, and the handlers work, built elsewhere."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    library = plant(planted, shared)
    before = library.read_bytes()
    marker = tmp_path / "marker"
    backend, loaded, note, error = import_in_subprocess(shared, marker)
    assert not marker.exists(), "the planted library was loaded"
    assert backend == "ffi", error
    assert os.path.dirname(loaded) != str(shared)
    assert not os.path.exists(loaded)  # the private build directory is gone after loading
    assert "writable by group or others" in note
    assert library.read_bytes() == before  # nor was it replaced


def test_the_marker_shows_a_load(tmp_path, planted):
    """The control for the test above: the same library in a private cache directory (the
    user's own, mode 0700) is loaded, and the marker says so. (It is no handler library, so
    the adapter then falls back to its callback backend.)"""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    plant(planted, private)
    marker = tmp_path / "marker"
    backend, loaded, note, error = import_in_subprocess(private, marker)
    assert marker.read_text() == "loaded"
    assert backend == "callback" and "rmsnorm_ffi_init" in error
    assert note is None


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """Points the adapter at a cache directory and makes compiling write an empty file, so
    that each test sees which path the adapter would load. Private build directories that
    the adapter makes are removed afterwards."""
    monkeypatch.setenv("RMSNORM_CACHE_DIR", str(tmp_path / "cache"))

    def compile_stub(target, include):
        target.write_bytes(b"")
        os.chmod(target, 0o600)

    monkeypatch.setattr(build, "build", compile_stub)
    made = []

    def library_file():
        library, scratch, note = build.library_file(Path(jax.ffi.include_dir()))
        if scratch is not None:
            made.append(scratch)
        return library, scratch, note

    yield tmp_path / "cache", library_file
    for scratch in made:
        shutil.rmtree(scratch, ignore_errors=True)


def assert_built_privately(library, scratch, cache_dir):
    """The library to load is a fresh build in a new private directory, not the cache's."""
    assert scratch is not None and library.parent == scratch
    assert scratch != cache_dir and not str(scratch).startswith(str(cache_dir))
    info = os.stat(scratch)
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700


def prepare(directory, mode, owner=None):
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, mode)
    if owner is not None:
        os.chown(directory, owner, owner)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o722], ids=oct)
def test_a_cache_directory_others_can_write_is_not_used(cache, planted, mode):
    cache_dir, library_file = cache
    prepare(cache_dir, mode)
    plant(planted, cache_dir)
    library, scratch, note = library_file()
    assert_built_privately(library, scratch, cache_dir)
    assert "writable by group or others" in note


@as_root
def test_a_cache_directory_of_another_user_is_not_used(cache, planted):
    cache_dir, library_file = cache
    prepare(cache_dir, 0o700)
    plant(planted, cache_dir)
    os.chown(cache_dir, NOBODY, NOBODY)
    library, scratch, note = library_file()
    assert_built_privately(library, scratch, cache_dir)
    assert f"belongs to uid {NOBODY}" in note


def test_a_cache_directory_that_seems_another_users_is_not_used(cache, planted, monkeypatch):
    """The same check without root: the process's uid is made to differ from the owner's."""
    cache_dir, library_file = cache
    prepare(cache_dir, 0o700)
    plant(planted, cache_dir)
    owner = os.geteuid()
    monkeypatch.setattr(build.os, "geteuid", lambda: owner + 1)
    library, scratch, note = library_file()
    monkeypatch.undo()
    assert library.parent == scratch and library.parent != cache_dir
    assert f"belongs to uid {owner}" in note


@pytest.mark.parametrize("parent_mode", [0o777, 0o775], ids=oct)
def test_a_cache_directory_inside_one_others_can_write_is_not_used(
    cache, planted, tmp_path, monkeypatch, parent_mode
):
    """Whoever can write the directory above can rename the cache and put another in its
    place, unless the directory above is sticky (as /tmp is)."""
    _, library_file = cache
    shared = tmp_path / "shared"
    prepare(shared, parent_mode)
    cache_dir = shared / "cache"
    prepare(cache_dir, 0o700)
    plant(planted, cache_dir)
    monkeypatch.setenv("RMSNORM_CACHE_DIR", str(cache_dir))
    library, scratch, note = library_file()
    assert_built_privately(library, scratch, cache_dir)
    assert f"lies in {shared}, which others can write" in note


@pytest.mark.parametrize("problem", ["others_write", "symlink", "another_owner"])
def test_a_library_file_others_could_have_written_is_not_loaded(cache, planted, tmp_path, problem):
    cache_dir, library_file = cache
    prepare(cache_dir, 0o700)
    if problem == "others_write":
        plant(planted, cache_dir, mode=0o666)
        expected = "writable by group or others"
    elif problem == "symlink":
        elsewhere = tmp_path / "elsewhere"
        prepare(elsewhere, 0o777)
        os.symlink(plant(planted, elsewhere), cache_dir / library_name())
        expected = "is not a regular file"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give files to another uid")
        os.chown(plant(planted, cache_dir), NOBODY, NOBODY)
        expected = f"belongs to uid {NOBODY}"
    library, scratch, note = library_file()
    assert_built_privately(library, scratch, cache_dir)
    assert expected in note


def test_a_private_cache_is_created_mode_0700_and_reused(cache):
    cache_dir, library_file = cache
    library, scratch, note = library_file()
    assert scratch is None and library.parent == cache_dir
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
    assert note is None
    built = os.stat(library)
    again, scratch, note = library_file()
    assert (again, scratch, note) == (library, None, None)
    assert os.stat(again).st_mtime_ns == built.st_mtime_ns  # loaded from the cache, not rebuilt


def test_an_own_cache_readable_by_others_is_kept_and_made_private(cache):
    """A cache of this user that others could read but not write (made before the mode was
    enforced) is used, and its mode tightened to 0700."""
    cache_dir, library_file = cache
    prepare(cache_dir, 0o755)
    library, scratch, note = library_file()
    assert scratch is None and library.parent == cache_dir
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
