"""The `agentrl` command line."""

from agentrl import cli


def test_schemes_lists_every_scheme_with_options(capsys):
    assert cli.main(["schemes"]) == 0
    out = capsys.readouterr().out
    for name in ["grpo", "dr_grpo", "mt_grpo", "gae", "mt_ppo", "checklist", "tree", "segment",
                 "vspo"]:
        assert f"\n{name} " in "\n" + out, name
    assert "turn_normalizer = 'reached'" in out


def test_training_commands_report_bad_configs(capsys, tmp_path):
    assert cli.main(["train", "--config", str(tmp_path / "missing.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["train", "--config", "configs/cpu_demo.py",
                     "--config.train.stpes=3"]) == 2
    assert 'Did you mean "steps"' in capsys.readouterr().err
    assert cli.main(["eval", "--config", "configs/cpu_demo.py",
                     f"--config.workdir={tmp_path}"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
