"""Training the demo model (docs/demo-model.md): corpus, tokenizer, the looped model with the Ouro exit-gate
objective, and its evaluation. Needs the `train` extra (`pip install -e .[train]`) only to build the corpus."""
