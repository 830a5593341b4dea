"""What users run: `ouro-generate` (cli), `ouro-serve` (serve) and `ouro-bench` (bench, with the eager
baseline it compares against)."""
