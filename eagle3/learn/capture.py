"""Capture of finished requests: their prompt and reply token ids, written as traffic shards.

The engine thread only appends a record to a queue (`record`, O(1)); a writer thread turns the
records into shards `DIR/traffic/t-<seq>-n<tokens>.jsonl` (one conversation a line, the regenerated
data's fields `prompt_ids` / `response_ids`, so the training pipeline reads a shard as it reads
regenerated data), each written to a temporary file and renamed (a reader never sees half a shard).
The shards are bounded by `max_bytes`: past it the oldest shards are deleted, with a log line. A
write that fails (a full disk: OSError) is logged once and its records stay queued for the next
try, so nothing recorded is lost while the process lives.

Features (the target's aux states at those positions) are not taken from the live batch: the
learner recomputes them for the captured conversations with the feature-store code (learner.py),
so the hot path only copies two id lists. `DIR/learn.json` names the target the traffic came from;
a DIR written by another target is refused (`open_capture`).

What is stored is users' text (as token ids): the prompts and the replies.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Optional

from ..errors import ContractError

log = logging.getLogger("eagle3.learn")

MANIFEST = "learn.json"
FORMAT = "eagle3-learn/1"
SHARD = re.compile(r"^t-(\d{6})-n(\d+)\.jsonl$")


def shard_tokens(path: Path) -> int:
    """Tokens of a traffic shard, from its name."""
    m = SHARD.match(path.name)
    return int(m.group(2)) if m else 0


def traffic_shards(root: Path) -> list[Path]:
    """The traffic shards under DIR, oldest first."""
    folder = root / "traffic"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if SHARD.match(p.name))


def check_identity(root: Path, identity: dict) -> None:
    """DIR/learn.json must name this target; a new DIR gets it written. Raises ContractError."""
    path = root / MANIFEST
    if path.is_file():
        found = json.loads(path.read_text()).get("target", {})
        for field in sorted(set(identity) | set(found)):
            if found.get(field) != identity.get(field):
                raise ContractError(f"learn directory target.{field}", f"{found.get(field)} in {path}",
                                    identity.get(field), "this directory holds another target's "
                                    "traffic and drafts: give --learn a directory of its own")
        return
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"format": FORMAT, "target": identity}, indent=2))


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class TrafficCapture:
    """Records finished requests into DIR/traffic (see the module docstring)."""

    def __init__(self, root: Path, max_bytes: int, flush_records: int = 16, flush_s: float = 5.0):
        self.root, self.max_bytes = Path(root), max_bytes
        self.flush_records, self.flush_s = flush_records, flush_s
        (self.root / "traffic").mkdir(parents=True, exist_ok=True)
        shards = traffic_shards(self.root)
        self.seq = max((int(SHARD.match(p.name).group(1)) for p in shards), default=0)
        self.tokens_written = sum(shard_tokens(p) for p in shards)
        self.dropped_shards = 0
        self.write_errors = 0
        self._queue: queue.Queue = queue.Queue()
        self._pending: list[dict] = []              # writer thread only: not yet on disk
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle3-capture", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def record(self, prompt_ids: list[int], reply_ids: list[int], temperature: float) -> None:
        if reply_ids:
            self._queue.put({"prompt_ids": list(prompt_ids), "response_ids": list(reply_ids),
                             "temperature": temperature, "time": round(time.time(), 3)})

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._collect(self.flush_s)
            if self._pending:
                self.flush()

    def _collect(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while len(self._pending) < self.flush_records:
            left = deadline - time.monotonic()
            if left <= 0 or self._stop.is_set():
                return
            try:
                self._pending.append(self._queue.get(timeout=min(left, 0.5)))
            except queue.Empty:
                pass

    def flush(self) -> bool:
        """Write the pending records as one shard; False (records kept) when the write failed."""
        while True:
            try:
                self._pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if not self._pending:
            return True
        tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in self._pending)
        path = self.root / "traffic" / f"t-{self.seq + 1:06d}-n{tokens}.jsonl"
        try:
            write_atomic(path, "".join(json.dumps(r) + "\n" for r in self._pending))
        except OSError as e:
            self.write_errors += 1
            if not self._failing:
                log.error("learn capture: writing %s failed (%s); %d conversations stay in memory "
                          "and are written at the next try. Fix: free space under %s",
                          path.name, e, len(self._pending), self.root)
            self._failing = True
            return False
        if self._failing:
            log.info("learn capture: writing works again; %d conversations written", len(self._pending))
        self._failing, self._pending = False, []
        self.seq += 1
        self.tokens_written += tokens
        self._bound()
        return True

    def _bound(self) -> None:
        shards = traffic_shards(self.root)
        total = sum(p.stat().st_size for p in shards)
        while total > self.max_bytes and len(shards) > 1:
            oldest = shards.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink()
            self.dropped_shards += 1
            log.info("learn capture: %s dropped (the traffic is over --learn-max-bytes %d)",
                     oldest.name, self.max_bytes)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the writer and write what is queued (the server's shutdown)."""
        self._stop.set()
        self._thread.join(timeout_s)
        self.flush()
