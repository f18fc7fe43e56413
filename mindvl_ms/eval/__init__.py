"""Evaluation: benchmark metrics (`metrics`), the JSONL benchmark runner (`benchmark`, `mindvl eval`) and the
test-time resolution search (`resolution_search`, `mindvl search-resolution`)."""
