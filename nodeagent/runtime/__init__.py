"""Running nodes: the node driver (the sans-I/O policy both runtimes share), the progress record, and the
executors that perform what the driver decides: gRPC transports for the agent, and the simulator."""
