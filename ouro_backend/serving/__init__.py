"""The Triton glue: the logic of the Python models in `model_repository/` (whose model.py files only
subclass these classes), kept here so it is unit-testable.

* protocol      - tensor names, request parsing/validation, response arrays (pure numpy)
* options       - engine options from config.pbtxt parameters and the environment
* engine_model  - `ouro_engine`: decoupled model owning the engine process (ouro_backend.serving.engine_process)
* front_model   - `ouro`: client-facing decoupled front, straight to that engine process (cancellable)
* streams       - what both share: per-request buffers, coalescing sender threads
* cancellation  - the watcher that asks is_cancelled() off the hot threads
* text_models   - `preprocessing` / `postprocessing`
* metrics       - custom Prometheus metrics (pb_utils.MetricFamily)
* repository    - renders the model repository's config.pbtxt / model.py files
"""
