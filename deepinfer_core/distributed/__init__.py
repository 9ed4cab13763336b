"""An engine instance of N ranks: the process group, expert parallelism, lockstep stepping.

- `group.py`: joining the instance's `torch.distributed` group (gloo on CPU, NCCL on GPU) with a
  deadline that names the missing ranks; `InstanceFailed` when a collective breaks.
- `placement.py`: which physical expert slot holds which logical expert (`phy2log`, `log2phy`,
  `logcnt`), and which rank owns each slot.
- `dispatch.py`: the dispatch/combine interface of an MoE layer and its all-to-all backend.
- `expert_parallel.py`: sharding a model's routed experts over the ranks (applied from outside).
- `lockstep.py`: every rank steps together; idle ranks run dummy steps; a watchdog for stuck steps.
"""
