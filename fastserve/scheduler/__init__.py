"""Control-plane scheduling (paper §4.1): jobs, policies, batch formation and the ``Scheduler``.
Pure Python (no torch, ray or cupy): the same objects run in the replica, the tests and the simulator."""
