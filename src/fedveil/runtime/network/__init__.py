"""The networked runtime: a gRPC server-side Communicator and device agents over mutual TLS."""
