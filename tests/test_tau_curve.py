"""studies/tau-budget-curve/tau_curve.py: the budget curve's fit and what it says a tau target needs."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("tau_curve", ROOT / "studies" / "tau-budget-curve" / "tau_curve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tau_curve"] = mod
    spec.loader.exec_module(mod)
    return mod


def tau_file(path: Path, temperature: float, tau: float, max_new: int = 256) -> Path:
    path.write_text(json.dumps({"max_new_tokens": max_new, "spec": "tree 4,5,8",
                                "results": [{"temperature": temperature, "prompts": 80, "tau": tau}]}))
    return path


def test_the_fit_recovers_a_log_linear_curve_and_inverts_it():
    curve = load_script()
    a, b = 0.5, 0.09
    xs = [1e5, 3e5, 2e6, 3e6]
    fa, fb = curve.fit([math.log(x) for x in xs], [a + b * math.log(x) for x in xs])
    assert fa == pytest.approx(a) and fb == pytest.approx(b)
    assert curve.tokens_for(a + b * math.log(4.5e8), fa, fb) == pytest.approx(4.5e8, rel=1e-9)
    assert curve.tokens_for(2.0, 1.0, -0.1) == math.inf          # a curve that falls never gets there


def test_the_report_prices_the_target_in_tokens_and_cpu_hours(tmp_path):
    curve = load_script()
    pts = []
    for i, tokens in enumerate((1e5, 1e6)):                 # tau 1.2 -> 1.2 + 0.1 ln 10 at T=0
        t0 = tau_file(tmp_path / f"{i}_t0.json", 0.0, 1.2 + 0.1 * math.log(tokens / 1e5))
        t1 = tau_file(tmp_path / f"{i}_t1.json", 1.0, 1.1 + 0.05 * math.log(tokens / 1e5))
        pts += ["--point", f"p{i}", str(tokens), "100", str(t0), str(t1)]
    out = tmp_path / "curve.md"
    assert curve.main(pts + ["--train-rate", "1000", "--store-rate", "400", "--epochs", "4",
                             "--target", "0", "1.4", "--out", str(out)]) == 0
    text = out.read_text()
    need = 1e5 * math.exp(2.0)                              # 1.2 + 0.1 ln(x / 1e5) = 1.4
    row = next(l for l in text.splitlines() if l.startswith("| 0 |"))
    assert f"{need:,.3g}" in row
    assert f"| {need / 1000 / 3600:,.0f} |" in row          # training hours at 1000 tokens/s
    with pytest.raises(SystemExit, match="two different token counts"):
        curve.fit([1.0, 1.0], [1.0, 2.0])


def test_a_point_measured_on_another_workload_or_twice_at_one_temperature_is_refused(tmp_path):
    curve = load_script()
    a0, a1 = tau_file(tmp_path / "a0.json", 0.0, 1.3), tau_file(tmp_path / "a1.json", 1.0, 1.2)
    b0 = tau_file(tmp_path / "b0.json", 0.0, 1.5, max_new=128)       # 80 x 128, not 80 x 256
    b1 = tau_file(tmp_path / "b1.json", 1.0, 1.3)
    rates = ["--train-rate", "1000", "--store-rate", "400"]
    with pytest.raises(SystemExit, match="b0.json: workload '80 x 128.*80 x 256"):
        curve.main(["--point", "a", "1e5", "1", str(a0), str(a1), "--point", "b", "1e6", "1", str(b0), str(b1)] + rates)
    with pytest.raises(SystemExit, match="both hold temperature"):
        curve.main(["--point", "a", "1e5", "1", str(a0), str(a0)] + rates)
