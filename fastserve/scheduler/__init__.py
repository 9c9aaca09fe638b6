"""Control-plane scheduling (paper §4.1): jobs, policies, batch formation and the ``Scheduler``.

Pure Python (no torch, ray or cupy) so the same objects run in the Serve replica, in tests and in
the simulator. Entry points: ``Scheduler`` (``fastserve.scheduler.scheduler``), the configs
(``fastserve.scheduler.config``) and the profile (``fastserve.scheduler.profile``).
"""
