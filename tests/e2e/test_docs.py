"""The documentation, run as a user would run it.

Every ```bash and ```python block of README.md and docs/*.md (README first,
then docs/ in name order) runs in turn in one fresh directory: a copy of the
repository's git-tracked files, without data/ or runs/, with `.venv` linking
to the environment running these tests, so `.venv/bin/python` and
`.venv/bin/torchrun` work as the docs write them. The blocks of all files
share that directory, like a user following along: docs/running.md trains on
the builtin synthetic dataset, as the README's quick start does. Each block is one
test (`docs/running.md:12`); selecting a later one runs the blocks before it
first.

What runs, and what is compared:
- Install lines (`python3 -m venv .venv`, `pip install ...`) are not run:
  these tests already run in that environment. The test suite's own command
  (`python -m pytest ...`) is not run either: it is the suite.
- A block with an HTML comment `<!-- docs-test: skip, REASON -->` right
  before it is skipped with that reason (see `pytest -rs`). The reasons
  allowed are SKIP_REASONS: a GPU, a dataset download, benchmarks of many
  minutes, machines other than this one. Anything unmarked runs.
- A ```python block whose first line is a comment naming a file
  (`# my_arrays.py: ...`) is saved under that name, for a later command to
  run; any other ```python block runs with `.venv/bin/python -`.
- A bash block runs with `bash -e -o pipefail`; commands it starts in the
  background (`... &`) are waited for, and a failed one fails the block.
  Commands run with `sudo` need root, iproute2 and util-linux, as
  tests/e2e/test_distributed_trainer.py does: skipped without them, failed under
  CI=true. As root, `sudo` runs the command with this environment.
- Expected output: comment lines in a bash block that show what a command
  prints (OUTPUT_COMMENT: `# wrote ...`, `# Test Accuracy ...`), and a block
  without a language right after a command block (the README's quick-start
  sample), whose `...` lines stand for any number of lines. Each shown line
  must be printed (on stdout, in that order; lines of a sample between two
  `...` consecutively) with the same text and field names in the same
  order. Numbers must be equal, except times and rates, which are not
  compared, and accuracies and losses, which may differ by the tolerance
  of a `<!-- docs-test: accuracy ±0.02, loss ±0.05 -->` marker before the
  block or its sample; the prose of that section must state the same
  figures to the reader.
- Every process runs with the GPUs hidden (the samples are those of a
  machine without one) and with a deadline; its whole session is killed at
  the deadline and after each block.

Also checked, in-process: the markers are well formed, the tolerances are
stated in the prose, and the runner's own comparisons and deadlines. (What
the docs point at, links, anchors, upstream's release, the options table and
the tests map: test_doc_references.py.)
"""
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from helpers import DOCS, FENCE, REPO, gone, kill_session, missing_prerequisite

BLOCK_TIMEOUT_S = 300

SKIP_REASONS = ("needs a GPU", "downloads ", "benchmarks ", "needs several machines")
# Comment lines that show what a command printed, not what it does.
OUTPUT_COMMENT = re.compile(r"^# ((?:wrote |Test Accuracy |Epoch \d|Training with |"
                            r"Resuming from |test accuracy ).*)$")
MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->$")
NOT_RUN = re.compile(
    r"^(python3? -m venv |(\S*/)?pip3? install |(\S*/)?python3? -m pytest |pytest )"
)
TEST_SUITE = re.compile(r"^((\S*/)?python3? -m pytest |pytest )")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
# Fields whose figures depend on the machine: never compared.
UNCOMPARED = re.compile(r"(Time|Seeds/s|Data Wait)\s*$")
SAVED_AS = re.compile(r"^#\s*([\w.-]+\.py)\b")


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    markers: list
    section: str  # the prose of its section (headings to headings)
    sample: "Block" = None  # the output block that follows it
    index: int = 0

    @property
    def id(self):
        return f"{self.doc}:{self.line}"

    def directives(self):
        """The marker directives of the block and of its output sample."""
        found = list(self.markers)
        if self.sample is not None:
            found += self.sample.markers
        return found

    def skip_reason(self):
        for directive in self.directives():
            if directive.startswith("skip,"):
                return directive.split(",", 1)[1].strip()
        return None

    def tolerances(self):
        found = {}
        for directive in self.directives():
            for name, value in re.findall(r"(\w+) ±(\d+(?:\.\d+)?)", directive):
                found[name] = float(value)
        return found


