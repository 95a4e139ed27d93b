"""OpenMP wait policy and thread count: set before torch loads, shown in info."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3 import kernels, threads

ROOT = Path(__file__).resolve().parents[1]


def test_configure_sets_a_short_spin_unless_the_user_chose():
    env = {}
    setup = threads.configure(env, torch_loaded=False)
    assert setup.wait_policy == "GOMP_SPINCOUNT=30000" and "eagle3 default" in setup.source
    assert env["GOMP_SPINCOUNT"] == "30000" and "OMP_WAIT_POLICY" not in env
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env = {key: "active" if key == "OMP_WAIT_POLICY" else "1000"}
        assert threads.configure(env, torch_loaded=False).source == "set by the user"
        assert len(env) == 1
    late = threads.configure({}, torch_loaded=True)
    assert "torch was imported before eagle3" in late.source


def _openmp_settings(code: str, **env_vars: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_vars, OMP_DISPLAY_ENV="verbose")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    if "GOMP_SPINCOUNT" not in out.stderr:
        pytest.skip("torch's OpenMP is not libgomp (no GOMP_SPINCOUNT in OMP_DISPLAY_ENV)")
    return out.stderr


def test_an_eagle3_process_spins_briefly():
    """Long spins cost far more than the core they wait for when another process has it; no spin
    at all costs ~40% on a quiet machine (threads.py): eagle3 spins 30000 rounds, then sleeps."""
    err = _openmp_settings(ENTRY)
    assert "GOMP_SPINCOUNT = '30000'" in err


# the `eagle3` command as its console script runs it: import eagle3.cli, call main (--help: it
# stops after the tuning, before anything imports torch), then torch loads
ENTRY = """
import sys, eagle3.cli
assert "torch" not in sys.modules, "importing the CLI imported torch: OpenMP read its settings too early"
try:
    eagle3.cli.main(["--help"])
except SystemExit:
    pass
