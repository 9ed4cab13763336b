"""The router: the request state machine E -> P -> D, its policies and the pool registry."""
