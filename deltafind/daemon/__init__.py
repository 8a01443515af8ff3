"""The daemon: gunicorn app, worker, runtime wiring, sd_notify, service files, CLI glue.

It runs what compose.py builds from settings (Model, scheduler limits, server config) with the
app and the control service, and alone touches systemd's variables.
"""
