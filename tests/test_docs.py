"""The documentation runs: every ```console block in README.md and docs/*.md that can run
on simgpu is run, command by command, and its output compared with what the page shows.

A page's blocks run in order in one bash session (so variables, background jobs and
slices carry from one block to the next), started in the repository root with nothing of
vgpu or simgpu in its environment, in a fresh temporary directory that stands in for the
paths the pages use (/tmp/vgpu, /tmp/simgpu-node, /tmp/slices.yaml).  A block that cannot run here (Docker,
a GPU, a cluster, or a command that runs until stopped) carries the marker
`<!-- doctest: skip (why) -->` on the line before it; the number of such blocks per page
is pinned below, so skipping one more is a decision, not an accident.

Outputs are compared on their stable parts: whitespace runs count as one space (but for a
line's indentation); what is
measured or allotted by the machine is masked on both sides — durations, clock times,
numbers of three or more digits (pids, byte counts), measured shares in status tables
(the `9%` of `9%/20%`, the lone percentages of the process and device rows), and the path
of this checkout's `src/vgpu/_lib/`.  Everything else — names, sizes, caps, columns,
messages — must match.  `…` on a line of its own stands for any lines (a shortened
output), inside a line for anything; a command marked `# one line; wrapped here` is
compared word by word.  A command commented `# ... exit status N` must exit N; otherwise
one whose shown output has an `Error:` line must fail, and any other succeed.  bash's own
notices of background jobs that ended are dropped.  `status`, `list` and `reap` describe a
node that is still settling (workloads starting, a process dying), so they are retried for
up to 20 s until they match.
"""
import os
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# blocks that cannot run here, per page (see the module docstring)
SKIPPED = {"README.md": 1, "docs/autoscale.md": 1, "docs/containers.md": 4}
# the paths the pages use, played by a temporary directory
STAND_INS = ("/tmp/vgpu", "/tmp/simgpu-node", "/tmp/slices.yaml")
RETRIED = re.compile(r"vgpu-ctl (status|list|reap)\b")
SKIP_MARK = re.compile(r"<!-- doctest: skip \((.+)\) -->")
# pages another change adds: links to them are checked once they exist
PENDING = {"docs/kubernetes-versions.md"}


# === reading the pages ===

class Block:
    def __init__(self, page, line, skip, body):
        self.page, self.line, self.skip = page, line, skip
        self.commands = []          # [(command, [expected lines])]
        for text in body:
            if text.startswith("$ "):
                self.commands.append((text[2:], []))
            elif self.commands and self.commands[-1][0].endswith("\\"):
                cmd, exp = self.commands[-1]
                self.commands[-1] = (cmd + "\n" + text, exp)
            elif self.commands:
                self.commands[-1][1].append(text)
            else:
                raise AssertionError(f"{page}:{line}: output before any command in a console block")


