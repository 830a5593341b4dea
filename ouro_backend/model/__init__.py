"""The Ouro network: checkpoint loading, the recurrent model and its attention backends, sampling,
the tokenizer, the dense fp32 oracle every fast path is tested against, and toy/random checkpoints."""
