"""The ports, the heartbeat timing and the retention defaults that the daemons, their command lines and their
defaults share, in one place (the deploy files and docs/operations.md write the same numbers out for operators)."""

COORDINATOR_PORT = 7070  # the coordinator's gRPC service, for agents and operators
ENROLL_PORT = 7071  # the coordinator's enrollment service: a join token for a node certificate
COORDINATOR_METRICS_PORT = 9400
COORDINATOR_HEALTH_PORT = 7072  # the coordinator's gRPC health service, plaintext, for probes (--health-listen)
AGENT_PORT = 7100  # an agent's peer service
AGENT_LANE_PORT = 7200  # an agent's tensor lanes in the shipped deployments (--lane-port; the flag's default is any)
AGENT_HEALTH_PORT = 7300  # an agent's gRPC health service, plaintext, for probes (--health-listen)
AGENT_METRICS_PORT = 9401
COORDINATOR_ADDRESS = f"127.0.0.1:{COORDINATOR_PORT}"  # where an agent or a command looks when told nothing

HEARTBEAT_INTERVAL_S = 2.0  # how often an agent says it is up; the coordinator sends it at registration
HEARTBEAT_TIMEOUT_S = 15.0  # a node silent for this long is marked down
REPORT_INTERVAL_S = 1.0  # how often a node reports its progress (the simulator's: in a robust job only, virtual)
RATE_WINDOW_S = 30.0  # `coordinator status`'s recent steps/s of a node: over its reports of this long

KEEP_RUNS = 100  # the coordinator keeps the run directories of this many ended jobs, the newest (--keep-runs)
KEEP_JOBS = 1000  # the coordinator keeps the records of this many ended jobs, the latest ended (--keep-jobs)
KEEP_CHECKPOINTS = 0  # an agent keeps the checkpoints of this many jobs that ended on it (--keep-checkpoints)
MAX_MODEL_MEMORY_MIB = 2048  # a job's model, its gradients and momentum, on each node (--max-model-memory)