def parse(doc):
    """The fenced blocks of one markdown file, with their markers."""
    lines = open(os.path.join(REPO, doc)).read().splitlines()
    blocks, markers, in_block = [], [], None
    prose, sections = [], []
    for number, line in enumerate(lines, 1):
        if in_block is not None:
            if line.strip() == "```":
                in_block.text = "\n".join(in_block.text)
                blocks.append(in_block)
                in_block = None
            else:
                in_block.text.append(line)
            continue
        fence = FENCE.match(line)
        if fence:
            in_block = Block(doc, number, fence.group(1), [], markers,
                             section=len(sections))
            markers = []
            continue
        marker = MARKER.match(line.strip())
        if marker:
            markers.append(marker.group(1))
            continue
        if line.startswith("#"):
            sections.append("\n".join(prose))
            prose = []
        if line.strip():
            assert not markers, (
                f"{doc}:{number}: a docs-test marker must come right before "
                f"a fenced block: {markers}"
            )
            prose.append(line)
    sections.append("\n".join(prose))
    assert in_block is None, f"{doc}: unclosed block at line {in_block.line}"
    for block in blocks:
        block.section = sections[block.section]
    # A block without a language right after a command block is its output.
    for before, after in zip(blocks, blocks[1:]):
        if after.lang == "" and before.lang in ("bash", "python"):
            before.sample = after
    return blocks


def all_blocks():
    """The blocks that run or are skipped, in order: install lines and the
    test suite's command alone make no test."""
    blocks = [block for doc in DOCS for block in parse(doc)]
    runnable = [
        b for b in blocks
        if b.lang == "python"
        or b.lang == "bash" and (bash_script(b)[0] is not None or b.skip_reason())
    ]
    for index, block in enumerate(runnable):
        block.index = index
    return runnable


def logical_lines(text):
    """Physical lines grouped into commands (backslash continuations)."""
    group = []
    for line in text.splitlines():
        group.append(line)
        if not line.endswith("\\"):
            yield group
            group = []
    if group:
        yield group


def after_installs(command):
    """A command line without its leading install steps: the README's
    `python3 -m venv .venv && .venv/bin/pip install ... && CMD` runs CMD
    (these tests run in that environment already, which `.venv` links to:
    making it again there would rewrite the suite's own). "" where nothing
    else is left."""
    parts = command.split(" && ")
    while parts and NOT_RUN.match(parts[0].strip()) and not TEST_SUITE.match(parts[0].strip()):
        parts.pop(0)
    return " && ".join(parts)


def readme_lines(pattern):
    """The README's command lines that match `pattern`."""
    text = open(os.path.join(REPO, "README.md")).read()
    return [line for line in text.splitlines() if re.search(pattern, line)]


def test_ci_runs_the_readme_test_line_as_written():
    """The README's one-line install-and-test command is .ci/run's, word
    for word; its train line is one line too (run as written below, after
    its install steps)."""
    test_line, = readme_lines(r"-m pytest -q tests$")
    assert test_line.startswith("python3 -m venv .venv && "), test_line
    ci_lines = open(os.path.join(REPO, ".ci", "run")).read().splitlines()
    assert test_line in ci_lines, f".ci/run does not run the README's {test_line!r}"
    train_line, = readme_lines(r"^python3 -m venv .venv && .* node_classification.py ")
    assert after_installs(train_line).startswith(".venv/bin/python node_classification.py ")


