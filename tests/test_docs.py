"""The docs cannot drift from the code.

* Every block of `docs/**.md` headed `# agentrl/<file>.py · <function>` quotes
  lines that exist (whitespace-stripped) inside that function.
* Every other python block of `docs/credit/*.md` and `docs/rewards.md` runs.
"""

import ast
import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted([*(ROOT / "docs" / "credit").glob("*.md"), ROOT / "docs" / "rewards.md"])
QUOTE_HEADER = re.compile(r"# (agentrl/\S+\.py) · (\w+)")


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def _quotes():
    for path in DOCS:
        for block in python_blocks(path):
            lines = block.splitlines()
            match = QUOTE_HEADER.match(lines[0]) if lines else None
            if match:
                yield pytest.param(path, *match.groups(), lines[1:],
                                   id=f"{path.name}:{match.group(2)}")


def _snippets():
    for path in DOCS:
        snippets = [b for b in python_blocks(path) if not QUOTE_HEADER.match(b)]
        for index, block in enumerate(snippets):
            yield pytest.param(block, id=f"{path.name}:{index}")


def test_every_scheme_page_exists():
    for name in ["grpo", "mt_grpo", "gae", "mt_ppo", "checklist", "tree", "segment", "vspo"]:
        assert (ROOT / "docs" / "credit" / f"{name}.md").is_file(), name
    assert (ROOT / "docs" / "adding_a_credit_scheme.md").is_file()
    assert (ROOT / "docs" / "benchmarks.md").is_file()


@pytest.mark.parametrize("path,source,function,quoted", list(_quotes()))
def test_quoted_code_exists_in_the_named_function(path, source, function, quoted):
    text = (ROOT / source).read_text(encoding="utf-8")
    nodes = [n for n in ast.walk(ast.parse(text))
             if isinstance(n, ast.FunctionDef) and n.name == function]
    assert nodes, f"{path.name} quotes {source} · {function}, which does not exist"
    body = {line.strip() for line in
            text.splitlines()[nodes[0].lineno - 1 : nodes[0].end_lineno]}
    missing = [line.strip() for line in quoted
               if line.strip() and not line.strip().startswith("# …")
               and line.strip() not in body]
    assert not missing, f"{path.name}: lines not in {source} · {function}: {missing}"


@pytest.mark.parametrize("block", list(_snippets()))
def test_usage_snippet_runs(block):
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block, "<doc snippet>", "exec"), {})
