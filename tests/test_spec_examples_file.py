"""The vendored copy of spec_examples.json must equal the shared one."""

import json

import pytest

from tests import spec_examples


def test_vendored_copy_matches_shared_file():
    shared = spec_examples.shared_path()
    if shared is None:
        pytest.skip("no shared spec_examples.json on this machine; the vendored copy is used")
    with open(shared, encoding="utf-8") as f:
        shared_data = json.load(f)
    with open(spec_examples.VENDORED, encoding="utf-8") as f:
        vendored = json.load(f)
    assert vendored == shared_data


def test_every_section_is_present():
    data = spec_examples.load()
    for prefix in ["grpo", "mt_grpo", "gae", "checklist", "tree", "portool_format",
                   "short_form_bleu_tokens", "prs", "vspo", "segment", "ppo_loss", "kl"]:
        assert spec_examples.keys_with_prefix(prefix), prefix
    assert len(data) == 25
