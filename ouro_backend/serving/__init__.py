"""The Triton glue: the logic of the Python models in `model_repository/` (whose model.py files only
subclass these classes), kept here so it is unit-testable.

* protocol      - tensor names, request parsing/validation, response arrays (pure numpy)
* options       - engine options from config.pbtxt parameters and the environment
* engine_model  - `ouro_engine`: decoupled model owning one LLMEngine, engine thread, cancellation
* front_model   - `ouro`: client-facing decoupled BLS front (cancellable, unlike the ensemble)
* text_models   - `preprocessing` / `postprocessing`
* metrics       - custom Prometheus metrics (pb_utils.MetricFamily)
* repository    - renders the model repository's config.pbtxt / model.py files
"""
