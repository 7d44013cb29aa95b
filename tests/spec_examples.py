"""Loader for the worked examples of SPEC §11 (`spec_examples.json`).

The normative file lives in the shared folder next to the checkout
(`../shared/spec_examples.json`); a verbatim copy is vendored in
`tests/data/` so a clone tested on a machine without the shared folder still
checks every entry. `tests/test_spec_examples_file.py` asserts the copy equals
the shared file whenever the shared file is present.
"""

import functools
import json
import os
import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
VENDORED = REPO_ROOT / "tests" / "data" / "spec_examples.json"


def shared_path() -> pathlib.Path | None:
    """The shared spec_examples.json, if this machine has one."""
    candidates = [
        os.environ.get("AGENTRL_SPEC_EXAMPLES"),
        REPO_ROOT.parent / "shared" / "spec_examples.json",
        "/work/shared/spec_examples.json",
    ]
    for candidate in candidates:
        if candidate and pathlib.Path(candidate).is_file():
            return pathlib.Path(candidate)
    return None


@functools.cache
def load() -> dict:
    """All worked examples, keyed as in the file (e.g. `"tree_max_theorem"`)."""
    path = shared_path() or VENDORED
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def keys_with_prefix(prefix: str) -> list[str]:
    return sorted(k for k in load() if k.startswith(prefix))
