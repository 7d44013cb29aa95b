"""The `agentrl` command line."""

from agentrl import cli


def test_schemes_lists_every_scheme_with_options(capsys):
    assert cli.main(["schemes"]) == 0
    out = capsys.readouterr().out
    for name in ["grpo", "dr_grpo", "mt_grpo", "gae", "mt_ppo", "checklist", "tree", "segment",
                 "vspo"]:
        assert f"\n{name} " in "\n" + out, name
    assert "turn_normalizer = 'reached'" in out


def test_commands_of_later_milestones_say_so(capsys):
    assert cli.main(["train", "--config", "configs/cpu_demo.py"]) == 2
    assert "not built yet" in capsys.readouterr().err
