"""The node agent daemon (daemon.py) and what it runs per job: the runner thread (runner.py) that drives the node
driver, the dispatch of its sends to transports (dispatch.py), the all-reduce (collective.py) and checkpoints
(checkpoint.py)."""

from nodeagent.agent.daemon import Agent, AgentConfig

__all__ = ["Agent", "AgentConfig"]
