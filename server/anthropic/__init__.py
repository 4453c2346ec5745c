"""The Anthropic Messages API's wire format: requests, messages, stream events and the error envelope."""
