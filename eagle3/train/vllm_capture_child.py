"""Run by the vLLM venv's python as a file: prefill prompts in vLLM, captured states to files.

    python vllm_capture_child.py JOB.json

JOB.json: {"model", "layer_ids" (vLLM's numbering: input to layer i, L = the last layer's output),
"prompts" (lists of token ids), "out_dir", "dtype", "max_model_len", "enforce_eager", "seed",
"skip_tokenizer_init", "connector" ({"name", "module_path"}: our Eagle3FeatureConnector unless a test or a user names
vLLM's example one)}. Each prompt runs once with max_tokens=1 under the `extract_hidden_states`
speculative method; its connector writes one file per request. Writes <out_dir>/index.json: one
{"index", "path", "num_tokens"} per prompt, in prompt order. Imports only vLLM and the standard
library, and eagle3.engines (the standard library only); the connector is loaded by vLLM by module path.
"""
import json
import os
import sys

# this file's folder holds modules named like common ones (config, data): keep it off the path
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def run(job: dict) -> list[dict]:
    from vllm import LLM, SamplingParams
    from eagle3.engines import IDS_KEY          # the standard library only (PYTHONPATH: the repository)
    from vllm.inputs import TokensPrompt

    connector = job.get("connector") or {"name": "Eagle3FeatureConnector",
                                         "module_path": "eagle3.train.vllm_connector"}
    kv = {"kv_connector": connector["name"], "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": job["out_dir"]}}
    if connector.get("module_path"):
        kv["kv_connector_module_path"] = connector["module_path"]
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              enforce_eager=job["enforce_eager"], seed=job["seed"], enable_prefix_caching=False,
              skip_tokenizer_init=job.get("skip_tokenizer_init", False),
              enable_chunked_prefill=False, max_num_batched_tokens=job["max_model_len"],
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      IDS_KEY: job["layer_ids"]}}},
              kv_transfer_config=kv)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]],
                        SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    index = []
    for i, (ids, out) in enumerate(zip(job["prompts"], outs)):
        params = out.kv_transfer_params or {}
        if "hidden_states_path" not in params:
            raise RuntimeError(f"prompt {i}: vLLM returned no hidden_states_path (kv_transfer_params="
                               f"{params}); is the connector a hidden-states connector?")
        index.append({"index": i, "path": params["hidden_states_path"], "num_tokens": len(ids)})
    return index


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    os.makedirs(job["out_dir"], exist_ok=True)
    index = run(job)
    with open(os.path.join(job["out_dir"], "index.json"), "w") as f:
        json.dump(index, f)
    print(json.dumps({"captured": len(index), "index": os.path.join(job["out_dir"], "index.json")}), flush=True)


if __name__ == "__main__":      # vLLM on CPU spawns processes that re-import __main__
    main()
