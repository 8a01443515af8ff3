"""The control plane: control.proto, its committed grpclib stubs, the service and the client.

Regenerate the stubs with `make proto` (a test regenerates and diffs them).
"""
