"""The OpenAI-compatible server (14): the protocol, the FastAPI app, and what an operator needs to run it."""
