"""What README.md and docs/*.md point at exists, checked in-process: every
relative link and #anchor resolves (GitHub's anchor rules), upstream's
example is linked at the release compared, README's Options table is the
example's --help, docs/testing.md's map names every test file, and every
module of gbrun/ has its own test file or is in the map's table of
modules. (The docs' blocks run as written: test_docs.py.)"""
import glob
import os
import re

import pytest

from helpers import DOCS, FENCE, REPO


def github_anchor(heading):
    """The anchor GitHub gives a heading: lower-case, punctuation dropped,
    spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    found, in_code, counts = set(), False, {}
    for line in open(path).read().splitlines():
        if FENCE.match(line) or line.strip() == "```":
            in_code = not in_code
            continue
        heading = re.match(r"^#{1,6} (.*)$", line)
        if heading and not in_code:
            anchor = github_anchor(heading.group(1))
            count = counts.get(anchor, 0)
            counts[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in DOCS:
        path = os.path.join(REPO, doc)
        text = re.sub(r"```.*?```", "", open(path).read(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (
                os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                if file_part else path
            )
            if not os.path.exists(linked):
                broken.append(f"{doc}: {target} (no such file)")
            elif anchor and (not os.path.isfile(linked)
                             or anchor not in anchors(linked)):
                broken.append(f"{doc}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_upstream_is_linked_at_the_release_compared():
    # docs/upstream.md compares with upstream's example at v2.1.0; its
    # GPU cache code differs on master.
    for doc in DOCS:
        for url in re.findall(r"https://github\.com/dmlc/dgl/blob/([^/]+)/"
                              r"examples/multigpu/graphbolt/node_classification\.py",
                              open(os.path.join(REPO, doc)).read()):
            assert url == "v2.1.0", f"{doc} links upstream's example at {url}"


def test_the_readmes_options_table_is_the_examples_help(capsys):
    # README's Options table names each option of node_classification.py's
    # --help (a --no-X form with its --X), and nothing else.
    import node_classification as nc

    with pytest.raises(SystemExit) as exited:
        nc.parse_args(["--help"])
    assert exited.value.code == 0
    shown = set(re.findall(r"^  (--[\w-]+)", capsys.readouterr().out, re.M))
    shown -= {"--help"}
    readme = open(os.path.join(REPO, "README.md")).read()
    table = readme.split("\n## Options\n")[1].strip().split("\n\n")[0]
    documented = set(re.findall(r"^\| `(--[\w-]+)`", table, re.M))
    assert documented == shown, (documented ^ shown)


def test_the_tests_map_sends_every_promise_to_a_file_that_exists():
    # docs/testing.md's map names every test file (by its path under
    # tests/), and only those.
    text = open(os.path.join(REPO, "docs", "testing.md")).read()
    table = text.split("## Where each promise is checked")[1].split("\n\n")[2]
    named = re.findall(r"`((?:\w+/)*test_\w+\.py)`", table)
    tests = os.path.join(REPO, "tests")
    files = sorted(os.path.relpath(path, tests) for path in glob.glob(
        os.path.join(tests, "**", "test_*.py"), recursive=True))
    assert sorted(set(named)) == files


def test_every_module_has_its_test_file_or_is_in_the_map():
    # A module of gbrun/ has tests/unit/<its folder>/test_<its name>.py, or
    # docs/testing.md's table of modules names it with files that exist.
    text = open(os.path.join(REPO, "docs", "testing.md")).read()
    section = text.split("## Where each promise is checked")[1]
    table = section.split("| module | tested in |")[1].split("\n\n")[0]
    mapped = {}
    for row in table.splitlines()[2:]:
        module, files = row.split(" | ", 1)
        mapped[module.strip("| `")] = re.findall(
            r"`((?:unit|e2e)/(?:\w+/)*test_\w+\.py)`", files)
    tests = os.path.join(REPO, "tests")
    package = os.path.join(REPO, "gbrun")
    untested = []
    for path in sorted(glob.glob(os.path.join(package, "**", "*.py"),
                                 recursive=True)):
        module = os.path.relpath(path, package)
        folder, name = os.path.split(module)
        if name == "__init__.py":
            continue
        own = os.path.join(tests, "unit", folder, f"test_{name}")
        named = mapped.pop(module, [])
        if not os.path.exists(own) and not named:
            untested.append(module)
        for file in named:
            assert os.path.exists(os.path.join(tests, file)), (module, file)
    assert untested == [], f"modules neither mirrored nor in the map: {untested}"
    assert mapped == {}, f"the map names modules gbrun does not have: {mapped}"
