"""TrainConfig: `--set` overrides, config files, and the TOML reader on every supported Python."""
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from eagle3.cli import main
from eagle3.errors import InputError
from eagle3.train.config import TrainConfig
from eagle3.train.cli import parse_args

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def overridden(*items: str) -> TrainConfig:
    return parse_args([arg for item in items for arg in ("--set", item)])[0]


# ---------------------------------------------------------------------------- --set
def test_set_takes_plain_strings_for_string_fields():
    cfg = overridden("autocast=none", "features=online", "out=runs/x", "target=smollm2", "data=a.jsonl")
    assert (cfg.autocast, cfg.features, cfg.out, cfg.target, cfg.data) == (
        "none", "online", "runs/x", "smollm2", "a.jsonl")
    # a string field keeps text that happens to be JSON of another type; JSON strings unquote
    assert overridden("out=123").out == "123" and overridden("autocast=true").autocast == "true"
    assert overridden('autocast="bf16"').autocast == "bf16"


def test_set_parses_json_for_typed_fields():
    cfg = overridden("lr=1e-4", "epochs=3", "fc_precondition=true", "betas=[0.8, 0.9]",
                     "aux_layer_ids=[1, 5, 9]", "max_steps=null", "fc_init_rms=2", "data=[\"a\", \"b\"]")
    assert cfg.lr == 1e-4 and cfg.epochs == 3 and cfg.fc_precondition is True
    assert cfg.betas == (0.8, 0.9) and cfg.aux_layer_ids == (1, 5, 9) and cfg.max_steps is None
    assert cfg.fc_init_rms == 2 and cfg.data == ("a", "b")
    assert overridden("target=null").target is None       # Optional fields: null is None


@pytest.mark.parametrize("item, words", [
    ("lr_max=1e-3", ["lr_max", "unknown", "'lr'", "'epochs'"]),
    ("epochs=three", ["epochs", "'three'", "int"]),
    ("epochs=1.5", ["epochs", "1.5", "int"]),
    ("lr=fast", ["lr", "'fast'", "float"]),
    ("fc_precondition=1", ["fc_precondition", "bool"]),
    ("betas=[0.9]", ["betas", "[0.9]"]),
    ("lr", ["KEY=VALUE", "'lr'"]),
])
def test_set_names_a_bad_key_or_value(item, words):
    with pytest.raises(InputError) as err:
        overridden(item)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_cli_reports_a_bad_set_in_one_line(capsys):
    assert main(["train", "--set", "no_such_key=1", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eagle3: error: ") and "no_such_key" in err and "\n" not in err


# ---------------------------------------------------------------------------- TOML on Python 3.10
def minimum_python(spec: str) -> tuple[int, int]:
    versions = [tuple(int(x) for x in re.findall(r"\d+", s.version)[:2])
                for s in SpecifierSet(spec) if s.operator in (">=", "~=", "==")]
    return min(versions)


def test_pyproject_declares_a_toml_reader_for_every_supported_python():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    low = minimum_python(project["requires-python"])
    if low >= (3, 11):
        return                                              # tomllib is in the standard library
    reqs = [Requirement(r) for r in project["dependencies"]]
    tomli = [r for r in reqs if r.name == "tomli"]
    assert tomli, f"requires-python allows {low} (no tomllib) but tomli is not a dependency"
    for minor in range(low[1], 11):
        env = {"python_version": f"3.{minor}"}
        assert any(r.marker is None or r.marker.evaluate(env) for r in tomli), f"tomli not on 3.{minor}"


def write_toml(tmp_path: Path) -> Path:
    path = tmp_path / "train.toml"
    path.write_text('out = "runs/t"\nlr = 1e-4\nbetas = [0.8, 0.9]\n')
    return path


def test_toml_config_reads_through_tomli_without_tomllib(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("tomli")
    fake.loads = lambda text: calls.append(text) or tomllib.loads(text)
    monkeypatch.setitem(sys.modules, "tomllib", None)      # as on Python 3.10
    monkeypatch.setitem(sys.modules, "tomli", fake)
    cfg = TrainConfig.from_file(write_toml(tmp_path))
    assert calls and cfg.out == "runs/t" and cfg.lr == 1e-4 and cfg.betas == (0.8, 0.9)


def test_toml_config_without_any_reader_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(InputError, match="pip install tomli"):
        TrainConfig.from_file(write_toml(tmp_path))
    json_cfg = tmp_path / "train.json"                     # JSON configs need no TOML reader
    json_cfg.write_text('{"lr": 0.001}')
    assert TrainConfig.from_file(json_cfg).lr == 0.001
    assert TrainConfig.from_file(str(json_cfg)).lr == 0.001