def blocks(page: Path):
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```console":
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = SKIP_MARK.fullmatch(before.strip())
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            out.append(Block(page, i + 1, m.group(1) if m else None, lines[i + 1:end]))
            i = end
        i += 1
    return out


def rel(page):
    return str(page.relative_to(ROOT))


# === comparing ===

_LIB = re.compile(r"\S*/src/vgpu/_lib/")
_DURATION = re.compile(r"(?<![\w.])\d+(\.\d+)?(us|ms|s)(/s)?(?![\w%])|(?<![\w.])\d+m\d\ds\b")
_CLOCK = re.compile(r"\b\d\d:\d\d:\d\d\b")
_BIG = re.compile(r"(?<![\w.])\d{3,}(?![\w%.])")
_MEASURED = re.compile(r"(?<![\w(.])\d+(\.\d+)?%(?=/)")
_LONE_PERCENT = re.compile(r"(?<=\s)\d+(\.\d+)?%(?=\s|$)")


def normalize(lines):
    out, in_status = [], False
    for line in lines:
        if "GPU-UTIL" in line:
            in_status = True
        elif not line.strip():
            in_status = False
        elif in_status:
            line = _LONE_PERCENT.sub("<%>", _MEASURED.sub("<%>", line))
        line = _BIG.sub("<n>", _CLOCK.sub("<clock>", _DURATION.sub("<t>", _LIB.sub("<lib>/", line))))
        out.append(line[:len(line) - len(line.lstrip())] + " ".join(line.split()))   # indentation counts
    while out and not out[-1]:
        out.pop()
    return out


def _line_matches(pattern, line):
    if "…" not in pattern:
        return pattern == line
    return re.fullmatch(".*".join(re.escape(p) for p in pattern.split("…")), line) is not None


def matches(expected, actual):
    """expected: normalized lines, `…` alone = any lines."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head == "…":
        return any(matches(rest, actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and _line_matches(head, actual[0]) and matches(rest, actual[1:])


def compare(command, expected, actual):
    if re.search(r"#\s*one line; wrapped here", command):
        return " ".join(expected).split() == " ".join(actual).split()
    return matches(normalize(expected), normalize(actual))


# === the session ===

# bash's notice that a background job ended (`kill -9 $!`): the shell's, not the command's
_JOB_NOTICE = re.compile(r"bash: line \d+: +\d+ (Killed|Terminated|Done|Exit \d+) ")


class Session:
    """One bash, driven command by command through a pipe."""

    def __init__(self, tmp):
        self.tmp = tmp
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("VGPU_", "SIMGPU_", "CUDA_DEVICE_", "_VGPU_CTL")) and
               k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "VIRTUAL_ENV")}
        env.update(PYTHONUNBUFFERED="1", HOME=str(tmp / "home"), TERM="dumb")
        (tmp / "home").mkdir()
        # the shell's own stderr (outside the commands) goes to a log
        self.log = open(tmp / "shell.log", "w")
        self.proc = subprocess.Popen(["bash", "--norc", "--noprofile"], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, start_new_session=True)
        self.n = 0
        self.buffer = b""

    def to_real(self, text):
        for path in STAND_INS:
            text = text.replace(path, str(self.tmp / Path(path).name))
        return text

    def to_doc(self, text):
        for path in STAND_INS:
            text = text.replace(str(self.tmp / Path(path).name), path)
        return text

    def run(self, command, timeout=120):
        self.n += 1
        background = command.rstrip().endswith("&")
        body = self.to_real(command)
        script = (f"printf '\\n@@begin {self.n}\\n'\n{{ {body}\n}} </dev/null 2>&1\n"
                  f"printf '\\n@@end {self.n} %d\\n' $?\n")
        self.proc.stdin.write(script.encode())
        self.proc.stdin.flush()
        begin, end = f"\n@@begin {self.n}\n".encode(), re.compile(rb"\n@@end %d (\d+)\n" % self.n)
        deadline = time.monotonic() + timeout
        while not (begin in self.buffer and end.search(self.buffer, self.buffer.index(begin))):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise AssertionError(f"`{command}` did not finish within {timeout} s")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"the shell ended during `{command}`")
            self.buffer += chunk
        start = self.buffer.index(begin) + len(begin)
        m = end.search(self.buffer, start)
        output, self.buffer = self.buffer[start:m.start()], self.buffer[m.end():]
        lines = [line for line in self.to_doc(output.decode(errors="replace")).split("\n")
                 if not _JOB_NOTICE.match(line)]
        return (0 if background else int(m.group(1))), lines

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_console_block_runs_and_shows_what_it_prints(page, tmp_path):
    found = blocks(page)
    skipped = [b for b in found if b.skip]
    assert len(skipped) == SKIPPED.get(rel(page), 0), \
        f"{rel(page)}: skipped blocks at lines {[b.line for b in skipped]}; pin their number in SKIPPED"
    runnable = [b for b in found if not b.skip]
    if not runnable:
        return          # nothing to run: the count of marked blocks above is the check
    session = Session(tmp_path)
    try:
        for block in runnable:
            assert block.commands, f"{rel(page)}:{block.line}: a console block without a command"
            for command, expected in block.commands:
                deadline = time.monotonic() + (20 if RETRIED.match(command) else 0)
                while True:
                    rc, actual = session.run(command)
                    ok = compare(command, expected, actual)
                    if ok or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                where = f"{rel(page)}:{block.line}: `{command}`"
                assert ok, (f"{where} printed:\n" + "\n".join(actual) + "\n-- the page shows:\n" +
                            "\n".join(expected) + "\n-- compared as:\n" + "\n".join(normalize(actual)) +
                            "\n-- against:\n" + "\n".join(normalize(expected)))
                said = re.search(r"#.*\bexit status (\d+)", command)
                if said:
                    assert rc == int(said.group(1)), f"{where} exited {rc}"
                else:
                    fails = any(line.startswith("Error:") for line in expected)
                    assert (rc != 0) == fails, f"{where} exited {rc}" + (" (the page shows an error)" if fails else "")
        if rel(page) == "README.md":   # the walk-through ends where it began: a second one starts clean
            _, left = session.run("vgpu-ctl list")
            assert [line for line in left if line.strip()] == ["no slices in /tmp/vgpu"], left
    finally:
        session.close()


def test_the_comparison_masks_only_what_the_machine_decides():
    shown = ["infer   0   3Gi/4Gi (75%)   9%/20%   0s   0   1   2",
             "infer   25455  25455   3Gi   9%   python examples/serve.py 3Gi"]
    run = ["infer 0 3Gi/4Gi (75%) 12%/20% 1.4s 0 1 2",
           "infer 31337 31337 3Gi 11% python examples/serve.py 3Gi"]
    header = ["SLICE  DEVICE  GPU-MEMORY  GPU-UTIL"]
    assert compare("vgpu-ctl status", header + shown, header + run)
    for changed in (("3Gi/4Gi", "2Gi/4Gi"), ("(75%)", "(50%)"), ("/20%", "/25%"), (" 0 1 2", " 1 1 2"),
                    ("serve.py", "train.py")):
        assert not compare("vgpu-ctl status", header + shown, header + [run[0].replace(*changed), run[1]]) or \
            not compare("vgpu-ctl status", header + shown, header + [run[0], run[1].replace(*changed)])
    assert not compare("vgpu-ctl status", shown, run)                 # outside a status table: shares count
    assert compare("x", ["a", "…", "z"], ["a", "b", "c", "z"]) and not compare("x", ["a", "z"], ["a", "b", "z"])
    assert compare("x # one line; wrapped here", ["a b", "c"], ["a b c"])


# === links ===

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if rel(dest) in PENDING and not dest.exists():
            continue
        assert dest.exists(), f"{rel(page)} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{rel(page)} links to {target}: no such heading"


def test_the_readme_links_every_page_of_docs_once():
    text = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        links = [t for t in _LINK.findall(text) if t.partition("#")[0] == f"docs/{page.name}"]
        if page.name in {Path(p).name for p in PENDING}:
            continue     # linked from docs/kubernetes.md
        assert len(links) == 1, f"README links docs/{page.name} {len(links)} times"


def test_every_test_the_support_matrix_names_exists():
    # docs/kubernetes-versions.md names the test behind each row; "…" shortens a name
    text = (ROOT / "docs/kubernetes-versions.md").read_text()
    named = re.findall(r"`(test_[A-Za-z0-9_]+)(…)?(?:\[[^`]*\])?`", text)
    assert len(named) >= 8, named
    defined = set(re.findall(r"^def (test_\w+)", "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py")),
                             re.M))
    for name, shortened in named:
        assert any(d == name or (shortened and d.startswith(name)) for d in defined), f"no test {name}"


def test_the_kubernetes_walkthrough_names_what_the_manifests_have():
    import yaml
    text = (ROOT / "docs/kubernetes.md").read_text()
    docs = [d for f in (ROOT / "deploy/dra").glob("*.yaml") for d in yaml.safe_load_all(f.read_text()) if d]
    [plugin] = [d for d in docs if d["kind"] == "DaemonSet"]
    containers = {c["name"] for c in plugin["spec"]["template"]["spec"]["containers"]}
    named = set(re.findall(r"ds/vgpu-dra-plugin -c (\w+)|<plugin pod> -c (\w+)", text))
    assert named and {n for pair in named for n in pair if n} <= containers, (named, containers)
    assert f"ds/{plugin['metadata']['name']}" in text
    webhook = next(d for d in docs if d["kind"] == "Deployment")
    assert f"deploy/{webhook['metadata']['name']}" in text
    for path in set(re.findall(r"deploy/[\w./-]+\.yaml", text)):
        assert (ROOT / path).is_file(), path
    pods = {d["metadata"]["name"] for d in docs if d["kind"] == "Pod"}
    assert {"cuda-4gi", "cuda-half-gpu"} <= pods


def test_every_metric_the_code_serves_is_named_in_the_docs():
    code = (ROOT / "src/vgpu/metrics.py").read_text()
    served = set(re.findall(r'"(vgpu_[a-z0-9_]*[a-z0-9])"', code))
    for block in re.finditer(r'f"(vgpu_(?:device_)?)\{name\}".*?\n\s*\)\}', code, re.S):   # names built in a loop
        served |= {block.group(1) + n for n in re.findall(r'\("([a-z0-9_]+)",', block.group(0))}
    assert len(served) > 30, served
    pages = (ROOT / "docs/autoscale.md").read_text() + (ROOT / "docs/node-agent.md").read_text()
    missing = sorted(m for m in served if m.removesuffix("_total") not in pages)
    assert not missing, f"served but documented nowhere: {missing}"
