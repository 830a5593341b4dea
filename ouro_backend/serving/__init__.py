"""The Triton glue: the logic of the Python models in `model_repository/` (whose model.py files only
subclass these classes), kept here so it is unit-testable.

* protocol        - tensor names, request parsing/validation, response arrays (pure numpy)
* options         - engine options from config.pbtxt parameters and the environment
* engine_model    - `ouro_engine`: decoupled model owning the engine processes (one per device: engine_pool)
* front_model     - `ouro`: client-facing decoupled front, straight to those engine processes (cancellable)
* streams         - what both share: per-request buffers, coalescing sender threads
* engine_pool     - the engine processes of a server, and which one takes each request
* engine_server   - the engine process itself (`python -m ouro_backend.serving.engine_server`)
* engine_client   - a connection to an engine process, and how its owner spawns one
* engine_messages - what they say to each other, in which order
* engine_auth     - where an engine process listens and who may connect
* engine_errors   - the errors its clients see
* cancellation    - the watcher that asks is_cancelled() off the hot threads
* text_models     - `preprocessing` / `postprocessing`
* metrics         - custom Prometheus metrics (pb_utils.MetricFamily)
* repository      - renders the model repository's config.pbtxt / model.py files
"""
