"""The engine core (docs/engine.md, "Who owns what"): requests are scheduled into plans (`scheduler`,
with `spec_policy`), a plan becomes one launch of device work (`model_runner`, over the per-row
`decode_state`, with `staging`, `prompt_batch`, `cuda_graphs`, `row_sampler`, `speculation`), and the
launch's tokens come back as request outputs (`llm_engine`). KV memory: `block_pool`, `kv_cache`, `swap`,
`memory`."""
