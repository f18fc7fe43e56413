"""mindvl_ms.recipes."""
