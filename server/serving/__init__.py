"""From a validated request to the engine and back: prompts, continuation, streaming, sessions, responses."""
