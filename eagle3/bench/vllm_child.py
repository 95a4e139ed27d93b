"""The vLLM end of the bench's vllm-plain / vllm-eagle3 systems (eagle3/bench/vllm_peer.py starts it).

Run by the vLLM venv's python (scripts/vllm_env.sh), as a file: it imports vLLM and the standard
library, never eagle3 (whose dependencies that venv does not have). One long-lived process per system:
vLLM is loaded once, then serves one generation per request.

Protocol, one JSON object per line. Requests on stdin; replies on the process's original stdout,
which is kept for the protocol alone (fd 1 then points at stderr, so that vLLM's logging, which writes
to stdout, cannot break a reply). End of stdin ends the process.

    {"op": "load", "model": DIR, "draft": DIR | null, "num_speculative_tokens": K, "dtype": "float32",
     "enforce_eager": false, "max_model_len": N, "seed": S}
        -> {"ok": true, "load_s": SECONDS, "vllm": VERSION}
    {"op": "generate", "prompt_ids": [...], "temperature": T, "seed": S, "max_tokens": N,
     "stop_ids": [...], "ignore_eos": false}
        -> {"ok": true, "tokens": [...], "seconds": SECONDS, "accepted": [per verify step] | null,
            "drafted": DRAFT_TOKENS | null}
    {"op": "quit"}
    any failure -> {"ok": false, "error": "Type: message"}

`seconds` is the wall time of llm.generate (prefill included). `accepted` is vLLM's own per-request
count (--per-request-spec-decode-metrics detailed): draft tokens accepted at each verify step.

Sampling is plain temperature sampling (top-k/top-p/min-p off). At T > 0 vLLM's EAGLE proposer still
drafts greedily (speculative_config draft_sample_method defaults to "greedy"): the rejection sampler
takes the draft as a point mass, accepts token x with probability p(x) and on rejection samples from
p with x removed, so the output keeps the target's distribution.
"""
import json
import os
import sys
import time

# Python put this file's folder (eagle3/bench) first on sys.path: its modules must not shadow vLLM's
# imports (the bench's own modules are for the other venv).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

LLM = None


def load(req: dict) -> dict:
    global LLM
    import vllm
    kw = dict(model=req["model"], dtype=req["dtype"], max_model_len=req["max_model_len"],
              enforce_eager=req["enforce_eager"], seed=req["seed"],
              generation_config="vllm",          # the model's generation_config.json sets no defaults
              enable_prefix_caching=False,       # every prompt is prefilled in full, as in the other systems
              max_num_seqs=1)                    # the bench runs one request at a time
    if req.get("draft"):
        kw["speculative_config"] = {"method": "eagle3", "model": req["draft"],
                                    "num_speculative_tokens": req["num_speculative_tokens"]}
        kw["per_request_spec_decode_metrics"] = "detailed"
    t0 = time.perf_counter()
    LLM = vllm.LLM(**kw)
    return {"load_s": time.perf_counter() - t0, "vllm": vllm.__version__}


def generate(req: dict) -> dict:
    from vllm import SamplingParams
    if LLM is None:
        raise RuntimeError("generate before load")
    params = SamplingParams(temperature=req["temperature"], top_k=0, top_p=1.0, min_p=0.0,
                            repetition_penalty=1.0, seed=req["seed"], max_tokens=req["max_tokens"],
                            stop_token_ids=req["stop_ids"], ignore_eos=req["ignore_eos"],
                            detokenize=False)
    t0 = time.perf_counter()
    out = LLM.generate([{"prompt_token_ids": req["prompt_ids"]}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    seq = out.outputs[0]
    metrics = seq.spec_decode_metrics
    return {"tokens": list(seq.token_ids), "seconds": seconds,
            "accepted": None if metrics is None else list(metrics.per_step_accepted),
            "drafted": None if metrics is None else metrics.num_draft_tokens}


HANDLERS = {"load": load, "generate": generate}


def serve(requests, replies) -> None:
    for line in requests:
        req = json.loads(line)
        if req.get("op") == "quit":
            return
        try:
            reply = {"ok": True, **HANDLERS[req["op"]](req)}
        except Exception as e:  # noqa: BLE001  every failure goes back to the parent, which reports it
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":      # vLLM on CPU spawns processes that re-import __main__
    main()