def bash_script(block):
    """(script to run, whether it needs root) of a bash block."""
    kept, needs_root = [], False
    for group in logical_lines(block.text):
        command = group[0].strip()
        if len(group) == 1:
            group = [after_installs(command)]
            command = group[0]
        if not command or NOT_RUN.match(command):
            continue
        if command.startswith("sudo "):
            needs_root = True
        if group[-1].rstrip().endswith("&") and not group[-1].rstrip().endswith("&&"):
            group = group[:-1] + [group[-1] + " __docs_bg+=($!)"]
        kept += group
    if not any(line.strip() and not line.strip().startswith("#") for line in kept):
        return None, needs_root
    script = "\n".join(
        ["__docs_bg=()", *kept,
         'for __pid in "${__docs_bg[@]}"; do wait "$__pid"; done']
    )
    return script, needs_root


def expected_output(block):
    """Segments of lines the block must print: each output comment alone,
    and the sample's runs of lines between `...` lines."""
    segments = []
    if block.lang == "bash":
        for line in block.text.splitlines():
            comment = OUTPUT_COMMENT.match(line.strip())
            if comment:
                segments.append([comment.group(1)])
    if block.sample is not None:
        segment = []
        for line in block.sample.text.splitlines():
            if line.strip() == "...":
                if segment:
                    segments.append(segment)
                segment = []
            else:
                segment.append(line.rstrip())
        if segment:
            segments.append(segment)
    return segments


def line_differs(expected, actual, tolerances):
    """None if `actual` is `expected` up to its numbers' tolerances, else why
    not. Text (field names, order) must be equal."""
    texts = NUMBER.split(expected)
    numbers = NUMBER.findall(expected)
    pattern = r"(\d+(?:\.\d+)?)".join(re.escape(text) for text in texts)
    found = re.fullmatch(pattern, actual)
    if not found:
        return "different text"
    for label, want, got in zip(texts, numbers, found.groups()):
        name = label.strip(" |:") or "number"
        if UNCOMPARED.search(label):
            continue
        kind = next((k for k in ("accuracy", "loss")
                     if re.search(k + r"\s*$", label, re.IGNORECASE)), None)
        if kind in tolerances:
            if abs(float(want) - float(got)) > tolerances[kind] + 1e-9:
                return f"{name} {got}, not within {tolerances[kind]} of {want}"
        elif want != got:
            return f"{name} {got} instead of {want}"
    return None


def output_mismatch(segments, stdout, tolerances):
    """None if stdout shows every segment in order, else a message."""
    actual = [line.rstrip() for line in stdout.splitlines()]
    cursor = 0
    for segment in segments:
        start = cursor
        while start + len(segment) <= len(actual):
            if all(line_differs(want, got, tolerances) is None
                   for want, got in zip(segment, actual[start:])):
                break
            start += 1
        else:
            close = [
                f"  {got!r}: {line_differs(segment[0], got, tolerances)}"
                for got in actual[cursor:]
                if line_differs(segment[0], got, tolerances) != "different text"
            ]
            return (
                "the docs show\n  " + "\n  ".join(segment)
                + f"\nbut it was not printed (after line {cursor}). "
                + ("Lines like it:\n" + "\n".join(close) if close else "")
            )
        cursor = start + len(segment)
    return None


@dataclass
class DocRun:
    """The fresh directory and the blocks run in it so far, in order."""

    home: str
    env: dict
    blocks: list
    results: dict = field(default_factory=dict)

    def run_through(self, block):
        for earlier in self.blocks[: block.index + 1]:
            if earlier.index not in self.results:
                self.results[earlier.index] = self.run(earlier)
        return self.results[block.index]

    def run(self, block):
        """(status, stdout, stderr, seconds), or ("skip", reason)."""
        reason = block.skip_reason()
        if reason is not None:
            return ("skip", reason)
        if block.lang == "python":
            saved = SAVED_AS.match(block.text.splitlines()[0])
            if saved:
                with open(os.path.join(self.home, saved.group(1)), "w") as f:
                    f.write(block.text + "\n")
                return (0, "", "", 0.0)
            return self.execute(
                block, [os.path.join(self.home, ".venv", "bin", "python"), "-"],
                block.text,
            )
        script, needs_root = bash_script(block)
        if script is None:
            return ("skip", "nothing to run (installs or the test suite)")
        if needs_root:
            reason = missing_prerequisite()
            if reason is not None:
                if os.environ.get("CI") == "true":
                    return (f"CI=true but {reason}", "", "", 0.0)
                return ("skip", reason)
        return self.execute(block, ["bash", "-e", "-o", "pipefail", "-c", script])

    def execute(self, block, command, stdin=None):
        start = time.monotonic()
        process = subprocess.Popen(
            command, cwd=self.home, env=self.env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )
        try:
            out, err = process.communicate(stdin, timeout=BLOCK_TIMEOUT_S)
            status = process.returncode
        except subprocess.TimeoutExpired:
            kill_session(process)
            out, err = process.communicate()
            status = f"did not finish within {BLOCK_TIMEOUT_S} s"
        finally:
            # Nothing a block started outlives it.
            kill_session(process)
        # Kept beside the directory, to read after a failure.
        log = os.path.join(os.path.dirname(self.home), "logs",
                           f"{block.index:02d}-{block.id.replace('/', '-')}")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        for suffix, text in ((".out", out), (".err", err)):
            with open(log + suffix, "w") as f:
                f.write(text)
        return (status, out, err, time.monotonic() - start)


