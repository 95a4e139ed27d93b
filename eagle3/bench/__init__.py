"""Benchmarks: `eagle3 bench` (this project against HF transformers, llama.cpp and vLLM, one
interleaved run; cli.py) and `eagle3 bench serve` (the server under concurrent clients; serving.py)."""
from .cli import bench_main
from .runner import BenchConfig, build, run
from .stats import Record
from .systems import GenParams, RunResult, System
from .workload import BenchPrompt, load_questions, load_workload, make_prompts, select_questions

__all__ = ["bench_main", "BenchConfig", "build", "run", "Record", "GenParams", "RunResult", "System",
           "BenchPrompt", "load_questions", "load_workload", "make_prompts", "select_questions"]