import torch; torch.ones(4).sum()
"""


def test_importing_eagle3_leaves_openmp_alone():
    """`import eagle3` sets nothing: OpenMP keeps its defaults until an entry point tunes it."""
    err = _openmp_settings("import eagle3.cli, torch; torch.ones(4).sum()")
    assert "GOMP_SPINCOUNT = '30000'" not in err


def test_a_user_wait_policy_is_respected():
    err = _openmp_settings(ENTRY, OMP_WAIT_POLICY="ACTIVE")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in err and "GOMP_SPINCOUNT = '0'" not in err


@pytest.mark.skipif(kernels.small_linear(torch.float32) is None, reason="small-M kernels not built here")
def test_the_kernels_share_torchs_openmp_runtime():
    """The extension's libgomp.so.1 is torch's copy: one runtime, one wait policy and thread count.
    (Wheels such as sentencepiece carry private, renamed copies for their own use.)"""
    kernels.parallel_threads()
    shared = {"libgomp.so.1", "libgomp.so.1.0.0", "libiomp5.so", "libomp.so"}
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if line.split()[-1].rsplit("/", 1)[-1] in shared}
    assert len(runtimes) == 1, runtimes
    ldd = subprocess.run(["ldd", kernels.state().module.__file__], capture_output=True, text=True).stdout
    (line,) = [l for l in ldd.splitlines() if "libgomp.so.1 =>" in l]
    # the rpath makes `ldd` (and a process that has not loaded torch's copy yet) agree
    assert Path(line.split("=>")[1].split("(")[0].strip()).resolve() == Path(runtimes.pop()).resolve(), line


@pytest.mark.real
def test_info_shows_the_thread_count_and_wait_policy(capsys):
    from eagle3.cli import main
    assert main(["info"]) == 0
    (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("CPU threads")]
    assert f"{torch.get_num_threads()} (torch.get_num_threads)" in line and "SPIN" in line.upper()
    assert "governor on" in line


@pytest.mark.real
def test_bench_contention_smoke():
    """tools/bench_contention.py runs end to end (a few tokens; timing is for a quiet machine)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)       # this process's eagle3 set it for its children
    out = subprocess.run([sys.executable, "tools/bench_contention.py", "--tokens", "2", "--reps", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 1), out.stderr[-2000:]    # 1: below the bar (not judged here)
    assert "GOMP_SPINCOUNT=30000 (eagle3 default" in out.stdout
    assert "one busy core" in out.stdout and "ratio" in out.stdout


class FakeMachine:
    """A clock on which a step takes 1 / speed[threads] seconds; `busy` switches the speeds."""

    def __init__(self, monkeypatch, costs=(1.0,)):
        self.now, self.busy, self.costs, self.i = 0.0, False, costs, 0
        monkeypatch.setattr(threads.time, "perf_counter", lambda: self.now)

    def step(self, governor) -> int:
        governor.before_step()
        n = torch.get_num_threads()
        speed = {2: 20.0, 1: 70.0} if self.busy else {2: 110.0, 1: 74.0}
        self.i += 1
        self.now += self.costs[self.i % len(self.costs)] / speed[n]     # step kinds cost differently
        governor.after_step()
        return n


def test_the_governor_takes_one_thread_while_a_core_is_busy_and_two_when_quiet(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        machine, gov = FakeMachine(monkeypatch), threads.ThreadGovernor()
        quiet = [machine.step(gov) for _ in range(300)]
        assert quiet.count(1) <= 6 and quiet[-1] == 2          # probes with back-off only
        machine.busy = True
        busy = [machine.step(gov) for _ in range(300)]
        assert busy[:4].count(2) <= 3 and busy[-50:].count(1) >= 49
        assert busy.count(2) <= 12                             # a lost probe doubles the wait
        machine.busy = False
        again = [machine.step(gov) for _ in range(600)]
        assert again[-100:].count(2) >= 98                     # found by a probe, and kept
        gov.restore()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_mix_of_step_costs_on_a_quiet_machine_keeps_two_threads(monkeypatch):
    """Speculative steps differ (a plain step, trees of 4-16 rows): not a sign of contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        machine, gov = FakeMachine(monkeypatch, costs=(1.0, 1.4, 1.0, 1.9, 1.2, 1.0, 1.6)), threads.ThreadGovernor()
        counts = [machine.step(gov) for _ in range(500)]
        assert counts.count(1) <= 8 and counts[-100:].count(2) >= 99
    finally:
        torch.set_num_threads(before)


def test_a_step_weighed_by_its_expected_work_keeps_two_threads_through_stretches_of_trees(monkeypatch):
    """Under the adaptive step a tree costs ~4 plain steps: a stretch of trees after plain steps is
    not a slowdown once each step is weighed by its expected work (the policy's table cost).
    Unweighed, this run spent 152 of its 640 steps on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    machine = FakeMachine(monkeypatch, costs=(1.0,) * 20 + (4.0,) * 12)     # plain steps, then trees
    gov = threads.ThreadGovernor()
    counts = []
    try:
        for _ in range(640):
            gov.before_step()
            n = torch.get_num_threads()
            machine.i += 1
            cost = machine.costs[machine.i % len(machine.costs)]
            machine.now += cost / (110.0 if n == 2 else 74.0)
            gov.after_step(cost)
            counts.append(n)
        assert counts.count(1) <= 8 and counts[-100:].count(2) >= 99, counts.count(1)
    finally:
        gov.restore()
        torch.set_num_threads(before)


HAND_OVER = """
import json, os, threading
import eagle3; eagle3.tune_process()
import torch
from eagle3 import threads
torch.set_num_threads(2)
count = lambda: len(os.listdir('/proc/self/task'))
work = lambda: torch.ones(1 << 22).add_(1)          # one parallel region (above the grain)
work(); loaded = count()                             # the main thread now has a team: +1 worker
handed = threads.hand_over_cores(); after = count()
work(); again = count()                              # main alone: no new worker
seen = {}
def engine():
    work(); seen.update(threads=torch.get_num_threads(), count=count())
t = threading.Thread(target=engine); t.start(); t.join()
print(json.dumps(dict(handed=handed, loaded=loaded, after=after, again=again, main=torch.get_num_threads(), **seen)))
"""


def test_hand_over_leaves_one_thread_with_an_openmp_team():
    """libgomp spins at a barrier only while it manages no more threads than CPUs; a second
    thread's team made every decode step's ~200 barriers futex sleeps (14.6 vs 6.3 ms a token,
    threads.py). After hand_over_cores the main thread's worker is gone and it never starts another,
    while a thread started later still runs torch.get_num_threads() threads."""
    out = subprocess.run([sys.executable, "-c", HAND_OVER], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["handed"]:
        pytest.skip("torch's OpenMP runtime is not libgomp: nothing to hand over")
    assert r["after"] == r["loaded"] - 1, r          # the main thread's worker exited
    assert r["again"] == r["after"] and r["main"] == 1, r
    assert r["threads"] == 2 and r["count"] == r["after"] + 2, r     # the engine thread + its worker


def test_the_servers_workers_hand_over_the_cores(monkeypatch):
    """The engine worker hands the cores over as it starts (before its thread runs a step)."""
    import asyncio
    from eagle3.serve import queue
    calls = []
    monkeypatch.setattr(queue, "hand_over_cores", lambda: calls.append(1) or True)

    class Scheduler:
        has_work = False

    worker = queue.EngineWorker(Scheduler(), max_queue=1)

    async def cycle():
        await worker.start()
        await worker.stop()
    asyncio.run(cycle())
    assert calls == [1]


def test_the_governors_probe_and_the_adaptive_steps_probe_never_share_a_step(monkeypatch):
    """Both probe after 16 steps and double the wait: they fell on the same steps, so every shape the
    policy probed ran on one thread (~2x slow at T=1 on the 2-core Xeon) and lost to plain decoding.
    Through Engine.decode_step: the governor holds its probe while the policy's is due, and a step
    the governor ran on the probed count is not timed for the policy."""
    from types import SimpleNamespace
    from eagle3.generate.engine import Engine
    from eagle3.runtime.costs import CostTable
    from eagle3.speculative.policy import PLAIN, AdaptivePolicy
    from eagle3.speculative.step import Step
    from eagle3.speculative.tree import SpecParams
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    costs = CostTable((1, 2, 4, 8), (10.0, 10.5, 11.0, 13.0), (1.0, 1.0, 1.1, 1.3))
    policy = AdaptivePolicy((SpecParams(4, 5, 8, 0.0),), costs, probe_share=0)   # probes at the doubling intervals
    gov = threads.ThreadGovernor()
    seen, now = [], [0.0]
    monkeypatch.setattr(threads.time, "perf_counter", lambda: now[0])   # 2 threads beat 1

    class Decoder:
        timed = True

        def __init__(self):
            self.policy = policy

        def step(self):
            probe = policy.probe_due and policy.steps > 2
            arm = policy.choose()
            one_thread = torch.get_num_threads() == 1
            seen.append((probe, one_thread, self.timed))
            now[0] += 1 / 74 if one_thread else 1 / 110
            rows = 1 if arm == PLAIN else 8
            policy.observe(arm, Step([0], 0, proposed=rows - 1), 0 if arm == PLAIN else 5,
                           10.0 if arm == PLAIN else 30.0, timed=self.timed)   # drafting never pays
            return Step([0], 0)

    try:
        engine, decoder = SimpleNamespace(governor=gov), Decoder()
        for _ in range(300):
            Engine.decode_step(engine, decoder)
        policy_probes = [i for i, (p, _, _) in enumerate(seen) if p]
        governor_probes = [i for i, (_, one, _) in enumerate(seen) if one]
        assert len(policy_probes) >= 3 and len(governor_probes) >= 3, (policy_probes, governor_probes)
        assert not set(policy_probes) & set(governor_probes), (policy_probes, governor_probes)
        assert all(timed != one for _, one, timed in seen)      # one-thread steps are not timed
    finally:
        gov.restore()
        torch.set_num_threads(before)
