"""The coordinator's control plane: its state (ControlState, in SQLite or in memory), the states of jobs and members
with the one table of their moves, and the typed records the state holds."""
