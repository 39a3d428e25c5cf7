"""Admission control (the ``admission`` filter): who gets into a pool, when, and who is told to come back.

- ``queue``: the per-pool queue with priority classes, deadlines and Virtual-Token-Counter fair sharing,
  and the admit / queue / shed decision from the predicted wait (pure; runs on any clock).
- ``capacity``: how much a pool can take, measured online (adaptive concurrency limit from service
  times and the replicas' vLLM metrics) and how fast its queue drains.
- ``limits``: tenants' rpm / tpm token buckets and $ budgets per day, in Redis (shared by gateway
  processes, atomic Lua) or in-process, failing open (or closed) when Redis is down.
- ``filter``: the filter that ties them to a request (``AdmissionFilter``).

docs/admission.md explains the decisions and the figures.
"""