def fresh_copy(destination):
    """The repository's tracked files (as they are in the work tree)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for path in filter(None, listed):
        source = os.path.join(REPO, path)
        if os.path.isfile(source):
            target = os.path.join(destination, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)
    os.symlink(sys.prefix, os.path.join(destination, ".venv"))


@pytest.fixture(scope="session")
def docrun(tmp_path_factory):
    home = str(tmp_path_factory.mktemp("docs") / "project")
    os.makedirs(home)
    fresh_copy(home)
    env = {**os.environ, "PYTHONPATH": home, "CUDA_VISIBLE_DEVICES": ""}
    if os.geteuid() == 0:
        # As root, `sudo CMD` is CMD; real sudo would also drop PYTHONPATH.
        shims = str(tmp_path_factory.mktemp("shims"))
        with open(os.path.join(shims, "sudo"), "w") as f:
            f.write('#!/bin/sh\nexec "$@"\n')
        os.chmod(os.path.join(shims, "sudo"), 0o755)
        env["PATH"] = shims + os.pathsep + env.get("PATH", "")
    return DocRun(home, env, all_blocks())


BLOCKS = all_blocks()


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(docrun, block):
    result = docrun.run_through(docrun.blocks[block.index])
    if result[0] == "skip":
        pytest.skip(result[1])
    status, out, err, seconds = result
    failed_before = [
        docrun.blocks[i].id for i, r in docrun.results.items()
        if i < block.index and r[0] not in ("skip", 0)
    ]
    context = (
        f"\n--- stdout (last 3000 characters)\n{out[-3000:]}"
        f"\n--- stderr (last 3000 characters)\n{err[-3000:]}"
        + (f"\nblocks before it that failed: {failed_before}" if failed_before else "")
    )
    assert status == 0, f"{block.id}: exit status {status} after {seconds:.0f} s{context}"
    # Following the docs never changes a dataset: GraphBolt preprocessing one
    # again means a command spelled its path differently (gbrun.data.datasets.load_dataset).
    assert "re-preprocessing" not in out + err, (
        f"{block.id}: GraphBolt preprocessed a dataset again (its path spelled "
        f"another way than before?){context}"
    )
    mismatch = output_mismatch(expected_output(block), out, block.tolerances())
    assert mismatch is None, f"{block.id}: {mismatch}{context}"


# ------------------------------------------------------- checks in-process


def test_markers_are_well_formed():
    for block in BLOCKS:
        reason = block.skip_reason()
        if reason is not None:
            assert reason.startswith(SKIP_REASONS), (
                f"{block.id}: skip reason {reason!r} is not one of "
                f"{SKIP_REASONS}: make the block run instead"
            )
        for directive in block.directives():
            assert directive.startswith("skip,") or re.fullmatch(
                r"(\w+ ±\d+(\.\d+)?)(, \w+ ±\d+(\.\d+)?)*", directive
            ), f"{block.id}: unknown docs-test marker {directive!r}"
            for name, _ in re.findall(r"(\w+) ±(\S+)", directive):
                assert name in ("accuracy", "loss"), (block.id, name)


def test_tolerances_are_stated_in_the_prose():
    for block in BLOCKS:
        for name, value in block.tolerances().items():
            text = f"{value:g}"
            stated = re.search(rf"(?<![\d.]){re.escape(text)}(?!\d)", block.section)
            if not stated:
                pytest.fail(f"{block.id}: its marker allows {name} ±{text}, but "
                            f"the prose of its section does not tell the reader {text}")


def test_output_samples_show_output_of_a_command():
    for doc in DOCS:
        blocks = parse(doc)
        for before, block in zip([None] + blocks, blocks):
            if block.lang == "" and block.text.strip():
                assert before is not None and before.lang in ("bash", "python"), (
                    f"{block.id}: a block without a language shows the output "
                    "of the command block before it; use ```text otherwise"
                )


def test_the_comparison_of_shown_and_printed_lines():
    shown = "Epoch 00009 | Average Loss 0.6850 | Accuracy 0.9122 | Time 1.2650"
    tolerance = {"accuracy": 0.02, "loss": 0.05}
    same = line_differs(shown, "Epoch 00009 | Average Loss 0.7100 | "
                        "Accuracy 0.9000 | Time 9.9999", tolerance)
    assert same is None
    for printed, why in [
        ("Epoch 00009 | Average Loss 0.6850 | Accuracy 0.8900 | Time 1.0",
         "Accuracy 0.8900, not within 0.02 of 0.9122"),
        ("Epoch 00009 | Average Loss 0.7400 | Accuracy 0.9122 | Time 1.0",
         "Average Loss 0.7400, not within 0.05 of 0.6850"),
        ("Epoch 00008 | Average Loss 0.6850 | Accuracy 0.9122 | Time 1.0",
         "Epoch 00008 instead of 00009"),
        ("Epoch 00009 | Loss 0.6850 | Accuracy 0.9122 | Time 1.0", "different text"),
        ("Epoch 00009 | Accuracy 0.9122 | Average Loss 0.6850 | Time 1.0",
         "different text"),
        (shown + " | Seeds/s 1.0", "different text"),
    ]:
        assert line_differs(shown, printed, tolerance) == why, printed
    # Without a tolerance, figures other than times are compared exactly.
    assert line_differs("Test Accuracy 0.9050", "Test Accuracy 0.9051", {})

    printed = "a\nb\nc\nd\n"
    assert output_mismatch([["a", "b"], ["d"]], printed, {}) is None
    assert output_mismatch([["b", "a"]], printed, {})  # order
    assert output_mismatch([["a", "c"]], printed, {})  # consecutive within `...`
    assert output_mismatch([["c"], ["b"]], printed, {})  # segments in order


def test_background_commands_are_waited_for_and_killed_at_the_deadline(
        tmp_path, monkeypatch):
    def run(text):
        block = Block("x.md", 1, "bash", text, [], "")
        return DocRun(str(tmp_path), dict(os.environ), [block]).run(block)

    assert run("true &\ntrue")[0] == 0
    # A command started with & that fails fails the block, also when the
    # block's last command succeeds.
    assert run("(sleep 0.2; exit 3) &\ntrue")[0] == 3
    # At the deadline the whole session goes, background commands included.
    monkeypatch.setattr(sys.modules[__name__], "BLOCK_TIMEOUT_S", 1)
    status, out, _, seconds = run("sleep 60 &\necho $! > pid\nsleep 60")
    assert status == "did not finish within 1 s" and seconds < 10
    pid = int((tmp_path / "pid").read_text())
    assert not alive(pid), f"background process {pid} outlived its block"


def alive(pid, wait=5):
    """True if `pid` still runs after `wait` seconds."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if gone(pid):
            return False
        time.sleep(0.05)
    return True


def test_commands_are_in_blocks_that_run():
    # A command in a ```sh or ```console block would escape these tests.
    for doc in DOCS:
        for block in parse(doc):
            assert block.lang in ("bash", "python", "", "text", "diff", "yaml",
                                  "json"), (
                f"{block.id}: ```{block.lang} blocks are not run by "
                "tests/e2e/test_docs.py; use ```bash, ```python, or ```text for "
                "text that is not a command"
            )
