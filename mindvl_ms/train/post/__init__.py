"""mindvl_ms.train.post."""
