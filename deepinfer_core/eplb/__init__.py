"""The expert-parallel load balancer (EPLB, SPEC §1 last row and §6).

- `policy.py`: from measured per-expert load to a new placement (`phy2log`): replicate hot
  experts into the redundant slots, then pack slots onto ranks so each rank gets a similar load;
  a hierarchical policy (expert groups to nodes first, for prefill) and a global one (decode).
- `rearrange.py`: moving expert weights between ranks to a new placement (one all-to-all per layer).
- `balancer.py`: per-step load counting, the role's rearrangement schedule, imbalance measurement.
"""
