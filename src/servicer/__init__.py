"""gRPC frontend of the inference daemon."""
