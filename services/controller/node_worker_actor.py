"""The engine actor the controller starts: a `WorkerActor` that may serve on its node's address.

On one machine every worker serves on 127.0.0.1. Across machines (Kubernetes pods) the router must
reach the worker where Ray placed it, which is known only once the actor runs: a spec whose host is
"" serves on the node's own IP address.
"""

from __future__ import annotations

import dataclasses

from services.workers.spec import WorkerSpec
from services.workers.worker_server import WorkerActor


class NodeWorkerActor(WorkerActor):
    def __init__(self, spec: WorkerSpec):
        if not spec.host:
            import ray

            spec = dataclasses.replace(spec, host=ray.util.get_node_ip_address())
        super().__init__(spec)

    def rendezvous_address(self) -> str:
        """ "host:port" free on this node, where rank 0 of an instance hosts the instance's rendezvous."""
        import socket

        host = self.server.spec.host
        with socket.socket() as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"

    def node_id(self) -> str:
        """The Ray node this engine runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()
