"""agentfold: a durable execution core for LLM agents, built on event sourcing.

The layers of docs (DESIGN): ``agentfold.domain`` (pure: identities, events, the fold, the
kernel's decision rules), ``agentfold.projections`` (pure projections and the read models
they feed) and ``agentfold.adapters`` (everything with I/O: the runtime, the event stores,
the CLI, the HTTP API, Kafka). Everything lives under this one package, so a project with
its own ``domain`` or ``adapters`` package can install agentfold beside it.
"""
