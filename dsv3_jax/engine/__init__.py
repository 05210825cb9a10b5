"""The serving engine: continuous batching of requests over compiled ragged steps.

`api` (the contract: config, events, finish reasons, the engine Protocol), `core` (the engine: requests
and the step loop, on an injected executor), `executor` (the device side: cache, per-slot state,
compiled steps, warm-up, compile counters), `scheduler` (which rows run each step), `paging` (the page
pool, prefix cache), `step` (the host batch layout, step shapes, the jitted step function), `sampling`
(sampling and logprobs inside the step), `mtp_draft` (speculative drafts), `program_cache` (compiled
steps on disk).
Must not tokenize or parse requests (request_stream.py, serve/) nor define model math (model/).
"""
