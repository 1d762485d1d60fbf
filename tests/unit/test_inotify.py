"""vgpu.inotify, on real files through the kernel's inotify: what the node agent and the
autoscaler learn of processes closing their slices' usage files."""
import os

from vgpu.inotify import IN_CLOSE_WRITE, open_inotify


def _close_after_writing(path):
    os.close(os.open(path, os.O_RDWR))


def test_a_close_after_writing_is_reported_and_a_file_watched_again_keeps_its_watch(tmp_path):
    """Watching the same file again under its name (a slice's view made again over the same
    usage file) returns the same watch descriptor: it must stay watched, not be removed as
    the name's old watch."""
    path = tmp_path / "usage"
    path.write_bytes(b"x")
    ino = open_inotify(IN_CLOSE_WRITE)
    try:
        assert ino.watch("c1", path)
        assert ino.watch("c1", path)
        os.close(os.open(path, os.O_RDONLY))          # a reader's close: not watched
        _close_after_writing(path)
        assert ino.events() == [("c1", IN_CLOSE_WRITE)]
        ino.unwatch("c1")
        _close_after_writing(path)
        assert ino.events() == []
    finally:
        ino.close()


def test_a_watch_through_a_descriptor_stays_on_its_file_when_another_takes_its_path(tmp_path):
    path = tmp_path / "usage"
    path.write_bytes(b"old")
    fd = os.open(path, os.O_RDONLY)
    ino = open_inotify(IN_CLOSE_WRITE)
    try:
        assert ino.watch_fd("c1", fd)
        kept = os.open(path, os.O_RDWR)               # a process of the slice, on the old file
        (tmp_path / "new").write_bytes(b"new")
        os.replace(tmp_path / "new", path)
        _close_after_writing(path)                    # the new file: not the one watched
        assert ino.events() == []
        os.close(kept)
        assert ino.events() == [("c1", IN_CLOSE_WRITE)]
    finally:
        ino.close()
        os.close(fd)


def test_events_lost_to_a_full_queue_are_reported(tmp_path):
    """The kernel queues at most max_queued_events, then one overflow event; a reader must
    then look at everything.  (Two files in turn: an event like the queue's last is merged.)"""
    paths = [tmp_path / "a", tmp_path / "b"]
    for p in paths:
        p.write_bytes(b"x")
    with open("/proc/sys/fs/inotify/max_queued_events") as f:
        queue = int(f.read())
    ino = open_inotify(IN_CLOSE_WRITE)
    try:
        assert ino.watch("a", paths[0]) and ino.watch("b", paths[1])
        _close_after_writing(paths[0])
        assert ino.events() == [("a", IN_CLOSE_WRITE)] and not ino.overflowed
        for i in range(queue + 2):
            _close_after_writing(paths[i % 2])
        events = ino.events()
        assert ino.overflowed and len(events) <= queue
        _close_after_writing(paths[1])
        assert ino.events() == [("b", IN_CLOSE_WRITE)] and not ino.overflowed
    finally:
        ino.close()
