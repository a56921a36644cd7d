"""Running the model: sampling (09), generation (10), the continuous-batching engine (12), speculative decoding (17)."""
