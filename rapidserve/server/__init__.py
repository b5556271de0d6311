"""The OpenAI-compatible HTTP server: request validation, response shapes, detokenization, the app."""
