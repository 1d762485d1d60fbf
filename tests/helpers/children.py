"""Long-running children that answer JSON lines: the workloads of the end-to-end tests."""
import json
import select

from tests.helpers.simnode import start_python


class JsonChild:
    """A long-running python child that answers each JSON command line on its stdin with
    one JSON line on its stdout (the workloads of the end-to-end tests)."""

    def __init__(self, code, env, what="child"):
        self.what = what
        self.proc = start_python(code, env)

    def read(self, timeout=30):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"{self.what} said nothing: {self.proc.stderr.read()}")
        return json.loads(line)

    def send(self, cmd, arg=0):
        self.proc.stdin.write(json.dumps([cmd, arg]) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd, arg=0, timeout=30):
        self.send(cmd, arg)
        return self.read(timeout)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
