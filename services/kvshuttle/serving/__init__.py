"""gRPC serving plumbing every service shares: settings, logging, tracing, the RPC interceptor,
metrics and the server lifecycle."""
