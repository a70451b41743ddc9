"""Jobs: the kind registry (registry), the outbox (outbox), leases (leases) and the one lifecycle every
job kind runs through (lifecycle). Import from the module that owns a name; this package re-exports
nothing, so the Celery app can read the registry without importing the outbox that sends through it."""
