"""The daemon: gunicorn app, worker, runtime wiring, sd_notify, service files, CLI glue.

The only package that wires concrete objects (Model, Scheduler, app, control
service) and touches systemd's variables.
"""
