"""The KV cache: dense (08), paged with prefix caching (11), paged attention, and packed batches (12)."""
