"""The README's first lines are the two commands a newcomer runs, and CI runs the second one."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands():
    lines = ROOT.joinpath("README.md").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "```bash", "the README must open with a bash block of exactly two commands"
    end = lines.index("```", 1)
    return lines[1:end]


def test_readme_opens_with_exactly_two_commands():
    cmds = readme_commands()
    assert len(cmds) == 2
    assert cmds[0].startswith("pip install") and cmds[1].startswith("pip install")


def test_ci_runs_the_readme_test_command():
    ci = ROOT.joinpath(".ci", "run").read_text(encoding="utf-8").splitlines()
    assert readme_commands()[1] in ci
