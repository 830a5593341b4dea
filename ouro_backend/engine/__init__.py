"""The engine core: requests are scheduled into plans (`scheduler`), a plan becomes one launch of
device work (`model_runner`, with the per-row decode state in `decode_state` / `decode_step`), and the
launch's tokens come back as request outputs (`llm_engine`). KV memory: `kv_cache`, `prefix_cache`,
`swap`, `memory`."""
