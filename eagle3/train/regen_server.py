"""Regeneration through an OpenAI-compatible server (eagle3 serve, vLLM, SGLang): the output of
train.regen (one JSON line per conversation, resumable by id, the manifest beside it), with the
target's replies written by the engine that serves it.

Each prompt goes to POST {url}/v1/completions as its chat-templated token ids (the ids the
in-process path generates from), with max_tokens, the conversation's temperature and a seed of its
own, and `return_token_ids` (vLLM's field; eagle3 serve answers it too). A server that refuses
that field is asked again without it, and its text is tokenized. `concurrency` requests are in
flight at once, so a batching server decodes them together.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

from ..errors import InputError
from .regen import (RegenConfig, RegenJob, _encode_rows, _load_manifest, _update_manifest, done_ids,
                    write_json_atomic)


class Completion(NamedTuple):
    token_ids: list[int]      # the reply's ids, without an end-of-text token
    stopped: bool             # the server stopped at the end-of-text token ("stop")


@dataclass
class ServerClient:
    url: str                          # e.g. http://127.0.0.1:8000 (with or without /v1)
    api_key: Optional[str] = None
    model: Optional[str] = None
    timeout_s: float = 600.0
    token_ids: bool = True            # ask for the output's ids (else tokenize the text)

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/completions"

    def complete(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int,
                 tokenizer) -> Completion:
        body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, **({"model": self.model} if self.model else {})}
        try:
            answer = self._post({**body, "return_token_ids": True} if self.token_ids else body)
        except _Refused as e:
            if not self.token_ids or "return_token_ids" not in str(e):
                raise InputError(f"{self.endpoint} refused the request: {e}. Fix: check --model "
                                 "and that the server serves the target") from None
            self._text_from_now("refuses")
            answer = self._post(body)
        choice = answer["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:                                 # refused, or ignored: the text it is
            if self.token_ids:
                self._text_from_now("ignores")
            ids = tokenizer.encode(choice.get("text", ""), add_special_tokens=False)
        if ids and max(ids) >= len(tokenizer):
            raise InputError(f"{self.endpoint} answered token id {max(ids)}, outside the target's "
                             f"vocabulary of {len(tokenizer)}: the server runs another model. Fix: "
                             "point --regen-server at a server of the target")
        return Completion(list(ids), choice.get("finish_reason") == "stop")

    def _text_from_now(self, how: str) -> None:
        """An engine without the field: its replies are tokenized from their text, said once."""
        self.token_ids = False
        print(f"eagle3: {self.endpoint} {how} return_token_ids; its replies are tokenized from "
              "their text (the manifest says so: reply_ids)", file=sys.stderr)

    def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.endpoint, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:500]
            if e.code in (400, 422):
                raise _Refused(f"HTTP {e.code}: {detail}") from None
            raise InputError(f"{self.endpoint}: HTTP {e.code}: {detail}. Fix: check the server's URL, "
                             "--api-key and --model") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise InputError(f"{self.endpoint}: unreachable ({e}). Fix: start the server, or check "
                             "the URL") from None


class _Refused(Exception):
    """The server answered 400/422: the request (a field) was refused."""


def conversation_seed(seed: int, conversation_id: str) -> int:
    """Each conversation's sampling seed: the run's seed and the id (resumed runs draw the same)."""
    return seed * 1_000_003 + zlib.crc32(conversation_id.encode()) % 1_000_003


def run_regen_server(client: ServerClient, tokenizer, job: RegenJob, cfg: RegenConfig, eos_id: int,
                     concurrency: int = 16, progress: Optional[Callable] = None) -> dict:
    """Replies for every prompt not yet in job.out_jsonl, `concurrency` requests at a time; records
    are written as they finish (the file is keyed by id). Returns the manifest."""
    if concurrency < 1:
        raise InputError(f"concurrency={concurrency}: must be >= 1")
    have = done_ids(job.out_jsonl)
    rows = _encode_rows(tokenizer, [(i, p) for i, p in enumerate(job.prompts) if p.id not in have], cfg)
    manifest = _load_manifest(job, cfg)
    manifest.update(server=client.url, model=client.model, concurrency=concurrency)
    bar = progress(total=len(have) + len(rows), initial=len(have)) if progress else None

    def one(row):
        prompt, ids, temperature = row
        t0 = time.time()
        out = client.complete(ids, cfg.max_new_tokens, temperature, conversation_seed(cfg.seed, prompt.id),
                              tokenizer)
        reply = out.token_ids + ([eos_id] if out.stopped else [])
        return ({"id": prompt.id, "prompt": prompt.text, "temperature": temperature, "prompt_ids": ids,
                 "response_ids": reply, "finish": "eos" if out.stopped else "length"},
                {"new_tokens": len(reply), "prompt_tokens": len(ids), "eos": int(out.stopped),
                 "gen_s": time.time() - t0})

    t_last = time.time()
    with open(job.out_jsonl, "a", encoding="utf-8") as f, ThreadPoolExecutor(concurrency) as pool:
        for rec, stats in pool.map(one, rows):
            f.write(json.dumps(rec) + "\n")
            f.flush()
            now = time.time()
            _update_manifest(manifest, stats, now - t_last, 1)
            manifest["reply_ids"] = "the server's token_ids" if client.token_ids else "tokenized text"
            t_last = now
            write_json_atomic(job.manifest, manifest)
            if bar:
                bar.update(1)
                bar.set_postfix(tok_s=f"{manifest['new_tokens_per_s']:.1f}")
    if bar:
        bar.close()
    return manifest
