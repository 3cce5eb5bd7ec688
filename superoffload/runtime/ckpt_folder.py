"""The folder of one checkpoint save: made when missing, removed again when its first save
fails (docs/failure_semantics.md, "A full disk").

A save into a new folder that fails (a full disk, a file-size limit, Ctrl-C) used to leave an
empty folder behind, which a later ``--resume`` or a reader takes for a checkpoint that lost
its files. A path that is a symbolic link to a folder not made yet (``ckpt -> /scratch/ckpt``)
is followed, as ``open`` follows it for the files: the target is made, but not its parents (an
unmounted disk's mount point must not be filled on the disk beneath it); ``os.makedirs`` used
to raise a bare ``FileExistsError`` there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator


@contextlib.contextmanager
def checkpoint_folder(path: str) -> Iterator[str]:
    """Folder ``path`` for one save (call under ``folder_lock``): made when missing (a dangling
    symbolic link is followed: its target is made), and removed again when the block fails,
    so a failed first save leaves no empty folder; an existing one is left as it was."""
    made = _make_folder(path)
    try:
        yield path
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise


def _make_folder(path: str) -> str | None:
    """Make checkpoint folder ``path`` (and its parents); the topmost folder made, None when
    it was there. A path that is a file, or a link whose target cannot be made, is refused
    naming it."""
    if os.path.isdir(path):
        return None
    target = os.path.realpath(path) if os.path.islink(path) else path
    top = os.path.abspath(target)
    # the filesystem root exists, so this loop ends
    while not os.path.lexists(os.path.dirname(top)):
        top = os.path.dirname(top)
    try:
        if target is path:
            os.makedirs(path)
        else:  # a dangling link: its target's folder must exist (an unmounted disk's must not
            os.mkdir(target)  # be created on the disk beneath it)
    except FileExistsError:
        if os.path.isdir(path):
            # another process made it just now
            return None
        raise FileExistsError(f"checkpoint folder {path} is a file (or a link to one), not a "
                              "folder: save the checkpoint elsewhere, or remove it") from None
    except OSError as exc:
        if target is path:
            raise
        raise type(exc)(exc.errno, f"checkpoint folder {path} is a symbolic link to {target}, "
                        f"which does not exist and cannot be made ({exc.strerror}): create "
                        f"{target}, or save the checkpoint elsewhere", path) from None
    return top
