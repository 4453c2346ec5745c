"""The HTTP edge: routes, the gate middleware (keys, body limit, access log), error handlers."""
