"""The wire format: request schemas, response and chunk builders, the error envelope (no engine)."""
