"""Executes the code blocks of docs/adding_a_credit_scheme.md and checks its numbers."""

import contextlib
import io
import pathlib
import re

import numpy as np
import pytest

from agentrl import credit

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "adding_a_credit_scheme.md"


@pytest.fixture
def doc_namespace():
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 3, "the page has three python blocks: maths, registration, usage"
    namespace = {}
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            for block in blocks:
                exec(compile(block, str(DOC), "exec"), namespace)
        namespace["printed"] = stdout.getvalue()
        yield namespace
    finally:
        credit.unregister_scheme("rloo")


def test_worked_example_registers_and_prints_the_documented_advantages(doc_namespace):
    assert "rloo" in credit.available_schemes()
    scheme = credit.get_scheme("rloo")
    assert scheme.options == {"baseline_scale": 1.0}
    expected = np.array([[0, 0, 1.0, 1.0, 1.0, 0], [0, 0, -0.5, -0.5, -0.5, 0],
                         [0, 0, -0.5, -0.5, -0.5, 0]])
    np.testing.assert_allclose(np.asarray(doc_namespace["output"].advantages), expected, atol=1e-6)
    # The printed array in the doc is what the code prints.
    printed = doc_namespace["printed"].strip()
    assert printed in DOC.read_text(encoding="utf-8")


def test_worked_example_properties(doc_namespace):
    rloo = doc_namespace["rloo_advantages"]
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(4, 6))
    mask = np.ones((4, 6), bool)
    advantages = np.asarray(rloo(rewards, mask))
    # Leave-one-out: A_i = R_i − mean of the others.
    for q in range(4):
        for i in range(6):
            others = np.delete(rewards[q], i).mean()
            assert advantages[q, i] == pytest.approx(rewards[q, i] - others, abs=1e-5)
    padded = np.asarray(rloo(np.pad(rewards, [(0, 0), (0, 2)], constant_values=9.0),
                             np.pad(mask, [(0, 0), (0, 2)])))
    np.testing.assert_allclose(padded[:, :6], advantages, atol=1e-6)
    np.testing.assert_array_equal(padded[:, 6:], 0.0)
    batch = doc_namespace["batch"]
    half = credit.get_scheme("rloo")(batch, baseline_scale=0.5).advantages
    full = np.asarray(doc_namespace["output"].advantages)
    np.testing.assert_allclose(np.asarray(half), 0.5 * full, atol=1e-6)
