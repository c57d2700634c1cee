"""environment.yml delegates to pip and must not drift from pyproject.toml."""
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_environment_yml_delegates_to_pyproject():
    env = (ROOT / "environment.yml").read_text()
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "-e .[dev]" in env, "environment.yml must install the project with pip -e .[dev]"
    torch_pin = next(d for d in proj["dependencies"] if d.startswith("torch"))
    env_pins = re.findall(r'"(torch[^"]*)"', env)
    assert env_pins == [torch_pin], f"environment.yml torch pin {env_pins} != pyproject {torch_pin}"
    py = re.search(r"python=(\d+\.\d+)", env).group(1)
    lo = re.search(r">=(\d+\.\d+)", proj["requires-python"]).group(1)
    assert tuple(map(int, py.split("."))) >= tuple(map(int, lo.split(".")))
    # no package is listed in environment.yml except through the project (one dependency list)
    deps_block = env.split("dependencies:", 1)[1]
    listed = re.findall(r"^\s+- (?!pip\b|python=|\"|-e)([A-Za-z0-9_.-]+)", deps_block, re.M)
    assert listed == [], f"environment.yml lists packages outside pyproject: {listed}"


def test_torch_is_pinned_to_a_range():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_dep = next(d for d in deps if d.startswith("torch"))
    assert "<" in torch_dep, "a bare torch requirement pulls a multi-GB CUDA build on CPU machines"
